"""Codex's Responses WebSocket (``wss://api.openai.com/v1/responses``), answered by the gateway.

Codex's built-in OpenAI provider opens ``GET /v1/responses`` with ``Upgrade: websocket`` and then,
per turn, sends one text message ``{"type": "response.create", ...Responses request body...}``
(Codex 0.171: ``stream: true``, ``store: false``; the first message of a thread may be a prewarm
with ``"generate": false``; later turns send only the new items with ``previous_response_id``).
The answer is the same event sequence as the SSE stream, one JSON event per text message, ending
with ``response.completed`` (or ``response.failed``); errors before a stream starts are sent as
``{"type": "error", "status": N, "error": {...}}``, which Codex reads as that HTTP status.

mitmproxy cannot complete a WebSocket upgrade itself, so the addon points the upgrade request at
this loopback aiohttp server (one-time token in the path, the caller's identity parked under it).
Each ``response.create`` goes through :meth:`Gateway.handle` as a streaming ``POST /v1/responses``,
so it is recorded exactly like the HTTP path; the SSE bytes it returns are cut back into events.

Bounds: a message is a request body like any other. One over polar_max_body_mb is refused (an ``error`` event,
status 413) before it reaches the gateway, and each message is charged to its client's in-flight budget
(``relay.BodyBudget``, polar_client_inflight_mb, shared with the HTTP path) from its arrival until its answer
ends: one over the budget is refused with status 429 (retryable). Either refusal leaves the socket open and what
it wrote before recorded.

Identity: the upgrade request is resolved (and, in ``registered`` mode, checked against the registry) by the
addon like any HTTP call before it is parked; since a socket outlives a turn, every message is checked again
(``still_live``): once the session's final status is posted, its open socket writes nothing more.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from polar_addon.canonical import PolarError
from polar_addon.capture import Identity
from polar_addon.gateway import FullReply, Gateway, IncomingCall
from polar_addon.providers import ResponseContext, Route
from polar_addon.providers.openai_responses import OpenAIResponsesProvider, response_object
from polar_addon.relay import BodyBudget

log = logging.getLogger("polar")

WEBSOCKET_PREFIX = "/_polar/responses-ws/"
RESPONSES_PATH = "/v1/responses"
# An upgrade whose redirected connection never arrives (client gone) is forgotten after this long.
PARK_SECONDS = 60.0


def is_responses_upgrade(method: str, path: str, headers: Mapping[str, str]) -> bool:
    """A WebSocket upgrade on a Responses path (``headers`` looked up by lower-case name)."""
    return (
        method.upper() == "GET"
        and path.split("?", 1)[0].rstrip("/").endswith("/responses")
        and headers.get("upgrade", "").lower() == "websocket"
    )


def sse_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events in ``buffer`` as their ``data`` payloads, and the unfinished rest.

    Comments and keep-alive blank lines carry no data and yield nothing."""
    events: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return events, buffer
        frame, buffer = buffer[:end], buffer[end + 2 :]
        data = [line[5:].removeprefix(b" ") for line in frame.split(b"\n") if line.startswith(b"data:")]
        if data:
            events.append(b"\n".join(data))


def error_event(status: int, body: Any) -> bytes:
    """The wrapped error Codex's WebSocket client maps back to an HTTP status."""
    error = body.get("error") if isinstance(body, dict) else None
    return orjson.dumps({"type": "error", "status": status, "error": error or {"message": str(body)}})


def refusal_event(gateway: Gateway, err: PolarError) -> bytes:
    """``err`` as the HTTP path renders it on ``POST /v1/responses``, wrapped as an error event."""
    reply = gateway.error_reply("POST", RESPONSES_PATH, err)
    return error_event(reply.status, orjson.loads(reply.body))


def too_large_event(gateway: Gateway, size: int) -> bytes:
    """A message over polar_max_body_mb, refused as the HTTP path refuses such a body (413)."""
    limit = gateway.config.max_body_bytes
    message = f"message of {size} bytes exceeds the proxy limit of {limit} bytes (polar_max_body_mb)"
    return refusal_event(gateway, PolarError(413, "request_too_large", message))


