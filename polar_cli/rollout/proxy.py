"""The rollout's proxy: its own mitmdump + polar addon (forward and reverse listeners on 127.0.0.1, the same
command line as ``polar proxy``), or a running one; and the control client that registers sessions and posts verifier
rewards and session statuses with the control token. The token stays in this process: no sandbox gets it.

Sessions are registered, not claimed: the proxy the runner starts runs ``polar_sessions=registered``, and the runner
registers each session (task, group, sample) before its harness is configured; the proxy answers with the session's
secret, the only credential the harness gets. A running proxy (``--proxy``) in ``claimed`` mode would let the agent
write into another session or relabel its own: :func:`check_sessions_mode` refuses it unless the user trusts the
agent (``ExternalProxy.trust_claimed``, ``polar rollout --trust-claimed-sessions``)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from polar_cli import lifeline
from polar_cli.mitm import REPO, free_port, mitmdump_command, stop_mitmdump, wait_for_port
from polar_cli.rollout.proxy_check import ProxyNotABoundary, check_sampling_mode
from polar_cli.rollout.runtimes.base import ProxyEndpoints

DEFAULT_REVERSE_TARGET = "https://api.openai.com"
CONTROL_BASE = "http://polar.local/sessions"


@dataclass(frozen=True)
class ExternalProxy:
    """A ``polar proxy`` already running on this host: its forward URL, reverse URL (default: forward port + 1),
    mitmproxy's CA file, and the control token (``--control-token`` / ``POLAR_CONTROL_TOKEN``)."""

    forward_url: str
    control_token: str
    reverse_url: str | None = None
    ca: Path = Path("~/.mitmproxy/mitmproxy-ca-cert.pem")
    trust_claimed: bool = False  # use it even in claimed mode (the agent can then forge any session's identity)

    def endpoints(self) -> ProxyEndpoints:
        forward = _loopback_port(self.forward_url, "--proxy")
        reverse = _loopback_port(self.reverse_url, "--reverse-url") if self.reverse_url else forward + 1
        ca = self.ca.expanduser()
        if not ca.is_file():
            raise ValueError(f"{ca}: no mitmproxy CA certificate there (give the proxy's confdir)")
        return ProxyEndpoints(forward_port=forward, reverse_port=reverse, ca=ca)


def _loopback_port(url: str, what: str) -> int:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise ValueError(
            f"{what} {url!r}: give http://127.0.0.1:PORT (sandboxes reach the proxy on this host's loopback)"
        )
    return parts.port


@dataclass
class StartedProxy:
    endpoints: ProxyEndpoints
    control_token: str
    log: Path
    process: subprocess.Popen

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def start_proxy(
    engine: str,
    out: str,
    *,
    confdir: Path,
    log_dir: Path,
    options: dict[str, str] | None = None,
    reverse_target: str = DEFAULT_REVERSE_TARGET,
    timeout_s: float = 600.0,
) -> Iterator[StartedProxy]:
    """mitmdump + the addon with a forward and a reverse listener on free loopback ports; stopped gracefully (the open
    shard sealed) on exit. The control token is the addon's own (generated 0600 next to a local store, or in the
    confdir for a remote one)."""
    from polar_addon.control import token_file

    if "://" not in out:
        out = str(Path(out).resolve())  # mitmdump runs from the repository: a relative store would land there
    forward, reverse = free_port(), free_port()
    while reverse == forward:
        reverse = free_port()
    confdir = confdir.expanduser()
    confdir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"mitmdump-{forward}.log"
    # The sandboxes' only way out is this proxy: anything but a model call or the control paths is refused (a
    # proxy-only agent could otherwise reach any host through the forward listener's pass-through).
    # Fixed sampling: the agent under training does not choose its temperature, truncation or seed (one greedy call
    # would make `polar train` refuse the batch); `--set polar_sampling=client` gives the choice back.
    # Registered sessions: labels from the runner's registrations alone, whatever the agent's calls claim (last: no
    # --set turns it off).
    options = {
        "polar_block_other": "true",
        "polar_sampling": "fixed",
        **(options or {}),
        "polar_sessions": "registered",
    }
    cmd = mitmdump_command(
        engine,
        out,
        port=None,
        modes=[f"regular@{forward}", f"reverse:{reverse_target}@{reverse}"],
        confdir=confdir,
        options=options,
    )
    fence, fence_path = claim_writer(log_dir)
    try:
        with open(log, "wb") as fh:
            # Holds the fence's lock (an inherited descriptor) for as long as it lives.
            process = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
                pass_fds=(fence,),
                preexec_fn=_deliverable_stop_signals,
            )
        lifeline.tie(process.pid)  # its own session (Ctrl-C handling): a SIGKILLed polar must still take it down
        os.pwrite(fence, f"{process.pid}\n".encode(), 0)
    except BaseException:
        fence_path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fence)
    try:
        for port in (forward, reverse):
            # A local engine loads its model before mitmdump listens.
            wait_for_port(port, timeout_s, process, log)
        token = options.get("polar_control_token") or token_file(out, str(confdir)).read_text().strip()
        yield StartedProxy(ProxyEndpoints(forward, reverse, confdir / "mitmproxy-ca-cert.pem"), token, log, process)
    finally:
        _stop(process)
        fence_path.unlink(missing_ok=True)  # stopped: nothing holds it any more


