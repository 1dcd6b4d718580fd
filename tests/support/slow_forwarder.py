"""A loopback HTTP forwarder that delays every answer: makes a real engine look slow; or, with ``record``, keeps
every exchange, so a test reads what the engine itself answered (its reported prompt ids) rather than what polar
made of it.

Used to check that a streaming client with a short read timeout survives a long generation
thanks to the proxy's keep-alive events.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from aiohttp import web


@dataclass(frozen=True)
class Exchange:
    """One forwarded call: its path, and the JSON bodies sent and answered (None where not JSON)."""

    method: str
    path: str
    request: Any
    status: int
    response: Any


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


@contextmanager
def slow_forwarder(target: str, delay_s: float, record: list[Exchange] | None = None) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict = {}

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        await asyncio.sleep(delay_s)
        async with httpx.AsyncClient(timeout=600) as client:
            upstream = await client.request(
                request.method,
                target + request.path_qs,
                content=body,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
        if record is not None:
            record.append(
                Exchange(request.method, request.path, _json(body), upstream.status_code, _json(upstream.content))
            )
        return web.Response(
            status=upstream.status_code,
            body=upstream.content,
            content_type=upstream.headers.get("content-type", "application/json").split(";")[0],
        )

    async def start() -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"] = runner
        state["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield state["url"]
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
