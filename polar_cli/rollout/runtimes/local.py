"""The ``local`` runtime: each exec is a plain subprocess on this machine. NO ISOLATION.

The session gets its own HOME and its own copy of the workspace (the runner's per-session directories), a clean
environment (the host's PATH and locale, nothing else of the caller's environment: no tokens or keys leak in),
resource limits by ``prlimit`` (util-linux) where the spec gives them, and its own process group, so a cancel, a
timeout or a stop kills every process it started. It can read and write whatever the host user can, and reach any
address: use it for trusted agents and quick local runs, and ``bwrap`` or ``oci`` for anything else. It cannot place a
directory at an absolute path (Harbor's ``/tests``, ``/logs``), nor restrict the network: such specs are refused
with :class:`RuntimeUnavailable` naming the runtimes that can.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from polar_cli import lifeline
from polar_cli.rollout.runtimes.base import ExecResult, Runtime, RuntimeUnavailable, Sandbox, SandboxSpec

# What of the caller's environment a session keeps: enough to find programs and print text.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL")
OUTPUT_LIMIT = 4 * 1024 * 1024  # bytes of stdout/stderr kept per exec (the tail)
KILL_GRACE_S = 5.0


class LocalSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec, scratch: Path, prlimit: str | None) -> None:
        self.spec = spec
        self.workspace = str(spec.workspace)
        self.home = str(spec.home)
        self.host_workspace = spec.workspace
        self.proxy_url = f"http://127.0.0.1:{spec.proxy.forward_port}"
        self.reverse_url = f"http://127.0.0.1:{spec.proxy.reverse_port}"
        self.ca_path = str(spec.proxy.ca)
        self._scratch = scratch
        self._prlimit = prlimit
        self._procs: set[asyncio.subprocess.Process] = set()
        self._cancelled: set[asyncio.subprocess.Process] = set()
        self._stopped = False

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        base = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        base.update(HOME=self.home, TMPDIR=str(self._scratch), PWD=self.workspace)
        base.update(self.spec.env)
        base.update(env or {})
        return base

    def _limits(self) -> list[str]:
        flags = []
        if self.spec.pids:
            flags.append(f"--nproc={self.spec.pids}")
        if self.spec.memory_mb:
            flags.append(f"--as={self.spec.memory_mb * 1024 * 1024}")
        if not flags:
            return []
        if self._prlimit is None:
            raise RuntimeUnavailable("prlimit (util-linux) not found: cannot apply the resource limits")
        return [self._prlimit, *flags, "--"]

    async def exec(self, command: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
                   cwd: str | None = None, timeout_s: float | None = None, stdin: bytes | None = None) -> ExecResult:
        if self._stopped:
            raise RuntimeUnavailable("the sandbox is stopped")
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        workdir = self._inside(cwd) if cwd else self.spec.workspace
        proc = await asyncio.create_subprocess_exec(
            *self._limits(), *argv, cwd=workdir, env=self._env(env), start_new_session=True,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        lifeline.tie(proc.pid)  # its own session: a SIGKILLed polar must not leave the harness running
        self._procs.add(proc)
        timed_out = False
        try:
            communicate = asyncio.ensure_future(proc.communicate(stdin))
            try:
                out, err = await asyncio.wait_for(asyncio.shield(communicate), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
                _kill_group(proc)
                out, err = await _drain(communicate)
            except asyncio.CancelledError:
                _kill_group(proc)
                await _drain(communicate)
                raise
        finally:
            self._procs.discard(proc)
            lifeline.untie(proc.pid)
        cancelled = proc in self._cancelled
        self._cancelled.discard(proc)
        code = -1 if (timed_out or cancelled) else proc.returncode
        return ExecResult(exit_code=code if code is not None else -1, stdout=_tail(out), stderr=_tail(err),
                          timed_out=timed_out, cancelled=cancelled)

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


async def _drain(communicate: asyncio.Future) -> tuple[bytes, bytes]:
    """What a killed process wrote; a descendant that left the group may hold the pipes open: stop waiting then."""
    try:
        return await asyncio.wait_for(asyncio.shield(communicate), KILL_GRACE_S)
    except asyncio.TimeoutError:
        communicate.cancel()
        return b"", b""


def _tail(data: bytes | None) -> str:
    data = data or b""
    return data[-OUTPUT_LIMIT:].decode("utf-8", "replace")


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


class LocalRuntime(Runtime):
    name = "local"
    default_network = "host"

    def __init__(self) -> None:
        self._prlimit = shutil.which("prlimit")

    async def start(self, spec: SandboxSpec) -> Sandbox:
        if spec.binds:
            raise RuntimeUnavailable(f"the local runtime cannot place directories at {sorted(spec.binds)} (a Harbor "
                                     "task's /tests and /logs): use --runtime bwrap or --runtime oci")
        if spec.network != "host":
            raise RuntimeUnavailable(f"the local runtime cannot restrict the network (asked: {spec.network}): "
                                     "use --runtime bwrap (proxy-only) or --network host")
        for directory in (spec.workspace, spec.home):
            if not Path(directory).is_dir():
                raise RuntimeUnavailable(f"{directory}: not a directory")
        scratch = Path(tempfile.mkdtemp(prefix=f"polar-{spec.name[:40]}-"))
        return LocalSandbox(spec, scratch, self._prlimit)


def make(**options: object) -> Runtime:
    if options:
        raise ValueError(f"the local runtime takes no options, got {sorted(options)}")
    return LocalRuntime()
