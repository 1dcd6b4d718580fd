"""Issue 29: the local runtime (no isolation, for trusted agents) still keeps what it promises: a clean environment
(no token of the caller's leaks in), its limits given to prlimit, every process of an exec in a pid namespace that
dies with it, its refusals (directories it cannot place, a network it cannot restrict), and its copies. Execs here
are plain subprocesses of a few milliseconds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes import local
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable, SandboxSpec
from polar_cli.rollout.runtimes.local import LocalRuntime, LocalSandbox

MIB = 2**20
UNSHARE = ["unshare", "--pid", "--kill-child", "--"] if os.geteuid() == 0 else []


def _spec(tmp_path: Path, **fields: object) -> SandboxSpec:
    base: dict = dict(
        name="sess-1",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        proxy=ProxyEndpoints(forward_port=8080, reverse_port=8081, ca=tmp_path / "ca.pem"),
        network="host",
        pids=None,
    )
    spec = SandboxSpec(**{**base, **fields})
    Path(spec.workspace).mkdir(exist_ok=True)
    Path(spec.home).mkdir(exist_ok=True)
    return spec


def _sandbox(tmp_path: Path, prlimit: str | None = None, **fields: object) -> LocalSandbox:
    (tmp_path / "scratch").mkdir(exist_ok=True)
    return LocalSandbox(_spec(tmp_path, **fields), tmp_path / "scratch", prlimit, UNSHARE, disk_mb=3, disk_files=50)


async def _until(ready: object, within_s: float = 5.0) -> None:
    """Wait for ``ready()`` (an exec that ended at once must fail the test, not hang it)."""
    deadline = time.monotonic() + within_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the exec never ran"
        await asyncio.sleep(0.01)


# --- what the agent starts with ---------------------------------------------------------------------------------


def test_the_environment_keeps_only_the_locale_and_path_of_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in local.PASSED_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    sandbox = _sandbox(tmp_path, env={"TZ": "Europe/Paris", "A": "spec", "B": "spec"})
    assert sandbox._env({"B": "exec"}) == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "TZ": "Europe/Paris",
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path / "scratch"),
        "PWD": str(tmp_path / "ws"),
        "A": "spec",
        "B": "exec",
    }
    assert sandbox._env(None)["B"] == "spec"


def test_a_new_sandbox_is_the_hosts_own_paths(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path)
    assert (sandbox.workspace, sandbox.home, sandbox.host_workspace) == (
        str(tmp_path / "ws"),
        str(tmp_path / "home"),
        tmp_path / "ws",
    )
    assert (sandbox.proxy_url, sandbox.reverse_url, sandbox.ca_path) == (
        "http://127.0.0.1:8080",
        "http://127.0.0.1:8081",
        str(tmp_path / "ca.pem"),
    )
    assert (sandbox.disk_mb, sandbox.disk_files) == (3, 50)
    default = LocalSandbox(_spec(tmp_path), tmp_path, None, [])
    assert (default.disk_mb, default.disk_files) == (4096, 200_000)


def test_the_limits_given_to_prlimit(tmp_path: Path) -> None:
    assert _sandbox(tmp_path, "/p", pids=10, memory_mb=2)._limits() == [
        "/p",
        f"--fsize={3 * MIB}",
        "--nproc=10",
        f"--as={2 * MIB}",
        "--",
    ]
    assert _sandbox(tmp_path, "/p")._limits() == ["/p", f"--fsize={3 * MIB}", "--"]
    # Without prlimit the disk bound keeps its watchdog; limits asked of it cannot be applied: refused.
    assert _sandbox(tmp_path, None)._limits() == []
    for fields in ({"pids": 10}, {"memory_mb": 2}):
        with pytest.raises(RuntimeUnavailable, match=r"^prlimit \(util-linux\) not found: cannot apply the resource"):
            _sandbox(tmp_path, None, **fields)._limits()


# --- exec: real subprocesses ------------------------------------------------------------------------------------


def test_exec_runs_in_the_workspace_with_the_clean_environment_and_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "secret")
    sandbox = _sandbox(tmp_path, env={"A": "spec", "B": "spec"})
    result = asyncio.run(
        sandbox.exec(
            'cat; echo "|$PWD|$HOME|$A|$B|${POLAR_CONTROL_TOKEN-unset}"; echo e >&2; exit 3',
            stdin=b"in",
            env={"B": "exec"},
        )
    )
    assert (result.exit_code, result.stdout, result.stderr) == (
        3,
        f"in|{tmp_path / 'ws'}|{tmp_path / 'home'}|spec|exec|unset\n",
        "e\n",
    )
    assert not (result.timed_out or result.cancelled or result.oom_killed) and result.limit is None
    (tmp_path / "ws" / "sub").mkdir()
    assert asyncio.run(sandbox.exec(["pwd"], cwd="sub")).stdout == f"{tmp_path / 'ws' / 'sub'}\n"
    assert asyncio.run(sandbox.exec(["pwd"], cwd=str(tmp_path))).stdout == f"{tmp_path}\n"
    # No stdin given: /dev/null, never the runner's own.
    assert asyncio.run(sandbox.exec("cat")).stdout == ""


def test_a_missing_program_is_named_by_the_sessions_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ties: list[str] = []
    monkeypatch.setattr(local.lifeline, "tie", lambda pid: ties.append(f"+{pid}"))
    monkeypatch.setattr(local.lifeline, "untie", lambda pid: ties.append(f"-{pid}"))
    spawned: list[int] = []
    real_exec = asyncio.create_subprocess_exec

    async def exec_(*argv: str, **kwargs: object) -> asyncio.subprocess.Process:
        proc = await real_exec(*argv, **kwargs)
        spawned.append(proc.pid)
        return proc

    monkeypatch.setattr(local.asyncio, "create_subprocess_exec", exec_)
    result = asyncio.run(_sandbox(tmp_path).exec(["no-such-program-polar"]))
    assert (result.exit_code, result.stderr) == (127, "polar-init: 1: no-such-program-polar: not found\n")
    # Tied to the lifeline while it runs (a SIGKILLed polar must not leave it running), untied after.
    assert ties == [f"+{spawned[0]}", f"-{spawned[0]}"]


def test_exec_is_limited_by_prlimit(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path, "/usr/bin/prlimit", pids=77, memory_mb=500)
    limits = asyncio.run(sandbox.exec(["cat", "/proc/self/limits"])).stdout
    soft = {line[:26].strip(): line[26:].split()[0] for line in limits.splitlines()[1:]}
    assert (soft["Max processes"], soft["Max file size"], soft["Max address space"]) == (
        "77",
        str(3 * MIB),
        str(500 * MIB),
    )


def test_a_timeout_kills_every_process_of_the_exec(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path)
    began = time.monotonic()
    result = asyncio.run(sandbox.exec("echo started; setsid sleep 30 & sleep 30", timeout_s=0.5))
    assert time.monotonic() - began < 5
    assert (result.exit_code, result.timed_out, result.cancelled, result.stdout) == (-1, True, False, "started\n")
    assert sandbox._procs == set()


def test_cancel_kills_a_running_exec_and_stop_refuses_more(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path)
    (tmp_path / "scratch" / "f").write_text("")

    async def scenario() -> tuple:
        running = asyncio.ensure_future(sandbox.exec("sleep 30"))
        await _until(lambda: sandbox._procs)
        await sandbox.cancel()
        result = await running
        later = await sandbox.exec("exit 4")
        await sandbox.stop()
        await sandbox.stop()
        return result, later

    began = time.monotonic()
    result, later = asyncio.run(scenario())
    assert time.monotonic() - began < 5
    assert (result.exit_code, result.cancelled, result.timed_out) == (-1, True, False)
    # The cancel was for that exec alone.
    assert (later.exit_code, later.cancelled) == (4, False)
    assert not (tmp_path / "scratch").exists()
    # A scratch already gone (a cleaned /tmp) is no error.
    again = _sandbox(tmp_path)
    (tmp_path / "scratch").rmdir()
    asyncio.run(again.stop())
    with pytest.raises(RuntimeUnavailable, match="^the sandbox is stopped$"):
        asyncio.run(sandbox.exec("true"))


def test_a_cancelled_caller_kills_its_exec(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path)
    marker = tmp_path / "ws" / "late"

    async def scenario() -> None:
        running = asyncio.ensure_future(sandbox.exec(f"sleep 0.5; touch {marker}"))
        await _until(lambda: sandbox._procs)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(scenario())
    time.sleep(0.8)
    assert not marker.exists() and sandbox._procs == set()


def test_the_disk_bound_kills_the_exec_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = _sandbox(tmp_path)
    asked: list = []

    async def watch(roots: object, limit_mb: int, kill: object, max_entries: int) -> str:
        asked.append((roots(), limit_mb, max_entries))  # type: ignore[operator]
        await asyncio.sleep(0.2)
        kill()  # type: ignore[operator]
        return "polar: disk limit 3 MiB exceeded"

    monkeypatch.setattr(local.disk, "watch", watch)
    result = asyncio.run(sandbox.exec("echo x; sleep 30", timeout_s=10))
    assert asked == [([tmp_path / "ws", tmp_path / "home", tmp_path / "scratch"], 3, 50)]
    assert (result.limit, result.stdout, result.timed_out) == ("disk", "x\n", False)
    assert result.stderr == "polar: disk limit 3 MiB exceeded"
    assert result.exit_code != 0


def test_drain_waits_its_grace_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "KILL_GRACE_S", 0.05)

    async def scenario() -> tuple[bool, bool]:
        never = asyncio.ensure_future(asyncio.sleep(30))
        await local._drain(never)
        await asyncio.sleep(0)
        done = asyncio.ensure_future(asyncio.sleep(0, "ok"))
        await local._drain(done)
        return never.cancelled(), done.result() == "ok"

    assert asyncio.run(scenario()) == (True, True)


def test_kill_group_ignores_a_group_already_gone() -> None:
    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec("true", start_new_session=True)
        await proc.wait()
        local._kill_group(proc)

    asyncio.run(scenario())


# --- upload / download: host copies, relative to the workspace --------------------------------------------------


def test_upload_and_download_copy_files_and_trees(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path)
    (tmp_path / "patch").write_text("diff")
    asyncio.run(sandbox.upload(tmp_path / "patch", "deep/er/p.diff"))
    asyncio.run(sandbox.upload(tmp_path / "patch", "deep/er/q.diff"))  # into a directory that exists now
    assert (tmp_path / "ws" / "deep" / "er" / "p.diff").read_text() == "diff"
    assert (tmp_path / "ws" / "deep" / "er" / "q.diff").read_text() == "diff"
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "f").write_text("f")
    (tree / "link").symlink_to("/etc/hostname")
    asyncio.run(sandbox.upload(tree, str(tmp_path / "ws" / "copy")))
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "g").write_text("g")
    asyncio.run(sandbox.upload(tmp_path / "more", "copy"))  # onto an existing tree
    assert (tmp_path / "ws" / "copy" / "g").read_text() == "g"
    assert (tmp_path / "ws" / "copy" / "a" / "f").read_text() == "f"
    # Links are copied as links, not as the files they point at.
    assert os.readlink(tmp_path / "ws" / "copy" / "link") == "/etc/hostname"
    asyncio.run(sandbox.download("copy", tmp_path / "out"))
    assert (tmp_path / "out" / "a" / "f").read_text() == "f"
    assert (tmp_path / "out" / "link").is_symlink()
    asyncio.run(sandbox.download("deep/er/p.diff", tmp_path / "new" / "er" / "p"))
    assert (tmp_path / "new" / "er" / "p").read_text() == "diff"
    with pytest.raises(FileNotFoundError, match="^nothing: not in the sandbox$"):
        asyncio.run(sandbox.download("nothing", tmp_path / "x"))


# --- the runtime ------------------------------------------------------------------------------------------------


def test_start_refuses_directories_it_cannot_place_and_a_network_it_cannot_restrict(tmp_path: Path) -> None:
    runtime = LocalRuntime()
    spec = _spec(tmp_path, binds={"/logs": tmp_path}, read_only_binds={"/tests": tmp_path})
    with pytest.raises(RuntimeUnavailable) as refused:
        asyncio.run(runtime.start(spec))
    assert str(refused.value) == (
        "the local runtime cannot place directories at ['/logs', '/tests'] (a Harbor task's /tests and /logs): "
        "use --runtime bwrap or --runtime oci"
    )
    with pytest.raises(RuntimeUnavailable, match=r"^the local runtime cannot place directories at \['/tests'\]"):
        asyncio.run(runtime.start(_spec(tmp_path, read_only_binds={"/tests": tmp_path})))
    for network in ("proxy-only", "none"):
        with pytest.raises(RuntimeUnavailable) as refused:
            asyncio.run(runtime.start(_spec(tmp_path, network=network)))
        assert str(refused.value) == (
            f"the local runtime cannot restrict the network (asked: {network}): "
            "use --runtime bwrap (proxy-only) or --network host"
        )
    (tmp_path / "file").write_text("")
    for field in ("workspace", "home"):
        spec = _spec(tmp_path)
        with pytest.raises(RuntimeUnavailable, match=f"^{tmp_path / 'file'}: not a directory$"):
            asyncio.run(runtime.start(SandboxSpec(**{**spec.__dict__, field: tmp_path / "file"})))


def test_start_gives_each_sandbox_its_own_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local.tempfile, "tempdir", str(tmp_path))
    runtime = local.make(disk_mb="9", disk_files=8)
    monkeypatch.setattr(runtime, "_pid_namespace", lambda: ["U", "--"])
    sandbox = asyncio.run(runtime.start(_spec(tmp_path, name="n" * 50)))
    assert isinstance(sandbox, LocalSandbox)
    assert sandbox._scratch.parent == tmp_path and sandbox._scratch.name.startswith("polar-" + "n" * 40 + "-")
    assert (sandbox._unshare, sandbox._prlimit, sandbox.disk_mb, sandbox.disk_files) == (
        ["U", "--"],
        runtime._prlimit,
        9,
        8,
    )
    assert runtime._prlimit == local.shutil.which("prlimit")
    assert (runtime.name, runtime.default_network, runtime.places_directories) == ("local", "host", False)
    default = local.make()
    assert (default.disk_mb, default.disk_files, default._unshare) == (4096, 200_000, None)
    with pytest.raises(ValueError, match=r"^the local runtime takes only disk_mb and disk_files, got \['a', 'z'\]$"):
        local.make(z=1, a=2, disk_mb=1)


class _Probe:
    def __init__(self, works: set[str]) -> None:
        self.works = works
        self.tried: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert kwargs == {"capture_output": True, "text": True}
        self.tried.append(argv)
        ok = argv[-3] in self.works
        return subprocess.CompletedProcess(argv, 0 if ok else 1, "", "" if ok else f" no {argv[-3]} \n")


def test_the_pid_namespace_prefix_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local.shutil, "which", lambda name: f"/bin/{name}")
    monkeypatch.setattr(local.os, "geteuid", lambda: 1000)
    probe = _Probe({"--map-root-user"})
    monkeypatch.setattr(local.subprocess, "run", probe)
    runtime = LocalRuntime()
    prefix = ["/bin/unshare", "--pid", "--kill-child", "--map-root-user", "--"]
    assert runtime._pid_namespace() == prefix
    assert probe.tried == [
        ["/bin/unshare", "--pid", "--kill-child", "--map-current-user", "--", "true"],
        [*prefix, "true"],
    ]
    assert runtime._pid_namespace() == prefix and len(probe.tried) == 2
    # Root needs no user namespace.
    monkeypatch.setattr(local.os, "geteuid", lambda: 0)
    probe = _Probe({"--kill-child"})
    monkeypatch.setattr(local.subprocess, "run", probe)
    assert LocalRuntime()._pid_namespace() == ["/bin/unshare", "--pid", "--kill-child", "--"]
    assert probe.tried == [["/bin/unshare", "--pid", "--kill-child", "--", "true"]]


def test_without_a_pid_namespace_the_runtime_refuses_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local.shutil, "which", lambda name: f"/bin/{name}")
    monkeypatch.setattr(local.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(local.subprocess, "run", _Probe(set()))
    with pytest.raises(RuntimeUnavailable) as refused:
        LocalRuntime()._pid_namespace()
    assert str(refused.value) == (
        "the local runtime cannot create a pid namespace here, so it could not kill what a session leaves running "
        "(no --map-current-user; no --map-root-user): use --runtime bwrap or oci"
    )
    monkeypatch.setattr(local.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeUnavailable) as refused:
        LocalRuntime()._pid_namespace()
    assert str(refused.value) == (
        "the local runtime needs unshare (util-linux) to track a session's processes in a pid namespace; "
        "none found: use --runtime bwrap or oci"
    )