def over_budget_event(gateway: Gateway, limit: int) -> bytes:
    """A message over its client's in-flight budget: retryable once the client's other calls are answered."""
    message = (
        f"polar: this client already has {limit} bytes of request bodies in flight (polar_client_inflight_mb): "
        "retry once its other calls are answered"
    )
    return refusal_event(gateway, PolarError(429, "overloaded", message))


class _WebSocket(web.WebSocketResponse):
    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        # aiohttp closes with 1009 as soon as a message passes max_msg_size; the client first gets an
        # error event saying why, as the HTTP path would answer 413.
        if code == WSCloseCode.MESSAGE_TOO_BIG and not self.closed:
            try:
                await self.send_str(
                    error_event(
                        413,
                        {
                            "error": {
                                "type": "invalid_request_error",
                                "message": "message exceeds the proxy's body limit (polar_max_body_mb)",
                            }
                        },
                    ).decode()
                )
            except (ConnectionError, RuntimeError):
                pass
        return await super().close(code=code, message=message, drain=drain)


@dataclass
class _Parked:
    identity: Identity
    headers: dict[str, str]
    host: str
    client: str  # the client's address and connection id: whose budget its messages are charged to
    connection: str
    expires: float


class ResponsesWebSocket:
    """The loopback WebSocket server; ``gateway`` is read per call (the addon creates it late)."""

    def __init__(
        self,
        gateway: Callable[[], Gateway | None],
        still_live: Callable[[Identity], None],
        budget: BodyBudget,
    ) -> None:
        self._gateway = gateway
        self._still_live = still_live  # raises PolarError when the identity may write no more calls
        self._budget = budget  # the HTTP path's per-client budget (BodyLimits)
        self._parked: dict[str, _Parked] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(WEBSOCKET_PREFIX + "{token}", self._serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def park(self, identity: Identity, headers: dict[str, str], host: str, client: str, connection: str) -> str:
        """Token for one redirected upgrade; ``headers`` lower-case, secrets already removed; ``client`` and
        ``connection``: the mitmproxy client's address and connection id."""
        now = time.monotonic()
        for token in [t for t, p in self._parked.items() if p.expires < now]:
            del self._parked[token]
        token = secrets.token_urlsafe(16)
        self._parked[token] = _Parked(identity, headers, host, client, connection, now + PARK_SECONDS)
        return WEBSOCKET_PREFIX + token

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        parked = self._parked.pop(request.match_info["token"], None)
        gateway = self._gateway()
        if parked is None or gateway is None:
            raise web.HTTPNotFound(text="unknown or already used polar websocket token")
        # Messages get the HTTP path's body limit; one over it is answered with an error event (then the
        # socket closes: aiohttp stops reading it) instead of a bare close 1009. aiohttp refuses a frame of
        # max_msg_size bytes itself: + 1, so that one of exactly the limit is read, as the HTTP path reads it.
        ws = _WebSocket(autoping=True, max_msg_size=gateway.config.max_body_bytes + 1)
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                try:
                    await self._charged(ws, gateway, parked, message.data)
                except ConnectionResetError:
                    log.info("polar: responses websocket closed by the client during an answer")
                    break
                except Exception as exc:
                    # Never a silent close: the client gets an error event it maps to a status (issue 11).
                    log.exception("polar: responses websocket message failed")
                    if ws.closed:
                        break
                    await ws.send_str(
                        error_event(
                            500,
                            {
                                "error": {
                                    "type": "server_error",
                                    "message": f"polar internal error ({type(exc).__name__})",
                                }
                            },
                        ).decode()
                    )
            elif message.type == WSMsgType.BINARY:
                await ws.send_bytes(
                    error_event(
                        400,
                        {"error": {"type": "invalid_request_error", "message": "binary messages are not supported"}},
                    )
                )
            elif message.type == WSMsgType.ERROR:
                log.warning("polar: responses websocket error: %s", ws.exception())
        return ws

    async def _charged(self, ws: web.WebSocketResponse, gateway: Gateway, parked: _Parked, text: str) -> None:
        """Answer one message while its bytes are charged to its client's budget; refuse it if they do not fit."""
        charge = "ws:" + secrets.token_urlsafe(8)
        # Characters: a lower bound of its bytes, without encoding a copy of a message of megabytes.
        if not self._budget.take(charge, parked.client, parked.connection, len(text)):
            await ws.send_str(over_budget_event(gateway, self._budget.limit).decode())
            return
        try:
            await self._answer(ws, gateway, parked, text)
        finally:
            self._budget.release(charge)

    async def _answer(self, ws: web.WebSocketResponse, gateway: Gateway, parked: _Parked, text: str) -> None:
        if len(text) > gateway.config.max_body_bytes:  # characters; aiohttp already bounded the bytes
            await ws.send_str(too_large_event(gateway, len(text)).decode())
            return
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            await ws.send_str(
                error_event(
                    400, {"error": {"type": "invalid_request_error", "message": f"message is not JSON: {exc}"}}
                ).decode()
            )
            return
        if not isinstance(body, dict) or body.get("type") != "response.create":
            kind = body.get("type") if isinstance(body, dict) else type(body).__name__
            await ws.send_str(
                error_event(
                    400,
                    {
                        "error": {
                            "type": "invalid_request_error",
                            "message": f"unsupported message type {kind!r}; send response.create",
                        }
                    },
                ).decode()
            )
            return
        try:
            self._still_live(parked.identity)
        except PolarError as err:
            await ws.send_str(
                error_event(err.status, {"error": {"type": "authentication_error", "message": err.message}}).decode()
            )
            return
        body = {k: v for k, v in body.items() if k != "type"}
        if body.get("generate") is False:
            for event in self._prewarm(gateway, body, parked.identity.session_id, len(text)):
                await ws.send_str(event.decode())
            return
        body["stream"] = True
        call = IncomingCall(
            method="POST",
            path=RESPONSES_PATH,
            headers=parked.headers,
            body=orjson.dumps(body),
            identity=parked.identity,
            host=parked.host,
            started_at=time.time(),
        )
        reply = await gateway.handle(call)
        if isinstance(reply, FullReply):
            if reply.status != 200 or reply.content_type != "text/event-stream":
                await ws.send_str(error_event(reply.status, orjson.loads(reply.body)).decode())
                return
            events, _ = sse_events(reply.body)
            for event in events:
                await ws.send_str(event.decode())
            return
        buffer = b""
        try:
            async for chunk in reply.chunks:
                events, buffer = sse_events(buffer + chunk)
                for event in events:
                    await ws.send_str(event.decode())
        except ConnectionResetError:
            # The client went away mid-answer; the call itself is recorded by the gateway regardless.
            log.info("polar: responses websocket closed by the client during an answer")
        finally:
            aclose = getattr(reply.chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _prewarm(self, gateway: Gateway, body: dict[str, Any], session: str, size: int) -> list[bytes]:
        """``generate: false``: Codex warms the connection with its instructions and tools. Nothing
        is generated (so nothing is recorded); the empty response is remembered so that a later
        turn may continue from it."""
        provider = next((p for p in gateway.providers if isinstance(p, OpenAIResponsesProvider)), None)
        if provider is None:
            return [
                error_event(
                    404, {"error": {"type": "invalid_request_error", "message": "no OpenAI Responses provider"}}
                )
            ]
        try:
            request = provider.parse_request(body, Route(kind="generate", session=session, body_bytes=size))
        except PolarError as err:
            return [error_event(err.status, provider.render_error(err))]
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as exc:
            err = PolarError(400, "invalid_request", f"request could not be read ({type(exc).__name__})")
            return [error_event(err.status, provider.render_error(err))]
        ctx = ResponseContext(
            response_id="resp_" + secrets.token_hex(12), created=int(time.time()), model=request.model
        )
        provider.remember(request, ctx.response_id, [], prewarm=True)
        done = response_object(request, ctx, "completed")
        done["usage"] = {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        }
        return [
            orjson.dumps(
                {
                    "type": "response.created",
                    "sequence_number": 0,
                    "response": response_object(request, ctx, "in_progress"),
                }
            ),
            orjson.dumps({"type": "response.completed", "sequence_number": 1, "response": done}),
        ]
