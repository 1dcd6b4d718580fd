"""Issue 23, "no host root in the sandbox", on the oci runtime (rootful podman, ``--runtime runc``): container root
is an unprivileged host uid range (``--uidmap``/``--gidmap``), not host root.

- A direct sandbox (the harness image, built from the host's binaries): inside, uid 0 whose ``/proc/self/uid_map``
  names the unprivileged range; a root-only 0600 host file mounted read-only is unreadable, a world-readable one
  readable; a setuid-root copy of sh made in the workspace and HOME is, on the host, neither root's nor setuid once
  the sandbox stops; an honest exec still writes its workspace and HOME, including files the runner (host root)
  wrote there between execs.
- The same attack as the agent of a real `polar rollout --runtime oci` (a ``cmd:sh attack.sh`` harness through a
  real mitmdump with the scripted engine, proxy-only), whose honest part is verified and rewarded.

Without root, podman maps the container to the invoking user already: these tests need root (and podman).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from polar_cli.rollout.proxy import StartedProxy
from polar_cli.rollout.runtimes import confine, oci
from polar_cli.rollout.runtimes.base import ProxyEndpoints, SandboxSpec
from tests.support.attacks import write_task
from tests.support.oci_image import build_harness_image
from tests.support.prereq import missing
from tests.support.proxy import REPO

pytestmark = pytest.mark.slow
HOST_UID = confine.DEFAULT_HOST_UID
UID_MAP = f"0 {HOST_UID} {oci.MAPPED_IDS}"
SETID = stat.S_ISUID | stat.S_ISGID

ATTACK = r"""
secret="$1"
public="$2"
echo "uid $(id -u)"
echo "uid_map $(cat /proc/self/uid_map | tr -s ' ' | sed 's/^ //')"
cat "$secret" 2>/dev/null && echo "read secret" || echo "no secret"
cat "$public" 2>/dev/null || echo "no public"
cp /bin/sh ./x && chmod 4755 ./x && echo "setuid workspace $(stat -c '%a %u' ./x)"
cp /bin/sh "$HOME/y" && chmod 6755 "$HOME/y" && echo "setuid home $(stat -c '%a %u' "$HOME/y")"
echo honest > result.txt
"""


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        missing("oci maps container uids to an unprivileged host range only when polar runs as root")
    if shutil.which("podman") is None:
        missing("podman is not installed (make sandbox)")
    return build_harness_image()


def _files_left(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def test_container_root_is_an_unprivileged_host_range(image: str, tmp_path: Path) -> None:
    secret, public = tmp_path / "secret", tmp_path / "public"
    secret.write_text("root-only-secret\n")
    secret.chmod(0o600)
    public.write_text("world-readable\n")
    public.chmod(0o644)
    attack = tmp_path / "attack.sh"
    attack.write_text(ATTACK)
    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    (workspace / "README").write_text("the task\n")  # a bound workspace: the host directory is the sandbox's
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    spec = SandboxSpec(
        name="noroot",
        workspace=workspace,
        home=home,
        network="none",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
        read_only=(secret, public, attack),
    )

    async def main():
        box = await oci.make(image=image).start(spec)
        try:
            attacked = await box.exec(["sh", str(attack), str(secret), str(public)], timeout_s=60)
            # What the runner does between execs, as host root: a harness config in HOME, a patched workspace file.
            (home / "config.json").write_text("{}\n")
            (workspace / "README").write_text("patched\n")
            honest = await box.exec(
                "echo mine >> $HOME/config.json && echo edited >> README && mkdir -p sub && "
                "echo new > sub/file && cat $HOME/config.json README sub/file",
                timeout_s=60,
            )
        finally:
            await box.stop()
        return attacked, honest

    attacked, honest = asyncio.run(main())
    out = attacked.stdout
    assert "uid 0\n" in out and f"uid_map {UID_MAP}\n" in out, attacked
    assert "no secret" in out and "root-only-secret" not in out, attacked
    assert "world-readable" in out, attacked
    assert "setuid workspace 4755 0" in out and "setuid home 6755 0" in out, attacked  # the attack did run
    assert honest.exit_code == 0 and honest.stdout == "{}\nmine\npatched\nedited\nnew\n", honest

    left = _files_left(workspace, home)
    assert {workspace / "x", home / "y", home / "config.json", workspace / "sub" / "file"} <= set(left)
    assert [p for p in left if p.stat().st_mode & SETID] == []
    assert {p.stat().st_uid for p in left} == {HOST_UID}, {p: p.stat().st_uid for p in left}
    assert stat.S_IMODE((workspace / "x").stat().st_mode) == 0o755


def test_an_oci_agent_is_no_host_root(proxy: StartedProxy, image: str, tmp_path: Path) -> None:
    """The attack as the agent of a real rollout: the root-only file it names (bound read-only, as every host path
    a ``cmd:`` harness names is) stays unreadable, its setuid copies of sh are left on the host as neither root's
    nor setuid (kept sessions), and its honest result is verified and rewarded."""
    secret, public = tmp_path / "secret", tmp_path / "public"
    secret.write_text("root-only-secret\n")
    secret.chmod(0o600)
    public.write_text("world-readable\n")
    attack = tmp_path / "attack.sh"
    attack.write_text(ATTACK)
    work = tmp_path / "work"
    tasks = write_task(tmp_path, image=image, verify="grep -qx honest result.txt")
    cmd = [
        sys.executable,
        "-m",
        "polar_cli.app",
        "rollout",
        str(tasks),
        "--harness",
        f"cmd:sh {attack} {secret} {public}",
        "--runtime",
        "oci",
        "--proxy",
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        "--reverse-url",
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
        "--confdir",
        str(Path(proxy.endpoints.ca).parent),
        "--report-dir",
        str(tmp_path / "report"),
        "--work-dir",
        str(work),
        "--keep-sessions",
        "--seed",
        "2395",
        "--no-progress",
    ]
    done = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "POLAR_CONTROL_TOKEN": proxy.control_token},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (session,) = json.loads((tmp_path / "report" / "rollout-summary.json").read_text())["session_results"]
    log = (tmp_path / "report" / "logs" / "sessions" / session["session_id"] / "harness.log").read_text()
    assert "uid 0\n" in log and f"uid_map {UID_MAP}\n" in log, log
    assert "no secret" in log and "root-only-secret" not in log and "world-readable" in log, log
    assert "setuid workspace 4755 0" in log and "setuid home 6755 0" in log, log
    assert (session["status"], session["reward"]) == ("completed", 1.0), session

    session_dir = work / "sessions" / session["session_id"]
    left = _files_left(session_dir / "home", session_dir / "workspace")
    assert (session_dir / "home" / "y") in left, left
    assert [p for p in left if p.stat().st_mode & SETID] == []
    assert [p for p in left if p.stat().st_uid == 0 and p.stat().st_mode & 0o111] == []


def test_an_oom_kill_by_the_containers_memory_limit_is_reported(image: str, tmp_path: Path) -> None:
    """--memory 64m: a 200 MB allocation is killed by the container's OOM killer and that exec says oom_killed; the
    next exec, which fits, does not."""
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    spec = SandboxSpec(
        name="oom",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        network="none",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
        memory_mb=64,
    )

    async def main():
        box = await oci.make(image=image).start(spec)
        try:
            code, out = await box.runtime._run(
                "inspect", "--format", "{{.HostConfig.Memory}} {{.HostConfig.MemorySwap}}", box.container
            )
            assert (code, out.split()) == (0, [str(64 * 2**20)] * 2)  # memory + swap bounded by the same 64 MiB
            return (
                await box.exec(["python3", "-c", "x = bytearray(200_000_000); print(len(x))"], timeout_s=60),
                await box.exec("true", timeout_s=60),
            )
        finally:
            await box.stop()

    killed, fine = asyncio.run(main())
    assert killed.exit_code == 137 and killed.oom_killed, killed
    assert fine.exit_code == 0 and not fine.oom_killed


FAKE_DOCKER = """#!/bin/sh
# `docker info --format '{{json .SecurityOptions}}'` as a daemon with these options answers it; nothing else works.
if [ "$1" = info ]; then echo '%s'; exit 0; fi
echo "fake docker: $*" >&2; exit 1
"""


@pytest.mark.parametrize(
    ("options", "safe"),
    [
        ('["name=seccomp,profile=builtin","name=cgroupns"]', False),  # rootful, no remap: container root is root
        ("null", False),
        ('["name=seccomp,profile=builtin","name=rootless","name=cgroupns"]', True),
        ('["name=apparmor","name=seccomp,profile=builtin","name=userns"]', True),
    ],
)
def test_docker_as_host_root_is_refused_unless_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: str, safe: bool
) -> None:
    """A docker whose daemon maps container root to host root is refused at the first start, before any container,
    unless the runtime option trust_root accepts it; rootless docker and userns-remap start as before."""
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(FAKE_DOCKER % options)
    fake.chmod(0o755)
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    spec = SandboxSpec(
        name="docker",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        network="host",
        image="busybox",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
    )

    def start(**options) -> str:
        async def main() -> str:
            try:
                await oci.make(engine="docker", **options).start(spec)
            except oci.RuntimeUnavailable as exc:
                return str(exc)
            raise AssertionError("the fake docker started a container")

        return asyncio.run(main())

    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")  # the real lookup (shutil.which) finds it
    refused = start()
    trusted = start(trust_root="true")
    if safe:
        assert "starting a container of busybox failed" in refused and "fake docker: run" in refused, refused
    else:
        assert "runs containers as host root" in refused and "trust_root=true" in refused, refused
    assert "starting a container of busybox failed" in trusted, trusted  # trusted: on to `docker run`


def test_filling_the_bound_workspace_is_stopped_at_the_disk_limit(image: str, tmp_path: Path) -> None:
    """disk_mb=16 on oci: one large file stops at 16 MiB (the container's RLIMIT_FSIZE: SIGXFSZ), and the stream of
    small files into the bound workspace is killed by the watchdog inside the container, not only the engine's
    client, with ``limit="disk"`` and the line saying so; the host directory stays bounded."""
    from tests.security.test_runtime import DISK_FILL

    (tmp_path / "ca.pem").write_text("not a real CA\n")
    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    home.mkdir()
    (workspace / "README").write_text("a task's files\n")  # an empty host workspace would keep the image's own
    spec = SandboxSpec(
        name="disk", workspace=workspace, home=home, network="none", proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem")
    )

    async def main():
        box = await oci.make(image=image, disk_mb=16).start(spec)
        try:
            before = await box.exec("head -c 8M /dev/zero > half && echo fine", timeout_s=60)
            filled = await box.exec(DISK_FILL, timeout_s=60)
            sizes = [_workspace_bytes(workspace)]
            await asyncio.sleep(2)  # a writer left running inside would grow the workspace meanwhile
            return before, filled, [*sizes, _workspace_bytes(workspace)]
        finally:
            await box.stop()

    before, filled, sizes = asyncio.run(main())
    assert before.stdout == "fine\n" and before.limit is None and before.exit_code == 0, before
    assert not filled.timed_out and not filled.cancelled and filled.exit_code not in (0, -1), filled
    assert filled.limit == "disk" and "polar: disk limit 16 MiB exceeded" in filled.stderr, filled
    # RLIMIT_FSIZE stops the one large file (SIGXFSZ) unless the watchdog kills the exec first (see test_runtime)
    assert "big=153" in filled.stdout or not filled.stdout, filled
    assert (workspace / "big").stat().st_size <= 16 * 2**20
    assert 16 * 2**20 < sizes[0] < 4 * 2**30, sizes  # sampled: see test_runtime's disk test
    assert sizes[0] == sizes[1], sizes  # the loop inside was killed with the engine's client: no write after


def _workspace_bytes(workspace: Path) -> int:
    return sum(p.stat().st_size for p in workspace.iterdir())


def test_an_execs_environment_is_not_on_the_hosts_process_list(image: str, tmp_path: Path) -> None:
    """The session's proxy credentials reach the exec's processes, but not the command line of the engine's client
    (`podman exec`), which every process on the host can list; a value with a line break still arrives whole."""
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    secret = "sess-3f1c:key-9b2e7d4a61c05f88"
    spec = SandboxSpec(
        name="envsecret",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        network="none",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
        env={"HTTPS_PROXY": f"http://{secret}@127.0.0.1:9"},
    )

    def host_cmdlines() -> list[str]:
        lines = []
        for proc in Path("/proc").iterdir():
            try:
                lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
        return lines

    async def main():
        box = await oci.make(image=image).start(spec)
        try:
            show = "import os; print(repr(os.environ['MULTI']), 'B' in os.environ)"
            script = f'echo "$HTTPS_PROXY"; python3 -c "{show}"; sleep 3'
            running = asyncio.ensure_future(box.exec(script, env={"MULTI": "a\nB=1"}, timeout_s=60))
            seen: list[str] = []
            while not running.done():
                seen += [line for line in host_cmdlines() if "exec" in line and "envsecret" in line]
                await asyncio.sleep(0.05)
            return await running, seen, sorted(box.scratch.glob("env-*"))
        finally:
            await box.stop()

    result, seen, left = asyncio.run(main())
    assert result.exit_code == 0, result
    assert result.stdout.splitlines()[0] == f"http://{secret}@127.0.0.1:9"
    assert result.stdout.splitlines()[1] == "'a\\nB=1' False"  # the line break kept, no variable B made
    assert seen, "the podman exec client was never seen on the host's process list"
    assert not [line for line in seen if secret in line], seen
    assert left == []  # each exec's env file is removed after it
