"""The relay's pure parts and its loopback stream server, in-process (no mitmdump).

An agent decides the size, number and pacing of its request bodies: the per-client budget must charge and give
back exactly, refuse at one byte past its limit and never grow with the clients it has seen; a counted body must
be dropped at one byte past its cap; the heap trim must wait for a lot of releases; and a parked stream must be
served once, with the status and type it was parked with, and closed whatever happens to its reader.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from polar_addon import relay
from polar_addon.relay import OVER_BUDGET, STREAM_PREFIX, TOO_LARGE, BodyBudget, CountedBody, HeapTrim, StreamRelay

# --- BodyBudget ------------------------------------------------------------------------------------------------


def test_the_budget_admits_exactly_its_limit_and_refuses_one_byte_more_charging_nothing() -> None:
    budget = BodyBudget(10)
    assert budget.take("f1", "10.0.0.1", "c1", 4)
    assert budget.take("f2", "10.0.0.1", "c1", 6)  # 4 + 6 == limit: admitted
    assert budget.held("10.0.0.1") == 10
    assert not budget.take("f3", "10.0.0.1", "c2", 1)  # one past
    assert budget.held("10.0.0.1") == 10
    assert budget.release("f3") == 0  # the refused take charged nothing to its flow either
    fresh = BodyBudget(10)
    assert fresh.take("f", "a", "c", 10) and not BodyBudget(10).take("f", "a", "c", 11)


def test_a_flows_charges_add_up_and_are_given_back_whole() -> None:
    budget = BodyBudget(100)
    assert budget.take("f", "a", "c", 30) and budget.take("f", "a", "c", 25)
    assert budget.held("a") == 55
    assert budget.release("f") == 55
    assert budget.held("a") == 0
    assert budget.release("f") == 0  # given back once


def test_a_release_leaves_the_clients_other_flows_to_the_byte() -> None:
    budget = BodyBudget(100)
    assert budget.take("big", "a", "c1", 60) and budget.take("one", "a", "c2", 1)
    assert budget.release("big") == 60
    assert budget.held("a") == 1  # one byte left is still held
    assert not budget.take("x", "a", "c3", 100)
    assert budget.take("x", "a", "c3", 99)


def test_the_budget_forgets_every_client_once_it_holds_nothing() -> None:
    """A proxy runs for days and sees many client addresses: an address holding nothing costs no entry."""
    budget = BodyBudget(100)
    for i in range(50):
        assert budget.take(f"f{i}", f"10.0.0.{i}", f"c{i}", 1 + i)
    for i in range(50):
        assert budget.release(f"f{i}") == 1 + i
    assert budget.release("never-charged") == 0
    assert budget._held == {} and budget._charges == {}
    assert budget.held("") == 0


def test_a_closed_connection_gives_back_only_its_own_flows() -> None:
    budget = BodyBudget(100)
    assert budget.take("f1", "a", "c1", 10) and budget.take("f2", "a", "c1", 20)
    assert budget.take("f3", "a", "c2", 30) and budget.take("f4", "b", "c3", 5)
    assert budget.release_connection("c1") == 30
    assert (budget.held("a"), budget.held("b")) == (30, 5)
    assert budget.release_connection("c1") == 0
    assert budget.release_connection("unknown") == 0
    assert budget.release("f3") == 30 and budget.release("f4") == 5
    assert budget._held == {}


# --- CountedBody ----------------------------------------------------------------------------------------------


class Grants:
    """A budget stub: grants while ``left`` lasts, records each ask and each drop."""

    def __init__(self, left: int) -> None:
        self.left, self.asked, self.drops = left, [], 0

    def take(self, n: int) -> bool:
        self.asked.append(n)
        if n > self.left:
            return False
        self.left -= n
        return True

    def drop(self) -> None:
        self.drops += 1


def counted(cap: int, grants: Grants) -> CountedBody:
    return CountedBody(
        cap=cap,
        token="t",
        scheme="https",
        host="api.example",
        port=443,
        path="/v1/messages",
        host_header=None,
        take=grants.take,
        drop=grants.drop,
    )


def test_a_body_of_exactly_its_cap_is_kept_whole_and_one_byte_more_is_refused() -> None:
    grants = Grants(1000)
    body = counted(10, grants)
    assert body.count(b"abcd") == [] and body.count(b"efghij") == []
    assert (bytes(body.kept), body.seen, body.refused, grants.asked, grants.drops) == (
        b"abcdefghij",
        10,
        None,
        [4, 6],
        0,
    )
    assert body.count(b"k") == []
    assert (body.kept, body.seen, body.refused, grants.drops) == (bytearray(), 11, TOO_LARGE, 1)
    assert grants.asked == [4, 6]  # a body past its cap asks the budget for nothing more


def test_after_a_refusal_the_rest_is_only_counted() -> None:
    grants = Grants(1000)
    body = counted(5, grants)
    body.count(b"123456")
    assert (body.refused, grants.drops, grants.asked) == (TOO_LARGE, 1, [])
    for _ in range(3):
        assert body.count(b"xyz") == []
    assert (body.kept, body.seen, body.refused, grants.drops, grants.asked) == (bytearray(), 15, TOO_LARGE, 1, [])


def test_a_body_the_budget_refuses_is_dropped_once_and_keeps_its_reason() -> None:
    grants = Grants(7)
    body = counted(100, grants)
    body.count(b"12345")
    body.count(b"678")  # 3 more than the 2 left
    assert (body.kept, body.seen, body.refused, grants.asked, grants.drops) == (bytearray(), 8, OVER_BUDGET, [5, 3], 1)
    body.count(b"x" * 200)  # past the cap too: the first reason stands, nothing is asked or dropped again
    assert (body.refused, body.seen, grants.asked, grants.drops) == (OVER_BUDGET, 208, [5, 3], 1)


def test_one_chunk_yields_the_body_once() -> None:
    async def collect() -> list[bytes]:
        return [chunk async for chunk in relay.one_chunk(b"whole body")]

    assert asyncio.run(collect()) == [b"whole body"]


# --- HeapTrim -------------------------------------------------------------------------------------------------


def test_the_trim_is_libcs_malloc_trim_on_glibc() -> None:
    trim = HeapTrim()
    assert trim._trim is not None and trim._trim(0) in (0, 1)
    assert trim._pending is None and trim._released == 0


def test_the_heap_is_trimmed_once_after_reclaim_bytes_were_released(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(relay.gc, "collect", lambda *a: collected.append(1) or 0)
    monkeypatch.setattr(HeapTrim, "DELAY_S", 0.01)

    async def main() -> list[Any]:
        trim = HeapTrim()
        trimmed: list[int] = []
        trim._trim = lambda pad: trimmed.append(pad) or 1
        seen = []
        half = HeapTrim.RECLAIM_BYTES // 2
        trim.freed(half)
        trim.freed(half - 1)  # one byte short
        seen.append((trim._pending is None, trim._released))
        await asyncio.sleep(0.05)
        seen.append((trimmed[:], len(collected)))
        trim.freed(1)  # exactly RECLAIM_BYTES
        pending = trim._pending
        trim.freed(HeapTrim.RECLAIM_BYTES)  # while one is pending: no second one
        seen.append((pending is not None, trim._pending is pending))
        await asyncio.sleep(0.05)
        seen.append((trimmed[:], len(collected), trim._pending, trim._released))
        trim.freed(HeapTrim.RECLAIM_BYTES - 1)  # counting starts again from zero
        seen.append(trim._pending is None)
        return seen

    assert asyncio.run(main()) == [
        (True, HeapTrim.RECLAIM_BYTES - 1),
        ([], 0),
        (True, True),
        ([0], 1, None, 0),
        True,
    ]


def test_the_trim_waits_delay_s_after_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay.gc, "collect", lambda *a: 0)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        delays: list[float] = []
        real = loop.call_later
        loop.call_later = lambda delay, fn, *args: delays.append(delay) or real(0, fn, *args)  # type: ignore[method-assign]
        trim = HeapTrim()
        trim._trim = None  # not glibc: the collection alone, no error
        trim.freed(HeapTrim.RECLAIM_BYTES)
        await asyncio.sleep(0.01)
        assert trim._pending is None and trim._released == 0
        return delays[0]

    assert asyncio.run(main()) == 1.0 == HeapTrim.DELAY_S


def test_reclaim_bytes_is_64_mib() -> None:
    # Lower, a proxy would run a full collection every few calls; higher, a flood's memory would stay.
    assert HeapTrim.RECLAIM_BYTES == 64 * 1024 * 1024


# --- StreamRelay ----------------------------------------------------------------------------------------------


class Chunks:
    """An async iterator of chunks that notes whether it was closed (the engine stream behind it ends)."""

    def __init__(self, chunks: list[bytes], fail: BaseException | None = None) -> None:
        self._chunks, self._fail, self.closed = list(chunks), fail, 0

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        if self._fail is not None:
            raise self._fail
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed += 1


async def _get(port: int, token: str, method: str = "GET", data: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"http://127.0.0.1:{port}{STREAM_PREFIX}{token}", data=data) as response:
            return response.status, dict(response.headers), await response.read()


def test_a_parked_stream_is_served_once_with_its_status_and_type() -> None:
    async def main() -> list[Any]:
        server = StreamRelay()
        await server.start()
        try:
            assert server.port > 0
            chunks = Chunks([b"event: a\n\n", b"", b"event: b\n\n"])
            token = server.park(429, "text/event-stream; charset=utf-8", chunks)
            first = await _get(server.port, token, "POST", b'{"counted": "elsewhere"}')
            again = await _get(server.port, token)
            unknown = await _get(server.port, "not-a-token")
            return [first, chunks.closed, again, unknown, server._pending]
        finally:
            await server.stop()

    (status, headers, body), closed, again, unknown, pending = asyncio.run(main())
    assert (status, body, closed) == (429, b"event: a\n\nevent: b\n\n", 1)
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8" and headers["Cache-Control"] == "no-cache"
    assert again[0] == unknown[0] == 404
    assert again[2] == unknown[2] == b"unknown or already used polar stream token"
    assert pending == {}


def test_a_stream_parked_under_a_handed_out_token_is_found_there() -> None:
    async def main() -> tuple[str, tuple[int, dict[str, str], bytes]]:
        server = StreamRelay()
        await server.start()
        try:
            token = server.new_token()
            assert server.park(200, "application/json", relay.one_chunk(b"{}"), token=token) == token
            return token, await _get(server.port, token)
        finally:
            await server.stop()

    token, (status, headers, body) = asyncio.run(main())
    assert (status, headers["Content-Type"], body) == (200, "application/json", b"{}")
    assert len(token) == 22 and token != StreamRelay.new_token()  # 16 random bytes, url-safe


def test_a_stream_that_fails_midway_is_closed_and_its_reader_cut() -> None:
    async def main() -> tuple[int, str]:
        server = StreamRelay()
        await server.start()
        chunks = Chunks([b"data: 1\n\n"], fail=RuntimeError("engine died"))
        token = server.park(200, "text/event-stream", chunks)
        try:
            outcome = "complete"
            try:
                await _get(server.port, token)
            except aiohttp.ClientPayloadError:
                outcome = "cut"
            return chunks.closed, outcome
        finally:
            await server.stop()

    assert asyncio.run(main()) == (1, "cut")  # never a clean end the client would take for the whole answer


def test_an_uncollected_stream_is_dropped_and_closed_after_600_s() -> None:
    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        timers: list[tuple[float, Any, tuple[Any, ...]]] = []
        loop.call_later = lambda delay, fn, *args: timers.append((delay, fn, args))  # type: ignore[method-assign]
        server = StreamRelay()
        chunks = Chunks([b"x"])
        token = server.park(200, "text/plain", chunks)
        other = server.park(200, "text/plain", object())  # type: ignore[arg-type]  # no aclose: dropped all the same
        for _, fn, args in timers:
            fn(*args)
        timers[0][1](*timers[0][2])  # a second drop of the same token does nothing
        await asyncio.sleep(0)
        return [[(delay, args) for delay, _, args in timers], [token, other], chunks.closed, server._pending]

    timers, tokens, closed, pending = asyncio.run(main())
    assert timers == [(600, (tokens[0],)), (600, (tokens[1],))]
    assert (closed, pending) == (1, {})


def test_stop_closes_every_parked_stream_and_the_listener() -> None:
    async def main() -> tuple[int, int, dict[str, Any], bool]:
        server = StreamRelay()
        await server.start()
        a, b = Chunks([b"a"]), Chunks([b"b"])
        server.park(200, "text/plain", a)
        server.park(200, "text/plain", b)
        port = server.port
        await server.stop()
        await asyncio.sleep(0)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            listening = True
        except OSError:
            listening = False
        return a.closed, b.closed, server._pending, listening

    assert asyncio.run(main()) == (1, 1, {}, False)


def test_stop_before_start_does_nothing() -> None:
    asyncio.run(StreamRelay().stop())


def test_a_client_gone_mid_body_gets_499_and_nothing_parked_is_taken() -> None:
    class HungUp:
        match_info = {"token": "tok"}

        async def read(self) -> bytes:
            raise ConnectionResetError("peer gone")

    async def main() -> tuple[int, bool]:
        server = StreamRelay()
        chunks = Chunks([b"x"])
        loop = asyncio.get_running_loop()
        loop.call_later = lambda *a: None  # type: ignore[method-assign]
        server.park(200, "text/plain", chunks, token="tok")
        response = await server._serve(HungUp())  # type: ignore[arg-type]
        return response.status, "tok" in server._pending

    assert asyncio.run(main()) == (499, True)


def test_without_glibc_the_collection_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: str | None) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    collected: list[int] = []
    monkeypatch.setattr(relay.ctypes, "CDLL", no_libc)
    monkeypatch.setattr(relay.gc, "collect", lambda *a: collected.append(1) or 0)
    trim = HeapTrim()
    assert trim._trim is None
    trim._reclaim()
    assert collected == [1]


def test_two_relays_listen_on_loopback_each_on_a_free_port() -> None:
    """Only this process may collect a parked stream: never another interface, never a fixed port (two proxies
    on one machine, or a port a local service holds)."""

    async def main() -> list[tuple[str, int]]:
        first, second = StreamRelay(), StreamRelay()
        await first.start()
        await second.start()
        try:
            return [
                (next(iter(r._runner.sites))._server.sockets[0].getsockname()[0], r.port)  # type: ignore[union-attr]
                for r in (first, second)
            ]
        finally:
            await first.stop()
            await second.stop()

    (host_a, port_a), (host_b, port_b) = asyncio.run(main())
    assert host_a == host_b == "127.0.0.1"
    assert port_a != port_b and 1024 <= min(port_a, port_b) and 8080 not in (port_a, port_b)


def test_the_relay_logs_no_line_per_stream(caplog: pytest.LogCaptureFixture) -> None:
    """Every streamed answer passes here: an access log would grow by a line per model call."""

    async def main() -> int:
        server = StreamRelay()
        await server.start()
        try:
            token = server.park(200, "text/plain", relay.one_chunk(b"x"))
            return (await _get(server.port, token))[0]
        finally:
            await server.stop()

    with caplog.at_level("DEBUG", logger="aiohttp.access"):
        assert asyncio.run(main()) == 200
    assert [r for r in caplog.records if r.name == "aiohttp.access"] == []


def test_a_stream_without_aclose_is_served_to_its_end() -> None:
    class Plain:
        def __init__(self) -> None:
            self.left = [b"one ", b"two"]

        def __aiter__(self) -> Plain:
            return self

        async def __anext__(self) -> bytes:
            if not self.left:
                raise StopAsyncIteration
            return self.left.pop(0)

    async def main() -> tuple[int, dict[str, str], bytes]:
        server = StreamRelay()
        await server.start()
        try:
            return await _get(server.port, server.park(200, "text/plain", Plain()))  # type: ignore[arg-type]
        finally:
            await server.stop()

    status, _, body = asyncio.run(main())
    assert (status, body) == (200, b"one two")
