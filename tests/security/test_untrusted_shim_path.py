"""polar-untrusted runs before the code under test is confined, as the verifier's user (root in a sandbox). A task's
PATH may name a directory the agent wrote (its venv in the workspace, first on PATH in a Harbor ``[verifier] env``):
a ``python3``, ``setpriv`` or ``id`` the agent put there must never be what the shim runs, or it runs unconfined and
writes the reward. The command under test itself is still found on the caller's PATH (and runs confined). The shim
is run for real here, on the host, with such a PATH."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes.base import TOOLS_HOST

SHIM = TOOLS_HOST / "polar-untrusted"
PLANTED = ("python3", "setpriv", "id", "dirname", "find", "grep", "mkdir", "chown", "mktemp", "sh")


def _plant(bin_dir: Path, marker: Path) -> None:
    """The agent's look-alikes of the shim's tools: each records that it ran, then does nothing."""
    bin_dir.mkdir(parents=True)
    for name in PLANTED:
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho {name} >> {marker}\nexit 0\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    test = bin_dir / "run-tests"  # the command under test: the caller's PATH still finds it
    test.write_text("#!/bin/sh\necho ran > result.txt\n")
    test.chmod(test.stat().st_mode | stat.S_IEXEC)


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a system python3")
def test_the_shim_runs_only_the_systems_tools_whatever_the_callers_path(tmp_path: Path) -> None:
    marker = tmp_path / "planted-tools-ran"
    agent_bin = tmp_path / "workspace" / ".venv" / "bin"
    _plant(agent_bin, marker)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{agent_bin}:{os.environ['PATH']}"}
    done = subprocess.run(["/bin/sh", str(SHIM), "run-tests"], cwd=work, env=env, capture_output=True, text=True)
    assert not marker.exists(), f"the shim ran the agent's {marker.read_text().split()}"
    assert done.returncode == 0, done.stderr
    assert (work / "result.txt").read_text() == "ran\n"  # the command under test ran, from the caller's PATH
