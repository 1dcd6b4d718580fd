"""A loopback HTTP server that relays live streams produced inside the mitmproxy process.

mitmproxy's ``Response.make`` can only send a finished body. For a reply that must stream
(keep-alives while a slow engine works), the addon parks the stream here under a one-time token
and points the intercepted flow at ``http://127.0.0.1:PORT/_polar/stream/TOKEN``; mitmproxy then
forwards our bytes to the client as they are written (``flow.response.stream = True``).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web

STREAM_PREFIX = "/_polar/stream/"


@dataclass
class CountedBody:
    """A request body read through a counter (see ``addon.Polar._count_body``): at most ``cap + 1`` bytes kept."""

    cap: int
    token: str
    scheme: str
    host: str
    port: int
    path: str
    host_header: str | None
    kept: bytearray = field(default_factory=bytearray)
    seen: int = 0

    def count(self, chunk: bytes) -> list[bytes]:
        self.seen += len(chunk)
        if len(self.kept) <= self.cap:
            self.kept.extend(chunk[: self.cap + 1 - len(self.kept)])
        # Nothing travels on (the relay only waits for the end of the body); an empty list, as b"" would be
        # sent as a chunk of length 0, which ends a chunked body.
        return []



async def one_chunk(body: bytes) -> AsyncIterator[bytes]:
    yield body

class StreamRelay:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, str, AsyncIterator[bytes]]] = {}
        self._runner: web.AppRunner | None = None
        self.port: int = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", STREAM_PREFIX + "{token}", self._serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(16)

    def park(self, status: int, content_type: str, chunks: AsyncIterator[bytes], token: str | None = None) -> str:
        """Park a reply; ``token``: one handed out earlier by :meth:`new_token` (a flow already pointed here)."""
        token = token or self.new_token()
        self._pending[token] = (status, content_type, chunks)
        # A parked stream nobody collects (client gone before the redirect landed) must not leak.
        asyncio.get_running_loop().call_later(600, self._drop, token)
        return token

    def _drop(self, token: str) -> None:
        entry = self._pending.pop(token, None)
        if entry is not None:
            aclose = getattr(entry[2], "aclose", None)
            if aclose is not None:
                asyncio.ensure_future(aclose())

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        # A flow whose body the addon counted on its way (Polar.requestheaders) arrives here before its reply
        # is parked: the reply is parked by the time the (empty) request body ends.
        await request.read()
        entry = self._pending.pop(request.match_info["token"], None)
        if entry is None:
            raise web.HTTPNotFound(text="unknown or already used polar stream token")
        status, content_type, chunks = entry
        response = web.StreamResponse(status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            async for chunk in chunks:
                await response.write(chunk)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        await response.write_eof()
        return response

    async def stop(self) -> None:
        for token in list(self._pending):
            self._drop(token)
        if self._runner is not None:
            await self._runner.cleanup()
