"""Before `polar rollout --proxy URL` starts a session: is that proxy a boundary, and does it sample the policy as
the rollout needs?

A proxy-only sandbox reaches nothing but the proxy, so a proxy that relays non-model traffic (`polar proxy
--pass-through`, or mitmdump without polar_block_other) hands the agent every service on this machine's loopback
(issue 23, attack 3). The check is done for real, as an agent would try it: a throwaway listener on 127.0.0.1,
and requests to it through the proxy by each route an agent has (an absolute URL and a CONNECT on the forward
listener, a ``Host:`` header on the reverse one). Every one must be refused with polar's 403, and the listener
never reached.

A proxy in ``polar_sampling=client`` mode samples each call with the parameters its client sent: the harness, i.e.
the policy under training, would choose its own temperature (top_p, top_k, min_p, seed), and learn from samples
drawn as it chose. Its control plane says its mode (``GET /sessions``, with the control token); anything but
``fixed`` is refused unless the user trusts the agents (``--trust-claimed-sessions``, the same trust that lets a
claimed-mode proxy through).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# In the body of the addon's 403 for non-model traffic (polar_addon.addons.scope, polar_block_other).
BLOCKED_MARKER = b"(polar_block_other)"
MAX_ANSWER_BYTES = 4096
PROBE_PATH = "/polar-boundary-probe"


class ProxyNotABoundary(ValueError):
    pass


SAMPLING_REFUSAL = (
    "lets the policy choose how it is sampled: each call is sampled with the temperature, top_p, top_k, min_p and "
    "seed its harness sends. Restart it with --set polar_sampling=fixed (`polar rollout`'s own proxy does), or pass "
    "--trust-claimed-sessions if every agent is trusted"
)


def check_sampling_mode(url: str, mode: str | None, trusted: bool) -> str | None:
    """None for a ``fixed``-sampling proxy; the warning to print for another one the user trusts; else
    ProxyNotABoundary. ``mode``: what the proxy's control plane reports (None: it reports none, an older polar)."""
    if mode == "fixed":
        return None
    said = f"runs polar_sampling={mode}" if mode else "does not report its sampling mode (polar_sampling)"
    if trusted:
        return f"WARNING: the proxy at {url} {said}: used anyway (--trust-claimed-sessions)"
    raise ProxyNotABoundary(f"the proxy at {url} {said}, which {SAMPLING_REFUSAL}")


@dataclass(frozen=True)
class Probe:
    """One route tried: which listener, how, and what came back (``error`` when nothing did)."""

    route: str
    answer: bytes = b""
    error: str | None = None

    @property
    def refused(self) -> bool:
        status_line = self.answer.split(b"\r\n", 1)[0]
        return status_line.split(b" ")[1:2] == [b"403"] and BLOCKED_MARKER in self.answer


def probe_requests(target: int) -> list[tuple[str, str, bytes]]:
    """(route, listener: forward | reverse, raw request) for each way to reach 127.0.0.1:``target``."""
    host = f"127.0.0.1:{target}"
    return [
        (
            f"GET http://{host}{PROBE_PATH} (absolute URL)",
            "forward",
            f"GET http://{host}{PROBE_PATH} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode(),
        ),
        (f"CONNECT {host}", "forward", f"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()),
        (
            f"GET {PROBE_PATH} with Host: {host} (reverse listener)",
            "reverse",
            f"GET {PROBE_PATH} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode(),
        ),
    ]


def verdict(url: str, probes: list[Probe], reached: bool) -> str | None:
    """Why the proxy at ``url`` must not serve sandboxes, or None when it refused every probe."""
    if all(p.error and not p.answer for p in probes):
        return f"no proxy answers at {url} ({probes[0].error}): start it with `polar proxy` first"
    open_routes = [p for p in probes if not p.refused]
    if not open_routes and not reached:
        return None
    said = "; ".join(f"{p.route}: {_said(p)}" for p in open_routes) or "a probe reached the listener"
    return (
        f"the proxy at {url} passes non-model traffic ({said}): a proxy-only sandbox would reach any service on "
        "this machine through it. Start it with `polar proxy` (it blocks non-model traffic by default; not "
        "--pass-through), or give mitmdump --set polar_block_other=true"
    )


def _said(probe: Probe) -> str:
    if not probe.answer:
        return f"no answer ({probe.error})"
    return repr(probe.answer.split(b"\r\n", 1)[0].decode("latin-1"))


def check_blocks_other(url: str, forward_port: int, reverse_port: int, timeout_s: float = 10.0) -> None:
    """ProxyNotABoundary unless the proxy's listeners refuse every route to a loopback service."""
    with _listener() as (target, reached):
        probes = []
        for route, listener, request in probe_requests(target):
            port = forward_port if listener == "forward" else reverse_port
            probes.append(_send(route, port, request, timeout_s))
        problem = verdict(url, probes, reached())
    if problem is not None:
        raise ProxyNotABoundary(problem)


@contextmanager
def _listener() -> Iterator[tuple[int, Callable[[], bool]]]:
    """A loopback TCP listener that only notes who connected to it; ``reached()``: whether anything but that check
    itself has, by the time it is called."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    peers: list[tuple[str, int]] = []
    marks: set[tuple[str, int]] = set()  # the check's own connections
    accepted = threading.Condition()

    def accept() -> None:
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return  # closed: the check is over
            conn.close()
            with accepted:
                peers.append(peer)
                accepted.notify_all()

    def reached() -> bool:
        # A proxy that connected and then answered 403 made its connection before its answer came, but the thread
        # may not have taken it yet (a loaded machine): connections are accepted in order, so once one made now
        # is, every earlier one has been.
        with socket.create_connection(server.getsockname(), timeout=5) as own:
            mark = own.getsockname()
            marks.add(mark)
            with accepted:
                accepted.wait_for(lambda: mark in peers, timeout=5)
                return any(peer not in marks for peer in peers)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], reached
    finally:
        # shutdown wakes the accept() blocked in the thread; close alone would leave it waiting.
        try:
            server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        server.close()
        thread.join(timeout=5)


def _send(route: str, port: int, request: bytes, timeout_s: float) -> Probe:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(request)
            return Probe(route, _read_answer(sock))
    except OSError as exc:
        return Probe(route, error=f"127.0.0.1:{port}: {exc.strerror or type(exc).__name__}")


def _read_answer(sock: socket.socket) -> bytes:
    """The answer's head and as much of its body as its framing says (up to MAX_ANSWER_BYTES). A 200 to a CONNECT
    has no body and keeps the connection open: reading to the end would wait for the timeout."""
    answer = b""
    while len(answer) < MAX_ANSWER_BYTES:
        head, sep, body = answer.partition(b"\r\n\r\n")
        if sep and _complete(head, body):
            break
        try:
            chunk = sock.recv(MAX_ANSWER_BYTES)
        except OSError:
            break  # what came so far is the answer (a timeout after a partial one included)
        if not chunk:
            break
        answer += chunk
    return answer


def _complete(head: bytes, body: bytes) -> bool:
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    fields = {name.strip().lower(): value.strip() for name, value in fields.items()}
    if fields.get(b"content-length", b"").isdigit():
        return len(body) >= int(fields[b"content-length"])
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        return body.endswith(b"0\r\n\r\n")
    return True  # no body framed (a CONNECT's 200)
