"""polar-untrusted, the sh wrapper in front of the Landlock shim (polar_untrusted.py), run for real.

Its python runs isolated: a PYTHONPATH the caller hands it (a task's verifier env often names the workspace, the
agent's) must not put the agent's modules into the shim, which runs as root, unconfined.

Where the sandbox has no python3 (so no Landlock): as root with setpriv it runs the code under test as uid 65534,
after checking that uid cannot write under any denied directory (``/logs`` always); otherwise it refuses (exit 126,
nothing run). Run in a mount namespace where the system's python3 is hidden; the agent's look-alikes of the shim's
tools come first on the caller's PATH and must never run (they would run as root, unconfined)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes.base import TOOLS_HOST

SHIM = TOOLS_HOST / "polar-untrusted"
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
PLANTED = ("python3", "setpriv", "id", "find", "grep", "mkdir", "chown", "mktemp")
# Every python3 of the shim's own PATH is covered by /dev/null (a shell's lookup skips what is not a regular file).
HIDE_PYTHON = (
    f"for d in {' '.join(SYSTEM_DIRS)}; do"
    ' [ -e "$d/python3" ] && mount --bind /dev/null "$(realpath "$d/python3")"; done; exec "$@"'
)


def _usable() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return False
    done = subprocess.run(["unshare", "-m", "sh", "-c", HIDE_PYTHON, "sh", "true"], capture_output=True, check=False)
    return done.returncode == 0


fallback = pytest.mark.skipif(not _usable(), reason="needs root, setpriv and mount namespaces (unshare -m)")


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory uid 65534 may traverse (pytest's tmp_path is 0700 root's): logs/verifier/reward.txt (root's, 0644),
    work/ (the working directory), bin/ (the agent's tools, first on the caller's PATH)."""
    homes = set(Path("/tmp").glob("polar-untrusted-home.*"))
    root = Path(tempfile.mkdtemp(prefix="polar-shim-fallback-", dir="/tmp"))
    root.chmod(0o755)
    (root / "logs" / "verifier").mkdir(parents=True)
    (root / "logs" / "verifier" / "reward.txt").write_text("0\n")
    (root / "work").mkdir()
    (root / "bin").mkdir()
    for name in PLANTED:
        tool = root / "bin" / name
        tool.write_text(f"#!/bin/sh\necho {name} >> {root}/planted-ran\nexit 0\n")
        tool.chmod(0o755)
    yield root
    shutil.rmtree(root)
    for home in set(Path("/tmp").glob("polar-untrusted-home.*")) - homes:  # the HOMEs the shim made (it exec'd)
        shutil.rmtree(home)


