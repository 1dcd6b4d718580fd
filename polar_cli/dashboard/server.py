"""`polar dashboard`'s web app: the snapshot as JSON, pushed again over server-sent events when files change.

Read-only by construction: every route is GET (Starlette answers HEAD too, and 405 to anything else), and nothing
here writes a file. Everything shown is the agent's to choose (session and task ids, tool names, outputs, error
reasons), so the page builds its DOM with textContent only, JSON goes out as application/json, and a
Content-Security-Policy lets no script run but the page's own: a string that slipped into markup still runs
nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from polar_cli.dashboard.snapshot import Fingerprint, Snapshotter, fingerprint

POLL_S = 1.0
KEEPALIVE_S = 15.0
STATIC = ("dashboard.html", "dashboard.js", "dashboard.css")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
_COMMON = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _static(name: str) -> bytes:
    return (resources.files("polar_cli.dashboard") / "static" / name).read_bytes()


def _json(data: Any) -> bytes:
    # orjson writes NaN and infinities as null (Starlette's JSONResponse would raise on them) and never a raw
    # newline: one event's data stays one line.
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


def _trace_csp(markup: str) -> str:
    """The `polar view` page's policy: its one inline script, by hash; inline styles (its token colours)."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for body in re.findall(r"<script>(.*?)</script>", markup, flags=re.S)
    )
    return (
        f"default-src 'none'; script-src {hashes or chr(39) + 'none' + chr(39)}; style-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


class Dashboard:
    """The app's state: one directory's snapshotter, and the tokenizers the trace pages have loaded."""

    def __init__(self, path: Path, poll_s: float = POLL_S, max_events: int | None = None) -> None:
        self.path = path
        self.poll_s = poll_s
        self.max_events = max_events  # the event stream ends after this many snapshots (tests; None: never)
        self.snapshots = Snapshotter(path)
        self._lock = asyncio.Lock()  # one snapshot at a time: the Snapshotter's cache is not shared across threads
        self._tokenizers: dict[str, tuple[Any, str]] = {}
        self._last: tuple[Fingerprint, dict[str, Any]] | None = None
        self.closing = False  # set on shutdown: the event streams end, so the server need not cut them

    def close_streams(self) -> None:
        self.closing = True

    async def snapshot(self, now: Fingerprint | None = None) -> dict[str, Any]:
        """The snapshot for the files as they are (``now``: their fingerprint, when the caller has it): the last one
        again while nothing changed, so several open pages cost one snapshot per change."""
        async with self._lock:
            if now is None:
                now = await asyncio.to_thread(fingerprint, self.path)
            if self._last is not None and self._last[0] == now:
                return self._last[1]
            data = await asyncio.to_thread(self.snapshots.snapshot)
            self._last = (now, data)
            return data

    async def page(self, request: Request) -> Response:
        name = request.path_params.get("name", "dashboard.html")
        if name not in STATIC:
            return PlainTextResponse("not found", status_code=404, headers=_COMMON)
        headers = {**_COMMON, "Content-Security-Policy": PAGE_CSP}
        return Response(_static(name), media_type=_TYPES[Path(name).suffix], headers=headers)

    async def api_snapshot(self, request: Request) -> Response:
        return Response(_json(await self.snapshot()), media_type="application/json", headers=_COMMON)

    async def events(self, request: Request) -> Response:
        return StreamingResponse(
            self._stream(request),
            media_type="text/event-stream",
            headers={**_COMMON, "X-Accel-Buffering": "no"},
        )

    async def _stream(self, request: Request) -> AsyncIterator[bytes]:
        """A ``snapshot`` event now and after each change of the directory's files (polled: inotify does not see
        writes through other mounts, and a poll a second is cheap next to a rollout)."""
        seen: Any = None
        sent = 0
        quiet = 0.0
        yield b"retry: 2000\n\n"
        while (self.max_events is None or sent < self.max_events) and not self.closing:
            now = await asyncio.to_thread(fingerprint, self.path)
            if now != seen:
                seen = now
                sent += 1
                quiet = 0.0
                yield b"event: snapshot\ndata: " + _json(await self.snapshot(now)) + b"\n\n"
                continue
            if quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield b": keepalive\n\n"  # a comment: proxies and the browser keep the stream open
            if await request.is_disconnected():
                return
            await asyncio.sleep(self.poll_s)
            quiet += self.poll_s

    async def session(self, request: Request) -> Response:
        """The session's `polar view` page, built now from the store that holds it."""
        from polar_cli.build.inputs import NoTokenizerThere, find_tokenizer
        from polar_cli.build_cmd import session_page

        session_id = request.path_params["session_id"]
        store = self.snapshots.session_stores.get(session_id)
        if store is None:
            await self.snapshot()  # a session newer than the last snapshot (the Snapshotter keeps where each is)
            store = self.snapshots.session_stores.get(session_id)
        if store is None:
            # text/plain with nosniff: the id is shown as it came, never parsed as markup
            return PlainTextResponse(f"no session {session_id!r} in {self.path}", status_code=404, headers=_COMMON)

        def render() -> tuple[str, int, int] | None:
            if store not in self._tokenizers:
                try:
                    self._tokenizers[store] = find_tokenizer(None, store)
                except (NoTokenizerThere, OSError, ValueError):
                    self._tokenizers[store] = (None, "no tokenizer")
            return session_page(store, session_id, self._tokenizers[store][0])

        page = await asyncio.to_thread(render)
        if page is None:
            return PlainTextResponse(f"no calls stored yet for session {session_id}", status_code=404, headers=_COMMON)
        markup = page[0]
        return HTMLResponse(markup, headers={**_COMMON, "Content-Security-Policy": _trace_csp(markup)})


# The names a browser on this machine gives a loopback dashboard: any other Host header is a page that made its own
# name resolve to 127.0.0.1 (DNS rebinding), reading every prompt and output through the victim's browser.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def create_app(
    path: Path, *, poll_s: float = POLL_S, max_events: int | None = None, hosts: Sequence[str] = LOOPBACK_HOSTS
) -> Starlette:
    """The dashboard of ``path`` (a loop, rollout report or store directory), answering only requests whose Host is
    one of ``hosts`` (``*``: any, for a dashboard served beyond loopback on purpose); others get a 400."""
    board = Dashboard(path, poll_s=poll_s, max_events=max_events)
    routes = [
        Route("/", board.page, methods=["GET"]),
        Route("/static/{name}", board.page, methods=["GET"]),
        Route("/api/snapshot", board.api_snapshot, methods=["GET"]),
        Route("/events", board.events, methods=["GET"]),
        Route("/session/{session_id:path}", board.session, methods=["GET"]),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))])
    app.state.dashboard = board
    return app
