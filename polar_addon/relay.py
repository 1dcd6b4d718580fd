"""A loopback HTTP server that relays live streams produced inside the mitmproxy process.

mitmproxy's ``Response.make`` can only send a finished body. For a reply that must stream
(keep-alives while a slow engine works), the addon parks the stream here under a one-time token
and points the intercepted flow at ``http://127.0.0.1:PORT/_polar/stream/TOKEN``; mitmproxy then
forwards our bytes to the client as they are written (``flow.response.stream = True``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

STREAM_PREFIX = "/_polar/stream/"


class BodyBudget:
    """Request-body bytes the proxy holds per client address, over all of that client's connections, from the
    moment a body starts arriving until its flow ends (answered, failed or cut). A client that opens many
    connections cannot hold more than ``limit`` bytes of bodies at once: one flow over the rest is refused.
    Every sandbox's connections arrive from loopback (its bridge), so for them this is the proxy's total."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}  # client address -> bytes held
        self._charges: dict[str, tuple[str, str, int]] = {}  # flow id -> (client address, connection id, bytes)

    def take(self, flow_id: str, client: str, connection: str, n: int) -> bool:
        """Charge ``n`` more bytes to ``flow_id``; False (nothing charged) when its client would exceed the limit."""
        held = self._held.get(client, 0)
        if held + n > self.limit:
            return False
        self._held[client] = held + n
        _, _, charged = self._charges.get(flow_id, (client, connection, 0))
        self._charges[flow_id] = (client, connection, charged + n)
        return True

    def release(self, flow_id: str) -> int:
        """Give back what ``flow_id`` held; returns how many bytes that was."""
        client, _, charged = self._charges.pop(flow_id, ("", "", 0))
        left = self._held.get(client, 0) - charged
        if left > 0:
            self._held[client] = left
        else:
            self._held.pop(client, None)
        return charged

    def release_connection(self, connection: str) -> int:
        """Everything a closed connection's flows still held (a flow cut mid-body never reaches its own end)."""
        return sum(
            self.release(flow_id) for flow_id in [f for f, (_, conn, _) in self._charges.items() if conn == connection]
        )

    def held(self, client: str) -> int:
        return self._held.get(client, 0)


TOO_LARGE, OVER_BUDGET = "too_large", "over_budget"


class HeapTrim:
    """Hands request-body memory back to the OS once a lot of it was released. A flow's buffers sit in reference
    cycles (mitmproxy's layers and flows), freed only by a full garbage collection, which a quiet proxy may not run
    for a long time; and mitmproxy reads in 64 KiB chunks, below glibc's mmap threshold, so even freed they stay
    in the process's RSS until ``malloc_trim`` gives the free pages back. Both run once per ``RECLAIM_BYTES``
    released: rare under honest traffic, soon after a flood of bodies ends."""

    RECLAIM_BYTES = 64 << 20
    DELAY_S = 1.0  # the flows' buffers are dropped after their hooks ran: collect once they are unreachable

    def __init__(self) -> None:
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: the collection alone
            self._trim = None
        self._released = 0
        self._pending: asyncio.TimerHandle | None = None

    def freed(self, n: int) -> None:
        self._released += n
        if self._released >= self.RECLAIM_BYTES and self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.DELAY_S, self._reclaim)

    def _reclaim(self) -> None:
        self._pending = None
        self._released = 0
        gc.collect()  # may take a few hundred ms in a proxy holding a model's tokenizer: hence the rarity
        if self._trim is not None:
            self._trim(0)


@dataclass
class CountedBody:
    """A request body read through a counter (see ``addons.BodyLimits._count_body``): kept while it stays within
    ``cap`` and ``take`` (the client's budget) grants its bytes; past either it is dropped on the spot, the rest
    discarded as it arrives, and the flow refused (``refused``) once the body ended."""

    cap: int
    token: str
    scheme: str
    host: str
    port: int
    path: str
    host_header: str | None
    take: Callable[[int], bool]
    drop: Callable[[], None]
    kept: bytearray = field(default_factory=bytearray)
    seen: int = 0
    refused: str | None = None  # TOO_LARGE or OVER_BUDGET

    def count(self, chunk: bytes) -> list[bytes]:
        self.seen += len(chunk)
        if self.refused is None:
            if self.seen > self.cap:
                self.refuse(TOO_LARGE)
            elif not self.take(len(chunk)):
                self.refuse(OVER_BUDGET)
            else:
                self.kept.extend(chunk)
        # Nothing travels on (the relay only waits for the end of the body); an empty list, as b"" would be
        # sent as a chunk of length 0, which ends a chunked body.
        return []

    def refuse(self, why: str) -> None:
        self.refused = why
        self.kept = bytearray()
        self.drop()


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
        # A flow whose body the addon counted on its way (BodyLimits.requestheaders) arrives here before its reply
        # is parked: the reply is parked by the time the (empty) request body ends.
        try:
            await request.read()
        except ConnectionError:
            # Its client hung up (or was cut, polar_body_timeout) mid-body: nothing is parked, nobody listens.
            return web.Response(status=499)
        entry = self._pending.pop(request.match_info["token"], None)
        if entry is None:
            raise web.HTTPNotFound(text="unknown or already used polar stream token")
        status, content_type, chunks = entry
        response = web.StreamResponse(
            status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
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