def _deliverable_stop_signals() -> None:
    """In the child before exec: unblock SIGINT and SIGTERM. A blocked mask is inherited through exec, and Ray blocks
    SIGINT in the processes it starts (its workers, so our ``--ray`` node actors): a proxy started there would never
    see the SIGINT that stops it gracefully, and be SIGKILLed a minute later with its open shard unsealed."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _stop(process: subprocess.Popen) -> None:
    stop_mitmdump(process)
    lifeline.untie(process.pid)


WRITER_GONE_S = 15.0  # a killed run's proxy is SIGKILLed by its lifeline at once; this only covers the scheduling


class WriterAlive(RuntimeError):
    pass


def claim_writer(log_dir: Path) -> tuple[int, Path]:
    """A rollout directory's fence: a fresh ``log_dir/proxy-*.lock``, locked exclusively, whose descriptor the
    proxy inherits, so it stays locked while the proxy writing that directory lives, also a proxy of a run that was
    SIGKILLed (several proxies, one per Ray node, each hold their own). Returns the descriptor and the file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="proxy-", suffix=".lock", dir=log_dir)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd, Path(name)


def wait_writer_gone(log_dir: Path, timeout_s: float = WRITER_GONE_S) -> None:
    """Before a rollout directory is deleted and reused: wait up to ``timeout_s`` for every proxy that wrote it to be
    gone, then WriterAlive (it would write into the directory's next use)."""
    deadline = time.monotonic() + timeout_s
    for path in sorted(log_dir.glob("proxy-*.lock")) if log_dir.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                        raise WriterAlive(
                            f"a proxy of an earlier run (pid {holder}) still writes into "
                            f"{log_dir.parent}: stop it, or use another directory"
                        ) from None
                    time.sleep(0.05)  # a lock another process holds: no event to wait on, so poll to the deadline
        finally:
            os.close(fd)


class ControlError(RuntimeError):
    pass


CLAIMED_REFUSAL = (
    "the proxy runs polar_sessions=claimed: an agent in one session could write calls into another "
    "and relabel task, group and sample (trust on claim). Restart it with --set "
    "polar_sessions=registered, or pass --trust-claimed-sessions if every agent is trusted"
)


def check_sessions_mode(mode: str, trust_claimed: bool) -> str | None:
    """None for a registered-mode proxy; the warning to print for a claimed one the user trusts; else ControlError."""
    if mode == "registered":
        return None
    if mode == "claimed" and trust_claimed:
        return "WARNING: " + CLAIMED_REFUSAL.split(" Restart", 1)[0] + ": used anyway (--trust-claimed-sessions)"
    if mode == "claimed":
        raise ControlError(CLAIMED_REFUSAL)
    raise ControlError(f"the proxy's session mode is {mode!r}, not registered")


