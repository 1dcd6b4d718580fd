"""Issue 29 (found reading bwrap_args' argument list for the mutation round): as root, a bwrap sandbox starts with two
processes that hold every capability outside the sandbox's user namespace (the outer bwrap and ``setpriv``). They
ran with the exec's own environment, so where an exec's PATH or LD_PRELOAD / LD_LIBRARY_PATH named a directory the
agent writes (a task's ``[verifier] env`` with its venv in the workspace), a ``setpriv`` or a library the agent left
there ran as host root with every capability (seen: it rewrote the host-wide kernel.core_pattern). Now ``setpriv``
is named by its host path and the loader's variables reach only the sandboxed command."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

from polar_cli.rollout.runtimes.base import ProxyEndpoints, SandboxSpec
from polar_cli.rollout.runtimes.bwrap import BwrapRuntime, find_bwrap
from tests.support.prereq import missing

FAKE_SETPRIV = b'#!/bin/sh\necho "agent-setpriv uid=$(id -u) $(grep CapEff /proc/self/status)" >&2\nexit 0\n'
LIBRARY = (
    b"#include <stdio.h>\n#include <unistd.h>\n"
    b'__attribute__((constructor)) static void hello(void) { fprintf(stderr, "agent-library uid=%d\\n", getuid()); }\n'
)


def test_an_execs_path_and_loader_variables_never_reach_the_privileged_setup(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        missing("the privileged two-bwrap setup exists only when polar runs as root")
    if find_bwrap() is None or shutil.which("setpriv") is None:
        missing("bwrap and setpriv are not installed (make sandbox)")
    if shutil.which("gcc") is None:
        missing("gcc builds the agent's library")
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    (tmp_path / "lib.c").write_bytes(LIBRARY)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "lib.so"), str(tmp_path / "lib.c")], check=True)
    spec = SandboxSpec(
        name="privileged-env",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        network="none",
        pids=None,
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
    )

    async def main() -> tuple:
        box = await BwrapRuntime(scratch_dir=tmp_path).start(spec)
        try:
            # The agent's turn: a `setpriv` and a library in its workspace.
            planted = await box.exec(
                "mkdir -p .venv/bin && cat > .venv/bin/setpriv && chmod +x .venv/bin/setpriv", stdin=FAKE_SETPRIV
            )
            await box.upload(tmp_path / "lib.so", "/workspace/.venv/lib/lib.so")
            # The verifier's turn, under a task's environment that names the workspace's venv.
            verified = await box.exec(
                'echo "ran uid=$(id -u) preload=$LD_PRELOAD"',
                env={"PATH": "/workspace/.venv/bin:/usr/bin:/bin", "LD_PRELOAD": "/workspace/.venv/lib/lib.so"},
            )
        finally:
            await box.stop()
        return planted, verified

    planted, verified = asyncio.run(main())
    assert planted.exit_code == 0, planted
    assert "agent-setpriv" not in verified.stderr, verified
    # The library is loaded inside only, by the sandbox's own uid: never by a process of host root.
    assert "agent-library uid=0" not in verified.stderr, verified
    assert "agent-library uid=1000" in verified.stderr, verified
    assert verified.stdout == "ran uid=1000 preload=/workspace/.venv/lib/lib.so\n", verified
    assert verified.exit_code == 0
