"""Tests start mitmdump the way users' rollouts do; a third-party echo server for pass-through checks."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer

from polar_cli.mitm import REPO, Proxy, free_port, run_mitmdump, wait_for_port

__all__ = ["REPO", "Proxy", "echo_server", "free_port", "run_mitmdump", "wait_for_port"]


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