class ControlClient:
    """Posts rewards and statuses to the proxy's control paths (``polar_addon.control``) through its forward
    listener, with the control token; retries while the store says it cannot persist (503)."""

    def __init__(self, forward_port: int, token: str, attempts: int = 5) -> None:
        self._client = httpx.AsyncClient(
            proxy=f"http://127.0.0.1:{forward_port}", timeout=60, headers={"authorization": f"Bearer {token}"}
        )
        self._attempts = attempts

    async def _post(self, session_id: str, what: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", f"{CONTROL_BASE}/{session_id}/{what}", f"{what} of {session_id}", body)

    async def _request(self, method: str, url: str, what: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        for attempt in range(self._attempts):
            try:
                response = await self._client.request(method, url, json=body)
            except httpx.TransportError as exc:
                if attempt + 1 == self._attempts:
                    raise ControlError(f"{what}: {exc}") from exc
            else:
                if response.status_code == 200:
                    try:
                        answer = response.json()
                    except ValueError:
                        answer = None
                    return answer if isinstance(answer, dict) else {}
                if response.status_code != 503 or attempt + 1 == self._attempts:
                    raise ControlError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
            await asyncio.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def sessions_mode(self) -> str:
        """The proxy's ``polar_sessions`` (a proxy that predates registration answers 404: ControlError)."""
        return (await self.modes())[0]

    async def modes(self) -> tuple[str, str | None]:
        """The proxy's ``polar_sessions`` and ``polar_sampling`` (None from a proxy that does not say it)."""
        answer = await self._request("GET", CONTROL_BASE, "the session mode")
        sampling = answer.get("sampling")
        return str(answer.get("sessions")), sampling if isinstance(sampling, str) else None

    async def register(self, session_id: str, task: str, group: str, sample: int) -> tuple[str, str]:
        """Register a session before its harness is configured: (its secret, the proxy's session mode)."""
        answer = await self._post(session_id, "register", {"task": task, "group": group, "sample": sample})
        secret = answer.get("secret")
        if not isinstance(secret, str) or not secret:
            raise ControlError(f"register of {session_id}: the proxy returned no secret")
        return secret, str(answer.get("sessions"))

    async def reward(self, session_id: str, value: float, name: str = "reward") -> None:
        await self._post(session_id, "reward", {"value": value, "name": name})

    async def status(
        self, session_id: str, status: str, metadata: dict[str, Any] | None = None
    ) -> tuple[str, str | None]:
        """Post ``status``; what the store now says of the session (``error`` is final: a proxy that ended the
        session as error answers error) and why, when that is not ``status``."""
        answer = await self._post(
            session_id, "status", {"status": status, **({"metadata": metadata} if metadata else {})}
        )
        final = answer.get("status")
        if not isinstance(final, str) or final == status:
            return status, None  # an older proxy does not say
        return final, str(answer.get("final_because") or "")

    async def aclose(self) -> None:
        await self._client.aclose()


def proxy_sessions_mode(proxy: ExternalProxy) -> str:
    """The running proxy's session mode, asked once before a rollout starts on it; its sampling mode is checked
    with it (proxy_check.check_sampling_mode: ControlError unless ``fixed`` or trusted, the warning printed) once
    the session mode would be accepted, so that a claimed-mode proxy is refused for that first."""

    async def ask() -> tuple[str, str | None]:
        client = ControlClient(proxy.endpoints().forward_port, proxy.control_token, attempts=1)
        try:
            return await client.modes()
        finally:
            await client.aclose()

    sessions, sampling = asyncio.run(ask())
    if sessions == "registered" or proxy.trust_claimed:
        try:
            warning = check_sampling_mode(proxy.forward_url, sampling, proxy.trust_claimed)
        except ProxyNotABoundary as exc:
            raise ControlError(str(exc)) from None
        if warning:
            print(warning, file=sys.stderr)
    return sessions
