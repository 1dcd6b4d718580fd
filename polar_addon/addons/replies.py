"""Parked replies: a flow whose body came through the counter (BodyLimits) already points at the loopback relay,
so whatever answered it (the gateway, the control plane, a refusal) is handed to the client from there; and a flow
pointed at the relay streams its answer through as it is written."""

from __future__ import annotations

from mitmproxy import http

from polar_addon.addons.shared import Shared
from polar_addon.relay import CountedBody, one_chunk


class ParkedReplies:
    """Last of polar's addons: its ``request`` runs once every other one has answered."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def request(self, flow: http.HTTPFlow) -> None:
        if not flow.metadata.pop("polar_park", False) or flow.metadata.get("polar_stream"):
            return  # not counted through the relay, or the capture addon parked its stream under the flow's token
        counted: CountedBody = flow.metadata["polar_counted"]
        response = flow.response
        if response is None:
            response = http.Response.make(
                500,
                b'{"error":{"type":"api_error","message":"polar internal error"}}',
                {"content-type": "application/json"},
            )
        flow.response = None  # the relay's answer is the one the client gets
        self.shared.relay.park(
            response.status_code,
            response.headers.get("content-type", "application/json"),
            one_chunk(response.raw_content or b""),
            token=counted.token,
        )

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("polar_stream") or "polar_counted" in flow.metadata:
            flow.response.stream = True