def _run(base: Path, *args: str, user: int | None = None, logs: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The shim without python3; ``logs``: a directory shown at /logs (the default denied one) in its namespace."""
    drop = (
        [str(shutil.which("setpriv")), f"--reuid={user}", f"--regid={user}", "--clear-groups"]
        if user is not None
        else []
    )
    env = {**os.environ, "PATH": f"{base / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            (f"/bin/mkdir -p /logs && /bin/mount --bind {shlex.quote(str(logs))} /logs && " if logs else "")
            + HIDE_PYTHON,
            "sh",
            *drop,
            "/bin/sh",
            str(SHIM),
            *args,
        ],
        cwd=base / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert not (base / "planted-ran").exists(), f"the shim ran the agent's {(base / 'planted-ran').read_text().split()}"
    return done


PROBE = (
    '/usr/bin/id -u; /usr/bin/id -g; echo "$HOME"; echo 1 > "$0/verifier/reward.txt" 2>/dev/null || echo denied;'
    " echo ok > out.txt; /usr/bin/id -G;"
    " /usr/bin/grep -E '^(CapInh|CapEff|CapBnd|NoNewPrivs):' /proc/self/status | /usr/bin/tr -s '\\t' ' '"
)


@fallback
def test_without_python_the_command_runs_as_nobody_who_cannot_write_the_reward(base: Path) -> None:
    done = _run(base, "--deny", str(base / "logs"), "sh", "-c", PROBE, str(base / "logs"))
    assert done.returncode == 0, done.stderr
    uid, gid, home, reward, groups, *status = done.stdout.splitlines()
    assert (uid, gid, groups, reward) == ("65534", "65534", "65534", "denied")  # root's groups cleared
    # No capability left to regain, and no setuid binary to regain one through.
    assert status == [
        "CapInh: 0000000000000000",
        "CapEff: 0000000000000000",
        "CapBnd: 0000000000000000",
        "NoNewPrivs: 1",
    ]
    assert (base / "logs" / "verifier" / "reward.txt").read_text() == "0\n"
    assert (base / "work" / "out.txt").read_text() == "ok\n"  # its working directory was handed to it
    assert (base / "work").stat().st_uid == 65534
    assert home.startswith("/tmp/polar-untrusted-home.") and Path(home).stat().st_uid == 65534


@fallback
def test_a_denied_directory_nobody_can_write_under_is_refused_and_nothing_runs(base: Path) -> None:
    (base / "logs" / "verifier").chmod(0o777)
    done = _run(base, "--deny", str(base / "logs"), "touch", "ran")
    assert done.returncode == 126 and not (base / "work" / "ran").exists()
    assert done.stderr == (
        f"polar-untrusted: refusing to run touch: uid 65534 can write under {base / 'logs'}: the reward would be "
        "forgeable (exit 126)\n"
    )


@fallback
def test_every_denied_directory_is_checked_and_a_missing_one_made(base: Path) -> None:
    (base / "open").mkdir(mode=0o777)
    (base / "open").chmod(0o777)
    done = _run(base, "--deny", str(base / "logs"), f"--deny={base / 'open'}", "--", "touch", "ran")
    assert done.returncode == 126 and "uid 65534 can write under " + str(base / "open") in done.stderr
    assert not (base / "work" / "ran").exists()
    done = _run(base, "--deny", str(base / "logs"), f"--deny={base / 'made' / 'here'}", "touch", "ran")
    assert done.returncode == 0, done.stderr
    assert (base / "made" / "here").is_dir() and (base / "work" / "ran").stat().st_uid == 65534


@fallback
def test_no_command_and_no_root_are_refused(base: Path) -> None:
    done = _run(base, "--deny", str(base / "logs"))
    assert done.returncode == 126
    assert done.stderr == "polar-untrusted: refusing to run nothing: no command given: the reward would be forgeable" \
        " (exit 126)\n"  # fmt: skip
    (base / "work").chmod(0o777)
    done = _run(base, "touch", "ran", user=65534)
    assert done.returncode == 126 and not (base / "work" / "ran").exists()
    assert done.stderr == (
        "polar-untrusted: refusing to run touch: no python3 for Landlock here, and not root with setpriv to drop to"
        " another uid: the reward would be forgeable (exit 126)\n"
    )


@fallback
def test_logs_is_denied_whatever_the_options_add(base: Path) -> None:
    shown = base / "shown-at-logs"
    (shown / "verifier").mkdir(parents=True)
    (shown / "verifier").chmod(0o777)  # the reward's directory left writable: the shim must notice
    for deny in (["--deny", str(base / "logs")], [f"--deny={base / 'logs'}"], []):
        done = _run(base, *deny, "touch", "ran", logs=shown)
        assert done.returncode == 126 and not (base / "work" / "ran").exists(), deny
        assert "uid 65534 can write under /logs:" in done.stderr


@fallback
def test_a_command_of_one_word_runs(base: Path) -> None:
    done = _run(base, "pwd")
    assert (done.returncode, done.stdout) == (0, f"{base / 'work'}\n"), done.stderr


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a system python3")
def test_the_shims_python_takes_nothing_from_the_callers_pythonpath(tmp_path: Path) -> None:
    """The agent's ``ctypes`` (the shim's first import that is not built in) and ``sitecustomize`` on PYTHONPATH
    would run as the verifier's user, before any confinement."""
    agent = tmp_path / "workspace"
    agent.mkdir()
    marker = tmp_path / "agent-code-ran"
    for module in ("ctypes", "sitecustomize", "stat", "errno"):
        (agent / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write({module!r} + '\\n')\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(agent), "PYTHONSAFEPATH": ""}
    done = subprocess.run(
        [str(SHIM), "--deny", str(tmp_path / "logs"), "sh", "-c", "echo ran > out.txt"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert not marker.exists(), f"the shim imported the agent's {marker.read_text().split()}"
    assert done.returncode == 0, done.stderr
    assert (work / "out.txt").read_text() == "ran\n"
