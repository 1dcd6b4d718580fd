"""Body limits: every request body polar reads is bounded in size (polar_max_body_mb), in time
(polar_body_timeout) and, with every other body of its client in flight, by the client's budget
(polar_client_inflight_mb); other traffic streams through unbuffered."""

from __future__ import annotations

import asyncio
import functools
import logging

from mitmproxy import ctx, http
from mitmproxy.connection import Client

from polar_addon.addons.scope import host_name, is_ours
from polar_addon.addons.shared import Shared, seconds
from polar_addon.canonical import PolarError
from polar_addon.control import CONTROL_HOST, MAX_CONTROL_BODY_BYTES, is_control_path
from polar_addon.relay import OVER_BUDGET, STREAM_PREFIX, TOO_LARGE, CountedBody
from polar_addon.responses_websocket import is_responses_upgrade, too_large_event

log = logging.getLogger("polar")


def _cut_connection(flow: http.HTTPFlow) -> None:
    """Close the connection of a flow whose request body is late. mitmproxy has no read timeout of its own but a
    10-minute idle one, which a client trickling a byte now and then never reaches; this is what that idle
    timeout does (ConnectionHandler.on_timeout)."""
    server = ctx.master.addons.get("proxyserver")
    handler = server.connections.get(flow.client_conn.id) if server is not None else None
    transport = handler.transports.get(handler.client) if handler is not None else None
    if transport is None or transport.handler is None:
        return  # already gone
    log.warning(
        "polar: a request body from %s was not complete after polar_body_timeout (%s s): connection closed",
        flow.client_conn.peername,
        ctx.options.polar_body_timeout,
    )
    transport.handler.cancel("polar_body_timeout")


def _body_arrived(flow: http.HTTPFlow) -> None:
    deadline: asyncio.TimerHandle | None = flow.metadata.pop("polar_body_deadline", None)
    if deadline is not None:
        deadline.cancel()


def client_address(client: Client) -> str:
    return client.peername[0] if client.peername else ""


