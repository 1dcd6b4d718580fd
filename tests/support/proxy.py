"""Tests start mitmdump the way users' rollouts do; a third-party echo server for pass-through checks."""

import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from polar_cli.mitm import REPO, Proxy, free_port, mitmdump_command, run_mitmdump, stop_mitmdump, wait_for_port

__all__ = [
    "REPO",
    "Proxy",
    "SharedProxy",
    "echo_server",
    "free_port",
    "register_session",
    "run_mitmdump",
    "shared_proxy",
    "wait_for_port",
]


@dataclass
class SharedProxy:
    forward: int
    reverse: int
    ca: Path
    out: Path
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def control_token(self) -> str:
        from polar_addon.control import token_file

        return token_file(str(self.out), str(self.ca.parent)).read_text().strip()

    def register(self, session: str, task: str = "t", group: str = "g", sample: int = 0) -> str:
        return register_session(self.forward, self.control_token, session, task, group, sample)


def register_session(
    forward_port: int, token: str, session: str, task: str = "t", group: str = "g", sample: int = 0
) -> str:
    """Register ``session`` on a proxy's control plane, as `polar rollout` does; returns its secret."""
    import httpx

    reply = httpx.post(
        f"http://polar.local/sessions/{session}/register",
        proxy=f"http://127.0.0.1:{forward_port}",
        json={"task": task, "group": group, "sample": sample},
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    reply.raise_for_status()
    return reply.json()["secret"]


@contextmanager
def shared_proxy(
    script: Path, out: Path, options: dict[str, str] | None = None, quiet: bool = True
) -> Iterator[SharedProxy]:
    """One mitmdump for several harnesses on the scripted engine ``script``: a forward listener (Codex's WebSocket)
    and a reverse one (base-URL harnesses); its CA and log sit beside ``out``. ``quiet=False`` leaves mitmdump's
    own log settings to ``options`` (e.g. ``flow_detail=1``: every flow it sees in the log)."""
    forward, reverse = free_port(), free_port()
    confdir, log = out.parent / f"conf-{out.name}", out.parent / f"mitmdump-{out.name}.log"
    confdir.mkdir(parents=True, exist_ok=True)
    cmd = mitmdump_command(
        f"scripted:{script}",
        out,
        port=None,
        confdir=confdir,
        modes=[f"regular@{forward}", f"reverse:https://api.openai.com@{reverse}"],
        options={"polar_shard_seconds": "0.5", **(options or {})},
        quiet=quiet,
    )
    with open(log, "wb") as fh:
        # A wide "terminal": with flow_detail=1 mitmdump cuts each logged URL to the terminal's width.
        env = {**os.environ, "COLUMNS": "4000"}
        process = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True, env=env)
    try:
        for port in (forward, reverse):
            wait_for_port(port, 120, process, log)
        yield SharedProxy(forward, reverse, confdir / "mitmproxy-ca-cert.pem", out, log)
    finally:
        stop_mitmdump(process, grace_s=30)


class _Echo(BaseHTTPRequestHandler):
    """A third-party server: answers a POST with ``echo:`` + its body, so pass-through is visible byte for byte."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.end_headers()
        self.wfile.write(b"echo:" + body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def echo_server() -> Iterator[int]:
    """Runs an echo server on 127.0.0.1 and yields its port."""
    server = HTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
