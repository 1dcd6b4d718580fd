"""Run a real ``mitmdump`` with the polar addon as a subprocess (rollouts, the demo, tests, benches)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import polar_addon

REPO = Path(__file__).resolve().parents[1]
MITMDUMP = Path(sys.executable).parent / "mitmdump"
ADDON = Path(polar_addon.__file__).resolve().parent / "addon.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proxy:
    port: int
    confdir: Path
    out: Path
    log: Path
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def proxy_url(self, session: str | None = None) -> str:
        return f"http://{session}@127.0.0.1:{self.port}" if session else self.url

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def control_token(self) -> str:
        """The token the addon generated for reward/status posts (``polar_addon.control``)."""
        from polar_addon.control import token_file

        return token_file(str(self.out), str(self.confdir)).read_text().strip()

    def control_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.control_token}"}


def wait_for_port(port: int, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}:\n{log.read_text() if log else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def mitmdump_command(
    engine: str,
    out: Path | str,
    *,
    port: int | None,
    listen_host: str = "127.0.0.1",
    modes: Sequence[str] = (),
    confdir: Path | str | None = None,
    options: dict[str, str] | None = None,
    addon: bool = True,
    quiet: bool = True,
) -> list[str]:
    """The mitmdump command line for polar: bound to ``listen_host`` (loopback unless told otherwise),
    one ``--mode`` per entry of ``modes`` (none: a regular forward proxy). Which TLS is intercepted
    (only model hosts, ``allow_hosts``) the addon sets itself from ``polar_hosts`` and the modes.
    ``port=None``: every mode names its own port (``regular@8080``, ``reverse:https://api.openai.com@8081``),
    and mitmproxy runs them side by side. ``quiet=False`` keeps mitmdump's own log (``polar proxy``)."""
    cmd = [str(MITMDUMP), "--listen-host", listen_host]
    if port is not None:
        cmd += ["--listen-port", str(port)]
    if quiet:
        cmd += ["--set", "termlog_verbosity=warn", "--set", "flow_detail=0"]
    if confdir is not None:
        cmd += ["--set", f"confdir={confdir}"]
    for mode in modes:
        cmd += ["--mode", mode]
    if addon:
        cmd += ["-s", str(ADDON), "--set", f"polar_engine={engine}", "--set", f"polar_out={out}"]
        for key, value in (options or {}).items():
            cmd += ["--set", f"{key}={value}"]
    return cmd


def stop_mitmdump(process: subprocess.Popen, grace_s: float = 60.0) -> int:
    """SIGINT to mitmdump's process group (its own session): on a graceful stop it seals the open shard. SIGKILL
    after ``grace_s``. Returns its exit status."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


@contextmanager
def run_mitmdump(
    engine: str,
    out: Path,
    *,
    mode: str | None = None,
    confdir: Path | None = None,
    options: dict[str, str] | None = None,
    addon: bool = True,
    timeout: float = 120.0,
) -> Iterator[Proxy]:
    """Start mitmdump (with the polar addon unless ``addon=False``) and stop it gracefully afterwards."""
    port = free_port()
    confdir = confdir or out.parent / "mitmproxy-conf"
    confdir.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"mitmdump-{port}.log"
    cmd = mitmdump_command(
        engine, out, port=port, modes=[mode] if mode else [], confdir=confdir, options=options, addon=addon
    )
    with open(log, "wb") as fh:
        process = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    from polar_cli import lifeline

    lifeline.tie(process.pid)  # own session for Ctrl-C; a SIGKILLed caller must still take it down
    proxy = Proxy(port, confdir, out, log, process)
    try:
        wait_for_port(port, timeout, process, log)
        yield proxy
    finally:
        stop_mitmdump(process, grace_s=30)
        lifeline.untie(process.pid)