class BodyLimits:
    """Counts a body polar reads on its way in (``requestheaders``) and never buffers it past its cap or its
    client's budget; puts a counted flow back as its client sent it (``request``), refusing one over either in its
    caller's protocol; gives the budget back when the flow or its connection ends."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def load(self, loader) -> None:
        loader.add_option(
            "polar_max_body_mb",
            int,
            16,
            "Largest request body accepted, in MiB (a long harness session's "
            "call is a few MiB; a larger one is refused in the caller's protocol, 413).",
        )
        loader.add_option(
            "polar_client_inflight_mb",
            int,
            256,
            "Request-body MiB one client address may have in flight "
            "at once, over all its connections, until each call is answered (sandboxes all arrive from "
            "loopback: for them this is the proxy's total); a call over it is refused in the caller's "
            "protocol, 429, retryable.",
        )
        loader.add_option(
            "polar_body_timeout",
            str,
            "60",
            "Seconds a client has to send a request body polar reads; a "
            "body still incomplete then (a client that stalls or trickles) has its connection closed.",
        )

    def configure(self, updated: set[str]) -> None:
        if "polar_client_inflight_mb" in updated:
            self.shared.budget.limit = ctx.options.polar_client_inflight_mb * 1024 * 1024
        if "polar_body_timeout" in updated:
            seconds("polar_body_timeout")  # a bad value fails at start, not at the first body

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # mitmproxy's own body_size_limit would answer a plain-text 413 before any hook of ours runs, so it
        # is left unset: a body polar answers itself is counted here on its way in and never buffered past
        # polar's limit; other traffic streams through unbuffered.
        gateway = self.shared.gateway
        if gateway is None or flow.response is not None:
            return
        if host_name(flow.request.pretty_host) == CONTROL_HOST:
            self._count_body(flow, MAX_CONTROL_BODY_BYTES)
            return
        # Codex's WebSocket upgrade is a model call too: streamed, its proxy credentials (its session, over plain
        # HTTP) would be stripped before the capture addon reads them.
        if is_ours(flow) and (
            gateway.owns(flow.request.method, flow.request.path)
            or is_control_path(flow.request.path)
            or is_responses_upgrade(flow.request.method, flow.request.path, flow.request.headers)
        ):
            self._count_body(flow, gateway.config.max_body_bytes)
            return
        if ctx.options.polar_block_other:
            self._count_body(flow, 0)  # answered 403 by InterceptionScope.request, the body dropped unread
            return
        flow.request.headers.pop("proxy-authorization", None)  # streamed: headers leave before `request`
        flow.request.stream = True

    def _count_body(self, flow: http.HTTPFlow, cap: int) -> None:
        """A body polar reads is charged to its client's budget until its flow ends, and its connection is closed
        if the body is not complete within polar_body_timeout. One declared within ``cap`` and the budget is read
        by mitmproxy (exactly that length); any other (chunked, undeclared, over ``cap`` or over budget) through a
        counter that keeps it only while it stays within both (CountedBody), the flow pointed at the loopback
        relay, where ParkedReplies parks its answer."""
        request = flow.request
        headers = request.headers
        length = headers.get("content-length")
        if length is None and "transfer-encoding" not in headers and not (request.is_http2 or request.is_http3):
            return  # no body
        loop = asyncio.get_running_loop()
        flow.metadata["polar_body_deadline"] = loop.call_later(seconds("polar_body_timeout"), _cut_connection, flow)
        budget, relay = self.shared.budget, self.shared.relay
        take = functools.partial(budget.take, flow.id, client_address(flow.client_conn), flow.client_conn.id)
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared <= cap and take(declared):
            return
        counted = CountedBody(
            cap=cap,
            token=relay.new_token(),
            scheme=request.scheme,
            host=request.host,
            port=request.port,
            path=request.path,
            host_header=request.host_header,
            take=take,
            drop=functools.partial(budget.release, flow.id),
        )
        if declared is not None:
            counted.refuse(TOO_LARGE if declared > cap else OVER_BUDGET)  # not one byte of it is kept
        flow.metadata["polar_counted"] = counted
        request.stream = counted.count
        # Chunked to the relay: its read ends only with mitmproxy's end of message, sent after `request` ran.
        headers.pop("content-length", None)
        headers["transfer-encoding"] = "chunked"
        request.scheme, request.host, request.port = "http", "127.0.0.1", relay.port
        request.path = STREAM_PREFIX + counted.token

    def request(self, flow: http.HTTPFlow) -> None:
        _body_arrived(flow)
        if self.shared.gateway is None or flow.response is not None:
            return
        if self._restore_counted(flow):
            flow.metadata["polar_park"] = True  # its answer goes back through the relay (ParkedReplies)
        counted: CountedBody | None = flow.metadata.get("polar_counted")
        if counted is not None and counted.refused and counted.cap:  # cap 0: a blocked flow, the scope's 403
            self.shared.refuse(flow, self._refusal(counted))

    @staticmethod
    def _restore_counted(flow: http.HTTPFlow) -> bool:
        """Put a counted flow back as the client sent it; True when its body came through the counter (the
        answer must then be parked at the relay), False when mitmproxy read it (none) or it was not counted."""
        counted: CountedBody | None = flow.metadata.get("polar_counted")
        if counted is None:
            return False
        request = flow.request
        streamed = request.raw_content is None
        request.scheme, request.host, request.port, request.path = (
            counted.scheme,
            counted.host,
            counted.port,
            counted.path,
        )
        request.host_header = counted.host_header
        # The framing headers stay chunked: mitmproxy ends the relay's body by them after this hook.
        if streamed:
            request.data.content = bytes(counted.kept)
            counted.kept = bytearray()  # one copy of the body is enough
        return streamed

    def _refusal(self, counted: CountedBody) -> PolarError:
        """A body over polar_max_body_mb (413) or over its client's in-flight budget (429: retryable, once the
        client's other calls are answered)."""
        if counted.refused == OVER_BUDGET:
            return PolarError(
                429,
                "overloaded",
                f"polar: this client already has {self.shared.budget.limit} bytes of request "
                "bodies in flight (polar_client_inflight_mb): retry once its other calls are answered",
            )
        return PolarError(
            413,
            "request_too_large",
            f"request body of {counted.seen} bytes exceeds the proxy limit of {counted.cap}",
        )

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Codex's Responses WebSocket (pointed at the loopback server by the capture addon): its messages are
        request bodies too. One over polar_max_body_mb is dropped here, never relayed, and refused in the
        Responses protocol (the socket stays open); the budget of the others is charged where they are answered
        (responses_websocket). mitmproxy keeps every message of a flow until it ends: only the last is kept, so a
        long session does not pile up its turns in the proxy, unless flows are being saved (``save_stream_file``:
        the user asked for every message)."""
        gateway, websocket = self.shared.gateway, flow.websocket
        if gateway is None or websocket is None or not flow.metadata.get("polar_websocket"):
            return
        if not ("save_stream_file" in ctx.options and ctx.options.save_stream_file):
            del websocket.messages[:-1]
        message = websocket.messages[-1]
        cap = gateway.config.max_body_bytes
        if message.from_client and not message.injected and len(message.content) > cap:
            message.drop()
            event = too_large_event(gateway, len(message.content))
            ctx.master.commands.call("inject.websocket", flow, True, event, True)

    def response(self, flow: http.HTTPFlow) -> None:
        self.shared.heap.freed(self.shared.budget.release(flow.id))

    def error(self, flow: http.HTTPFlow) -> None:
        _body_arrived(flow)
        self.shared.heap.freed(self.shared.budget.release(flow.id))

    def client_disconnected(self, client: Client) -> None:
        self.shared.heap.freed(self.shared.budget.release_connection(client.id))
