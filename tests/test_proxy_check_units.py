"""`polar rollout --proxy`'s checks, against fake proxies on loopback (no mitmdump): the boundary probe by each
route an agent has, how an answer is read (by its framing, never waiting on a connection the proxy keeps open),
what counts as polar's refusal, and the refusal of a proxy that lets the policy choose its sampling.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from polar_cli.rollout import proxy_check
from polar_cli.rollout.proxy_check import (
    BLOCKED_MARKER,
    MAX_ANSWER_BYTES,
    PROBE_PATH,
    SAMPLING_REFUSAL,
    Probe,
    ProxyNotABoundary,
    check_blocks_other,
    check_sampling_mode,
    probe_requests,
    verdict,
)

POLAR_403 = (
    b"HTTP/1.1 403 Forbidden\r\ncontent-length: 55\r\n\r\npolar: non-model traffic is blocked (polar_block_other)"
)
OPEN_WORDS = (
    "a proxy-only sandbox would reach any service on this machine through it. Start it with `polar proxy` (it "
    "blocks non-model traffic by default; not --pass-through), or give mitmdump --set polar_block_other=true"
)

# --- the sampling mode ----------------------------------------------------------------------------------------


def test_a_fixed_sampling_proxy_passes_silently() -> None:
    assert check_sampling_mode("http://p", "fixed", trusted=False) is None
    assert check_sampling_mode("http://p", "fixed", trusted=True) is None


def test_another_mode_is_refused_unless_trusted_and_then_warned_about() -> None:
    with pytest.raises(ProxyNotABoundary) as refused:
        check_sampling_mode("http://p:1", "client", trusted=False)
    assert str(refused.value) == f"the proxy at http://p:1 runs polar_sampling=client, which {SAMPLING_REFUSAL}"
    assert check_sampling_mode("http://p:1", "client", trusted=True) == (
        "WARNING: the proxy at http://p:1 runs polar_sampling=client: used anyway (--trust-claimed-sessions)"
    )
    for unreported in (None, ""):
        with pytest.raises(ProxyNotABoundary) as refused:
            check_sampling_mode("u", unreported, trusted=False)
        assert str(refused.value) == (
            f"the proxy at u does not report its sampling mode (polar_sampling), which {SAMPLING_REFUSAL}"
        )
    assert check_sampling_mode("u", None, trusted=True) == (
        "WARNING: the proxy at u does not report its sampling mode (polar_sampling): used anyway "
        "(--trust-claimed-sessions)"
    )
    with pytest.raises(ProxyNotABoundary):
        check_sampling_mode("u", "FIXED", trusted=False)  # the control plane's exact word, nothing like it


# --- what counts as polar's refusal ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "refused"),
    [
        (POLAR_403, True),
        (b"HTTP/1.1 403\r\n\r\n(polar_block_other)", True),  # no reason phrase
        (b"HTTP/1.0 403 Forbidden\r\ncontent-length: 19\r\n\r\n(polar_block_other)", True),
        (b"HTTP/1.1 403 Forbidden\r\ncontent-length: 9\r\n\r\nforbidden", False),  # someone else's 403
        (b"HTTP/1.1 200 OK\r\ncontent-length: 19\r\n\r\n(polar_block_other)", False),  # the service echoing it
        (b"HTTP/1.1 4030 Odd\r\n\r\n(polar_block_other)", False),
        (b"HTTP/1.1 200 OK 403\r\n\r\n(polar_block_other)", False),  # 403 in the reason phrase
        (b"403 (polar_block_other)", False),  # not a status line
        (b"", False),
    ],
)
def test_only_polars_403_is_a_refusal(answer: bytes, refused: bool) -> None:
    assert Probe("r", answer).refused is refused


def test_every_route_to_the_target_is_probed() -> None:
    assert BLOCKED_MARKER == b"(polar_block_other)" and PROBE_PATH == "/polar-boundary-probe"
    assert probe_requests(4321) == [
        (
            "GET http://127.0.0.1:4321/polar-boundary-probe (absolute URL)",
            "forward",
            b"GET http://127.0.0.1:4321/polar-boundary-probe HTTP/1.1\r\nHost: 127.0.0.1:4321\r\n"
            b"Connection: close\r\n\r\n",
        ),
        ("CONNECT 127.0.0.1:4321", "forward", b"CONNECT 127.0.0.1:4321 HTTP/1.1\r\nHost: 127.0.0.1:4321\r\n\r\n"),
        (
            "GET /polar-boundary-probe with Host: 127.0.0.1:4321 (reverse listener)",
            "reverse",
            b"GET /polar-boundary-probe HTTP/1.1\r\nHost: 127.0.0.1:4321\r\nConnection: close\r\n\r\n",
        ),
    ]


# --- the verdict ----------------------------------------------------------------------------------------------


def test_the_verdict_names_each_open_route_and_what_it_said() -> None:
    refused = Probe("a", POLAR_403)
    assert verdict("u", [refused, refused, refused], reached=False) is None
    assert verdict("u", [refused], reached=True) == (
        f"the proxy at u passes non-model traffic (a probe reached the listener): {OPEN_WORDS}"
    )
    relayed = Probe("b", b"HTTP/1.1 200 Connection established\r\n\r\n")
    silent = Probe("c", error="timed out")
    assert verdict("http://p", [refused, relayed, silent], reached=False) == (
        "the proxy at http://p passes non-model traffic (b: 'HTTP/1.1 200 Connection established'; "
        f"c: no answer (timed out)): {OPEN_WORDS}"
    )
    latin = Probe("d", b"HTTP/1.1 502 Bad\xe9\r\nx: y\r\n\r\n")
    assert "(d: 'HTTP/1.1 502 Bad\xe9'): " in (verdict("u", [latin], reached=True) or "")


def test_nothing_answering_is_no_proxy_and_one_answer_is_enough_to_judge() -> None:
    down = [Probe("a", error="127.0.0.1:1: Connection refused"), Probe("b", error="other")]
    assert verdict("u", down, reached=False) == (
        "no proxy answers at u (127.0.0.1:1: Connection refused): start it with `polar proxy` first"
    )
    # An error with a partial answer came from something: it is judged on that answer.
    partial = Probe("a", b"HTTP/1.1 200 OK\r\n", error="timed out")
    assert verdict("u", [partial, down[1]], reached=False) == (
        f"the proxy at u passes non-model traffic (a: 'HTTP/1.1 200 OK'; b: no answer (other)): {OPEN_WORDS}"
    )
    assert verdict("u", [Probe("a", POLAR_403), down[1]], reached=False) == (
        f"the proxy at u passes non-model traffic (b: no answer (other)): {OPEN_WORDS}"
    )


# --- reading an answer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "body", "complete"),
    [
        (b"HTTP/1.1 403 Forbidden\r\ncontent-length: 5", b"12345", True),
        (b"HTTP/1.1 403 Forbidden\r\ncontent-length: 5", b"1234", False),
        (b"HTTP/1.1 403 Forbidden\r\nContent-Length :  5 ", b"12345", True),  # names and values are trimmed
        (b"HTTP/1.1 403 Forbidden\r\nCONTENT-LENGTH: 0", b"", True),
        (b"HTTP/1.1 200 OK\r\ncontent-length: many", b"", True),  # not a length: no framing to wait for
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked", b"5\r\nhello\r\n", False),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked", b"5\r\nhello\r\n0\r\n\r\n", True),
        (b"HTTP/1.1 200 Connection established", b"", True),
        (b"content-length: 9\r\nx: y", b"", True),  # the first line is the status line, never a field
    ],
)
def test_an_answer_is_complete_by_its_framing(head: bytes, body: bytes, complete: bool) -> None:
    assert proxy_check._complete(head, body) is complete


@contextmanager
def fake_server(answer: Callable[[bytes, socket.socket], None]) -> Iterator[int]:
    """A loopback server that reads one request head per connection and lets ``answer`` reply."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                request += chunk
            try:
                answer(request, conn)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        for conn in held:
            conn.close()
        thread.join(timeout=5)


