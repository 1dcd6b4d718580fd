"""What polar's addons share, in one object handed to each of them (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mitmproxy import ctx, exceptions, http

from polar_addon.canonical import PolarError
from polar_addon.capture import Identity
from polar_addon.control import ControlPlane
from polar_addon.gateway import FullReply, Gateway
from polar_addon.relay import BodyBudget, HeapTrim, StreamRelay
from polar_addon.responses_websocket import ResponsesWebSocket


@dataclass
class Shared:
    """The gateway and control plane (set by the capture and control addons once their options are read), the
    per-client body budget, the loopback servers replies go back through, and the proxy credentials each client
    connection gave on its CONNECT."""

    gateway: Gateway | None = None
    control: ControlPlane | None = None
    budget: BodyBudget = field(default_factory=lambda: BodyBudget(0))  # its limit set by BodyLimits.configure
    heap: HeapTrim = field(default_factory=HeapTrim)
    relay: StreamRelay = field(default_factory=StreamRelay)
    proxy_auth: dict[str, str] = field(default_factory=dict)  # client connection id -> Proxy-Authorization
    websockets: ResponsesWebSocket = field(init=False)

    def __post_init__(self) -> None:
        self.websockets = ResponsesWebSocket(lambda: self.gateway, self.still_live, self.budget)

    def still_live(self, ident: Identity) -> None:
        """Refuses (PolarError) a registered session that has ended since its WebSocket opened."""
        if ident.source == "registered" and self.control is not None and self.control.sessions.ended(ident.session_id):
            raise PolarError(
                403,
                "authentication",
                "polar identity: this session has ended (its final status was posted): its credential is refused",
            )

    def reply(self, flow: http.HTTPFlow, reply: FullReply) -> None:
        """Answer ``flow`` here with a finished reply (never forwarded)."""
        flow.response = http.Response.make(reply.status, reply.body, {"content-type": reply.content_type})

    def refuse(self, flow: http.HTTPFlow, err: PolarError) -> None:
        """Answer ``flow`` with ``err`` in the protocol of the route it was sent to."""
        assert self.gateway is not None
        self.reply(flow, self.gateway.error_reply(flow.request.method, flow.request.path, err))


def seconds(name: str) -> float:
    # mitmproxy options have no float type: durations are strings parsed here.
    raw = getattr(ctx.options, name)
    try:
        value = float(raw)
    except ValueError:
        raise exceptions.OptionsError(f"polar: {name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise exceptions.OptionsError(f"polar: {name} must be positive, got {raw!r}")
    return value
