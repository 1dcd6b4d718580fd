"""The ``local`` runtime: each exec is a plain subprocess on this machine. NO ISOLATION.

The session gets its own HOME and its own copy of the workspace (the runner's per-session directories), a clean
environment (the host's PATH and locale, nothing else of the caller's environment: no tokens or keys leak in),
resource limits by ``prlimit`` (util-linux) where the spec gives them, a disk bound on its workspace, HOME and
TMPDIR (:mod:`disk`: ``RLIMIT_FSIZE`` and a watchdog), and its own pid namespace (``unshare
--pid --kill-child``): when the command ends, is killed, or polar dies, the kernel kills every process it started,
``setsid`` and double-forked daemons included, so nothing of a session outlives its exec (as in ``bwrap``). Where no
pid namespace can be made the runtime refuses to start rather than run untracked processes. It can read and write
whatever the host user can, and reach any address (the store, the proxy's control token): use it for trusted agents
and quick local runs (``polar rollout`` asks for ``--trust-agent``), and ``bwrap`` or ``oci`` for anything else. It
cannot place a directory at an absolute path (Harbor's ``/tests``, ``/logs``), nor restrict the network: such specs
are refused with :class:`RuntimeUnavailable` naming the runtimes that can.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar_cli import lifeline
from polar_cli.rollout.runtimes import disk
from polar_cli.rollout.runtimes.base import ExecResult, Runtime, RuntimeUnavailable, Sandbox, SandboxSpec
from polar_cli.rollout.runtimes.output import BoundedOutput, communicate

# What of the caller's environment a session keeps: enough to find programs and print text.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL")
KILL_GRACE_S = 5.0
# pid 1 of the session's pid namespace: runs the command as its child (a process cannot SIGKILL its namespace's init,
# so a command that is pid 1 would survive its own `kill -9 $$`) and exits with its status, 128 + N when signal N
# killed it, as bwrap reports it; its exit kills everything else in the namespace. Background jobs of a
# non-interactive shell get /dev/null as stdin: fd 3 hands the real one on.
INIT = 'exec 3<&0; "$@" <&3 3<&- & wait $!'


class LocalSandbox(Sandbox):
    def __init__(
        self,
        spec: SandboxSpec,
        scratch: Path,
        prlimit: str | None,
        unshare: Sequence[str],
        disk_mb: int = disk.DEFAULT_DISK_MB,
        disk_files: int = disk.DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.spec = spec
        self.workspace = str(spec.workspace)
        self.home = str(spec.home)
        self.host_workspace = spec.workspace
        self.proxy_url = f"http://127.0.0.1:{spec.proxy.forward_port}"
        self.reverse_url = f"http://127.0.0.1:{spec.proxy.reverse_port}"
        self.ca_path = str(spec.proxy.ca)
        self._scratch = scratch
        self._prlimit = prlimit
        self._unshare = list(unshare)
        self._procs: set[asyncio.subprocess.Process] = set()
        self._cancelled: set[asyncio.subprocess.Process] = set()
        self._stopped = False
        self.disk_mb = disk_mb
        self.disk_files = disk_files

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        base = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        base.update(HOME=self.home, TMPDIR=str(self._scratch), PWD=self.workspace)
        base.update(self.spec.env)
        base.update(env or {})
        return base

    def _limits(self) -> list[str]:
        flags = [f"--fsize={self.disk_mb * 2**20}"] if self._prlimit else []  # the disk bound's per-file part
        if self.spec.pids:
            flags.append(f"--nproc={self.spec.pids}")
        if self.spec.memory_mb:
            flags.append(f"--as={self.spec.memory_mb * 1024 * 1024}")
        if not flags:
            return []
        if self._prlimit is None and (self.spec.pids or self.spec.memory_mb):
            raise RuntimeUnavailable("prlimit (util-linux) not found: cannot apply the resource limits")
        return [self._prlimit, *flags, "--"]

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        if self._stopped:
            raise RuntimeUnavailable("the sandbox is stopped")
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        workdir = self._inside(cwd) if cwd else self.spec.workspace
        proc = await asyncio.create_subprocess_exec(
            *self._limits(), *self._unshare, "sh", "-c", INIT, "polar-init", *argv, cwd=workdir, env=self._env(env),
            start_new_session=True, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        lifeline.tie(proc.pid)  # its own session: a SIGKILLed polar must not leave the harness running
        self._procs.add(proc)
        out, err = BoundedOutput(), BoundedOutput()
        timed_out = False
        watching = asyncio.ensure_future(
            disk.watch(
                lambda: [self.spec.workspace, Path(self.home), self._scratch],
                self.disk_mb,
                lambda: _kill_group(proc),
                self.disk_files,
            )
        )
        try:
            reading = asyncio.ensure_future(communicate(proc, stdin, out, err))
            try:
                await asyncio.wait_for(asyncio.shield(reading), timeout_s)
            except TimeoutError:
                timed_out = True
                _kill_group(proc)
                await _drain(reading)
            except asyncio.CancelledError:
                _kill_group(proc)
                await _drain(reading)
                raise
        finally:
            self._procs.discard(proc)
            lifeline.untie(proc.pid)
            watching.cancel()
        over = watching.result() if watching.done() and not watching.cancelled() else None
        cancelled = proc in self._cancelled
        self._cancelled.discard(proc)
        code = -1 if (timed_out or cancelled) else proc.returncode
        return ExecResult(
            exit_code=code if code is not None else -1,
            stdout=out.text(),
            stderr=err.text() + (over or ""),
            timed_out=timed_out,
            cancelled=cancelled,
            limit="disk" if over else None,
        )

    def _inside(self, path: str) -> Path:
        """A path inside is a host path here: absolute as given, relative to the workspace otherwise."""
        p = Path(path)
        return p if p.is_absolute() else self.spec.workspace / p

    async def upload(self, local: Path, remote: str) -> None:
        await asyncio.to_thread(_copy, Path(local), self._inside(remote))

    async def download(self, remote: str, local: Path) -> None:
        source = self._inside(remote)
        if not source.exists():
            raise FileNotFoundError(f"{remote}: not in the sandbox")
        await asyncio.to_thread(_copy, source, Path(local))

    async def cancel(self) -> None:
        for proc in list(self._procs):
            self._cancelled.add(proc)
            _kill_group(proc)

    async def stop(self) -> None:
        if self._stopped:
            return
        await self.cancel()
        self._stopped = True
        await asyncio.to_thread(shutil.rmtree, self._scratch, True)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _drain(reading: asyncio.Future) -> None:
    """The rest of what a killed process wrote, within a grace period (the namespace dies with its init, so its
    pipes close at once; the grace bounds a kernel that is slow to reap)."""
    try:
        await asyncio.wait_for(asyncio.shield(reading), KILL_GRACE_S)
    except TimeoutError:
        reading.cancel()


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


class LocalRuntime(Runtime):
    name = "local"
    default_network = "host"
    places_directories = False

    def __init__(self, disk_mb: int = disk.DEFAULT_DISK_MB, disk_files: int = disk.DEFAULT_MAX_ENTRIES) -> None:
        self._prlimit = shutil.which("prlimit")
        self.disk_mb = int(disk_mb)
        self.disk_files = int(disk_files)
        self._unshare: list[str] | None = None

    def _pid_namespace(self) -> list[str]:
        """Once per runtime: the ``unshare`` prefix that gives an exec its own pid namespace here (root needs none
        of a user namespace; another user maps itself in one), else RuntimeUnavailable with why."""
        if self._unshare is not None:
            return self._unshare
        unshare = shutil.which("unshare")
        if unshare is None:
            raise RuntimeUnavailable(
                "the local runtime needs unshare (util-linux) to track a session's processes "
                "in a pid namespace; none found: use --runtime bwrap or oci"
            )
        base = [unshare, "--pid", "--kill-child"]
        tried = []
        for prefix in [base] if os.geteuid() == 0 else [[*base, "--map-current-user"], [*base, "--map-root-user"]]:
            probe = subprocess.run([*prefix, "--", "true"], capture_output=True, text=True)
            if probe.returncode == 0:
                self._unshare = [*prefix, "--"]
                return self._unshare
            tried.append(probe.stderr.strip())
        raise RuntimeUnavailable(
            "the local runtime cannot create a pid namespace here, so it could not kill what a "
            f"session leaves running ({'; '.join(tried)}): use --runtime bwrap or oci"
        )

    async def start(self, spec: SandboxSpec) -> Sandbox:
        if spec.binds or spec.read_only_binds:
            raise RuntimeUnavailable(
                f"the local runtime cannot place directories at "
                f"{sorted({**spec.binds, **spec.read_only_binds})} (a Harbor "
                "task's /tests and /logs): use --runtime bwrap or --runtime oci"
            )
        if spec.network != "host":
            raise RuntimeUnavailable(
                f"the local runtime cannot restrict the network (asked: {spec.network}): "
                "use --runtime bwrap (proxy-only) or --network host"
            )
        for directory in (spec.workspace, spec.home):
            if not Path(directory).is_dir():
                raise RuntimeUnavailable(f"{directory}: not a directory")
        unshare = self._pid_namespace()
        scratch = Path(tempfile.mkdtemp(prefix=f"polar-{spec.name[:40]}-"))
        return LocalSandbox(spec, scratch, self._prlimit, unshare, self.disk_mb, self.disk_files)


def make(**options: object) -> Runtime:
    """``--runtime local``; options: ``disk_mb`` (default 4096) and ``disk_files`` (default 200000), the disk bound
    of the session's workspace, HOME and TMPDIR (:mod:`disk`)."""
    unknown = sorted(set(options) - {"disk_mb", "disk_files"})
    if unknown:
        raise ValueError(f"the local runtime takes only disk_mb and disk_files, got {unknown}")
    return LocalRuntime(**options)  # type: ignore[arg-type]