def read_from(reply: bytes, timeout_s: float = 3.0) -> tuple[bytes, float]:
    """What ``_read_answer`` makes of ``reply`` from a server that then keeps the connection open."""
    with fake_server(lambda _, conn: conn.sendall(reply)) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            started = time.monotonic()
            answer = proxy_check._read_answer(sock)
            return answer, time.monotonic() - started


def test_a_framed_answer_is_read_without_waiting_for_the_connection_to_close() -> None:
    for reply in (
        POLAR_403,
        b"HTTP/1.1 200 Connection established\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ):
        answer, took = read_from(reply)
        assert answer == reply and took < 1.5, (reply, took)


def test_an_answer_cut_short_is_what_came_before_the_timeout() -> None:
    answer, took = read_from(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 99\r\n\r\npartial", timeout_s=0.3)
    assert answer == b"HTTP/1.1 403 Forbidden\r\ncontent-length: 99\r\n\r\npartial" and took >= 0.25


def test_an_endless_answer_is_read_up_to_max_answer_bytes() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n"
    answer, took = read_from(head + b"x" * (4 * MAX_ANSWER_BYTES))
    assert MAX_ANSWER_BYTES <= len(answer) < 2 * MAX_ANSWER_BYTES and took < 1.5
    assert answer == (head + b"x" * (4 * MAX_ANSWER_BYTES))[: len(answer)]


def test_an_answer_ended_by_the_server_is_read_to_its_end() -> None:
    def close_after(_: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\n\r\nno framing")
        conn.shutdown(socket.SHUT_WR)

    with fake_server(close_after) as port:
        probe = proxy_check._send("r", port, b"GET / HTTP/1.1\r\n\r\n", 3.0)
    assert probe == Probe("r", b"HTTP/1.1 403 Forbidden\r\n\r\nno framing")


def test_a_probe_to_a_closed_port_says_why() -> None:
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    assert proxy_check._send("r", port, b"x", 1.0) == Probe("r", error=f"127.0.0.1:{port}: Connection refused")


def test_the_listener_notes_a_connection_and_is_gone_after() -> None:
    with proxy_check._listener() as (port, reached):
        assert not reached() and not reached()  # its own check connections do not count
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert reached()  # at once: no waiting for the accepting thread
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


# --- the whole check against fake proxies ---------------------------------------------------------------------


def guarded(_: bytes, conn: socket.socket) -> None:
    conn.sendall(POLAR_403)  # and keeps the connection open, as mitmproxy does


def reach(request: bytes) -> None:
    """Connect where the request's Host says, as a relaying proxy does."""
    fields = request.split(b"\r\n")[1:]
    host = next(v.strip() for k, _, v in (f.partition(b":") for f in fields) if k.lower() == b"host")
    name, port = host.decode().rsplit(":", 1)
    socket.create_connection((name, int(port)), timeout=2).close()


def relaying(request: bytes, conn: socket.socket) -> None:
    """A proxy that lets everything through."""
    reach(request)
    if request.startswith(b"CONNECT"):
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
    else:
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")


def test_a_proxy_that_refuses_every_route_passes() -> None:
    with fake_server(guarded) as forward, fake_server(guarded) as reverse:
        started = time.monotonic()
        check_blocks_other("http://p", forward, reverse, timeout_s=5.0)
        assert time.monotonic() - started < 3  # read by framing: no probe waits for its timeout


def test_a_proxy_that_relays_is_refused_with_every_open_route() -> None:
    with fake_server(relaying) as forward, fake_server(guarded) as reverse:
        with pytest.raises(ProxyNotABoundary) as refused:
            check_blocks_other("http://p", forward, reverse, timeout_s=5.0)
    target = str(refused.value).split("GET http://127.0.0.1:", 1)[1].split("/", 1)[0]
    assert str(refused.value) == (
        f"the proxy at http://p passes non-model traffic (GET http://127.0.0.1:{target}/polar-boundary-probe "
        f"(absolute URL): 'HTTP/1.1 502 Bad Gateway'; CONNECT 127.0.0.1:{target}: "
        f"'HTTP/1.1 200 Connection established'): {OPEN_WORDS}"
    )


def test_a_proxy_that_answers_403_but_still_connects_is_refused() -> None:
    def sneaky(request: bytes, conn: socket.socket) -> None:
        reach(request)
        conn.sendall(POLAR_403)

    with fake_server(sneaky) as forward, fake_server(guarded) as reverse:
        with pytest.raises(ProxyNotABoundary, match=r"\(a probe reached the listener\)"):
            check_blocks_other("http://p", forward, reverse, timeout_s=5.0)


def test_the_reverse_listener_is_probed_on_its_own_port() -> None:
    with fake_server(guarded) as forward, fake_server(relaying) as reverse:
        with pytest.raises(ProxyNotABoundary) as refused:
            check_blocks_other("http://p", forward, reverse, timeout_s=5.0)
    assert "(reverse listener): 'HTTP/1.1 502 Bad Gateway'): " in str(refused.value)
    assert "absolute URL)" not in str(refused.value) and "CONNECT" not in str(refused.value)


def test_no_proxy_at_all_is_said_so() -> None:
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        forward, reverse = a.getsockname()[1], b.getsockname()[1]
    with pytest.raises(ProxyNotABoundary) as refused:
        check_blocks_other("http://p", forward, reverse, timeout_s=1.0)
    assert str(refused.value) == (
        f"no proxy answers at http://p (127.0.0.1:{forward}: Connection refused): start it with `polar proxy` first"
    )


def test_a_silent_proxy_is_given_the_timeout() -> None:
    with fake_server(lambda _, conn: None) as forward, fake_server(guarded) as reverse:
        started = time.monotonic()
        with pytest.raises(ProxyNotABoundary) as refused:
            check_blocks_other("http://p", forward, reverse, timeout_s=0.3)
        took = time.monotonic() - started
    # A silent answer is no refusal; each of the two forward probes waited its timeout, no longer.
    assert "(absolute URL): no answer (" in str(refused.value), str(refused.value)
    assert 0.5 <= took < 3, took


def test_fields_whose_values_hold_colons_are_read() -> None:
    head = b"HTTP/1.1 403 Forbidden\r\nDate: Sun, 06 Dec 2026 00:58:12 GMT\r\ncontent-length: 3"
    assert proxy_check._complete(head, b"abc") and not proxy_check._complete(head, b"ab")


def test_an_answer_the_server_ends_early_is_every_piece_that_came() -> None:
    def halves(_: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 99\r\n\r\nfirst ")
        time.sleep(0.1)
        conn.sendall(b"second")
        time.sleep(0.1)
        conn.shutdown(socket.SHUT_WR)

    with fake_server(halves) as port:
        probe = proxy_check._send("r", port, b"GET / HTTP/1.1\r\n\r\n", 5.0)
    assert probe == Probe("r", b"HTTP/1.1 403 Forbidden\r\ncontent-length: 99\r\n\r\nfirst second")


def test_a_failure_without_an_os_message_is_named_by_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    def timed_out(*args: object, **kwargs: object) -> socket.socket:
        raise TimeoutError("timed out")  # what a connect timeout raises: no strerror

    monkeypatch.setattr(proxy_check.socket, "create_connection", timed_out)
    assert proxy_check._send("r", 9, b"x", 1.0) == Probe("r", error="127.0.0.1:9: TimeoutError")
