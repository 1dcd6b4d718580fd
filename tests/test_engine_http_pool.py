"""The pooled HTTP client to an engine server (vLLM, SGLang): a keep-alive connection the server drops while a
request is on its way costs a retry, not a 503 to the harness (4 in 1280 calls under load before the fix)."""

from __future__ import annotations

import asyncio

import pytest

from polar_addon.canonical import PolarError
from polar_addon.engines.openai_compat import KEEPALIVE_S, HTTPEngine

OK = b'{"data": [{"id": "tiny"}]}'


async def _server(drop_reused: bool) -> tuple[asyncio.AbstractServer, list[str]]:
    """An HTTP/1.1 server that keeps connections alive and, with ``drop_reused``, closes a connection when a
    second request arrives on it without answering: the race uvicorn's keep-alive timeout opens."""
    events: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if served and drop_reused:
                    events.append("dropped")
                    writer.transport.abort()  # a reset, as a server closing an idle connection gives
                    return
                served += 1
                events.append("answered")
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(OK), OK)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, events


def test_a_dropped_pooled_connection_is_retried_once() -> None:
    async def main() -> list[str]:
        server, events = await _server(drop_reused=True)
        engine = HTTPEngine(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            for _ in range(3):
                # A POST, as a completion is (aiohttp retries idempotent methods on its own).
                assert await engine.request_json("POST", "/v1/chat/completions", {"x": 1}) == {"data": [{"id": "tiny"}]}
        finally:
            await engine.close()
            server.close()
        return events

    # Calls 2 and 3 each met a dropped pooled connection and were answered on a fresh one.
    assert asyncio.run(main()) == ["answered", "dropped", "answered", "dropped", "answered"]


def test_an_engine_that_keeps_failing_is_still_a_503_after_one_retry() -> None:
    async def main() -> int:
        attempts = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal attempts
            attempts += 1
            await reader.readuntil(b"\r\n\r\n")
            writer.transport.abort()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        engine = HTTPEngine(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            with pytest.raises(PolarError) as err:
                await engine.request_json("POST", "/v1/chat/completions", {"x": 1})
            assert err.value.status == 503
        finally:
            await engine.close()
            server.close()
        return attempts

    # aiohttp itself retries idempotent methods; a completion is a POST, retried by polar alone, once.
    assert asyncio.run(main()) == 2


def test_idle_connections_are_dropped_before_uvicorns_keepalive_closes_them() -> None:
    assert KEEPALIVE_S < 5.0  # uvicorn's default timeout_keep_alive, which vLLM and SGLang serve with
