"""The body limits (polar_addon.addons.body_limits), with the parked replies and the shared refusals they answer
through, in-process on mitmproxy test flows: every request body polar reads is bounded in size, in time and by its
client's in-flight budget. The agent under training picks every length, framing and host: each limit is checked at
its value and one past it, and every refusal in its exact words."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from mitmproxy import exceptions, http
from mitmproxy.addons.save import Save
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow, tutils
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from polar_addon.addons import BodyLimits, InterceptionScope, ParkedReplies, Shared
from polar_addon.addons.body_limits import client_address
from polar_addon.addons.shared import seconds
from polar_addon.canonical import PolarError
from polar_addon.capture import Identity
from polar_addon.control import MAX_CONTROL_BODY_BYTES, ControlPlane
from polar_addon.gateway import FullReply, Gateway, GatewayConfig
from polar_addon.relay import OVER_BUDGET, STREAM_PREFIX, TOO_LARGE, CountedBody

CAP = 100
RELAY_PORT = 4321
CLIENT = "10.1.2.3"


def make_shared(cap: int = CAP, budget: int = 10_000) -> Shared:
    shared = Shared(gateway=Gateway(None, None, GatewayConfig(max_body_bytes=cap)))  # type: ignore[arg-type]
    shared.budget.limit = budget
    shared.relay.port = RELAY_PORT
    return shared


def make_flow(
    host: str = "api.anthropic.com",
    path: str = "/v1/messages",
    method: str = "POST",
    *,
    length: int | str | None = None,
    chunked: bool = False,
    version: bytes = b"HTTP/1.1",
    content: bytes | None = None,
    mode: str = "regular",
    host_header: str | None = None,
) -> http.HTTPFlow:
    fields = [(b"proxy-authorization", b"Basic eA=="), (b"x-other", b"kept")]
    if length is not None:
        fields.append((b"content-length", str(length).encode()))
    if chunked:
        fields.append((b"transfer-encoding", b"chunked"))
    request = tutils.treq(
        host=host,
        port=443,
        method=method.encode(),
        scheme=b"https",
        path=path.encode(),
        http_version=version,
        headers=http.Headers(fields),
        content=content,
    )
    if host_header is not None:
        request.host_header = host_header
    flow = tflow.tflow(req=request)
    flow.client_conn.peername = (CLIENT, 50000)
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    return flow


def run(scenario: Callable[[], Any]) -> Any:
    """``scenario`` inside a running loop (the body deadline is a loop timer), with polar's options loaded."""

    async def main() -> Any:
        return scenario()

    return asyncio.run(main())


def context(shared: Shared, *extra: object) -> taddons.context:
    return taddons.context(BodyLimits(shared), InterceptionScope(shared), *extra)


def limits_of(tctx: taddons.context) -> BodyLimits:
    return tctx.master.addons.get("bodylimits")


def redirected(flow: http.HTTPFlow) -> bool:
    return (flow.request.host, flow.request.port) == ("127.0.0.1", RELAY_PORT)


# --- options ----------------------------------------------------------------------------------------------------------


def test_the_client_budget_is_polar_client_inflight_mb_in_bytes() -> None:
    shared = Shared()
    assert shared.budget.limit == 0  # until configured
    limits = BodyLimits(shared)
    with taddons.context(limits) as tctx:
        tctx.configure(limits, polar_client_inflight_mb=3)
        assert shared.budget.limit == 3 * 1024 * 1024
        tctx.configure(limits, polar_body_timeout="5")
        assert shared.budget.limit == 3 * 1024 * 1024


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ("soon", "polar: polar_body_timeout must be a number of seconds, got 'soon'"),
        ("0", "polar: polar_body_timeout must be positive, got '0'"),
        ("-1", "polar: polar_body_timeout must be positive, got '-1'"),
    ],
)
def test_a_bad_body_timeout_fails_at_start(raw: str, said: str) -> None:
    limits = BodyLimits(Shared())
    with taddons.context(limits) as tctx:
        with pytest.raises(exceptions.OptionsError) as err:
            tctx.configure(limits, polar_body_timeout=raw)
        assert str(err.value) == said


def test_seconds_reads_a_positive_duration() -> None:
    with taddons.context(BodyLimits(Shared())) as tctx:
        tctx.options.update(polar_body_timeout="0.001")
        assert seconds("polar_body_timeout") == 0.001
        tctx.options.update(polar_body_timeout="2.5")
        assert seconds("polar_body_timeout") == 2.5


# --- which bodies are counted -----------------------------------------------------------------------------------------


def test_a_model_call_declared_within_the_cap_is_read_by_mitmproxy_and_charged_to_its_client() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(length=CAP)
            limits_of(tctx).requestheaders(flow)
            assert not redirected(flow) and flow.request.path == "/v1/messages"
            assert "polar_counted" not in flow.metadata and flow.request.stream is False
            assert shared.budget.held(CLIENT) == CAP
            assert flow.request.headers["content-length"] == str(CAP)

    run(scenario)


def test_a_model_call_declared_one_byte_over_the_cap_is_refused_without_keeping_a_byte() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(length=CAP + 1, host_header="api.anthropic.com")
            limits_of(tctx).requestheaders(flow)
            counted: CountedBody = flow.metadata["polar_counted"]
            assert counted.refused == TOO_LARGE and counted.cap == CAP
            assert shared.budget.held(CLIENT) == 0
            # Pointed at the relay, chunked (its read ends with mitmproxy's end of message), the original kept.
            assert redirected(flow) and flow.request.scheme == "http"
            assert flow.request.path == STREAM_PREFIX + counted.token and len(counted.token) >= 16
            assert "content-length" not in flow.request.headers
            assert flow.request.headers["transfer-encoding"] == "chunked"
            assert flow.request.stream == counted.count
            assert (counted.scheme, counted.host, counted.port, counted.path) == (
                "https",
                "api.anthropic.com",
                443,
                "/v1/messages",
            )
            assert counted.host_header == "api.anthropic.com"

    run(scenario)


def test_a_body_within_the_cap_but_over_the_clients_budget_is_refused_as_over_budget() -> None:
    def scenario() -> None:
        shared = make_shared(budget=150)
        with context(shared) as tctx:
            first, second = make_flow(length=CAP), make_flow(length=51)
            limits_of(tctx).requestheaders(first)
            assert shared.budget.held(CLIENT) == CAP
            limits_of(tctx).requestheaders(second)
            assert second.metadata["polar_counted"].refused == OVER_BUDGET
            assert shared.budget.held(CLIENT) == CAP
            # Exactly the rest of the budget is still granted.
            third = make_flow(length=50)
            limits_of(tctx).requestheaders(third)
            assert "polar_counted" not in third.metadata and shared.budget.held(CLIENT) == 150
            # A body of exactly the cap that the budget cannot take is over budget (429), not too large (413).
            fourth = make_flow(length=CAP)
            limits_of(tctx).requestheaders(fourth)
            assert fourth.metadata["polar_counted"].refused == OVER_BUDGET

    run(scenario)


@pytest.mark.parametrize(
    "flow_of",
    [
        lambda: make_flow(chunked=True),
        lambda: make_flow(version=b"HTTP/2.0"),
        lambda: make_flow(version=b"HTTP/3"),
        lambda: make_flow(length="12abc"),
    ],
    ids=["chunked", "http2", "http3", "not-a-number"],
)
def test_a_body_of_undeclared_length_goes_through_the_counter(flow_of: Callable[[], http.HTTPFlow]) -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = flow_of()
            limits_of(tctx).requestheaders(flow)
            counted: CountedBody = flow.metadata["polar_counted"]
            assert counted.refused is None and redirected(flow)
            # Counted as it arrives: within the cap and the budget it is kept, one byte past the cap it is dropped.
            counted.count(b"x" * CAP)
            assert counted.refused is None and bytes(counted.kept) == b"x" * CAP
            assert shared.budget.held(CLIENT) == CAP
            counted.count(b"y")
            assert counted.refused == TOO_LARGE and counted.kept == bytearray()
            assert shared.budget.held(CLIENT) == 0

    run(scenario)


def test_a_request_without_a_body_is_not_counted() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(method="POST")
            limits_of(tctx).requestheaders(flow)
            assert "polar_counted" not in flow.metadata and "polar_body_deadline" not in flow.metadata
            assert not redirected(flow) and flow.request.stream is False

    run(scenario)


def test_the_control_host_gets_the_control_bodys_cap() -> None:
    def scenario() -> None:
        shared = make_shared(budget=10**6)
        with context(shared) as tctx:
            flow = make_flow("polar.local", "/sessions/s1/reward", length=MAX_CONTROL_BODY_BYTES)
            limits_of(tctx).requestheaders(flow)
            assert "polar_counted" not in flow.metadata
            assert shared.budget.held(CLIENT) == MAX_CONTROL_BODY_BYTES
            flow = make_flow("POLAR.LOCAL.", "/anything", length=MAX_CONTROL_BODY_BYTES + 1)
            limits_of(tctx).requestheaders(flow)
            counted: CountedBody = flow.metadata["polar_counted"]
            assert counted.refused == TOO_LARGE and counted.cap == MAX_CONTROL_BODY_BYTES

    run(scenario)


def test_a_control_path_on_a_model_host_is_counted_against_the_model_cap() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow("api.openai.com", "/sessions/s1/reward", length=CAP + 1)
            limits_of(tctx).requestheaders(flow)
            assert flow.metadata["polar_counted"].cap == CAP

    run(scenario)


def test_other_traffic_streams_through_unbuffered_without_the_proxy_credentials() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            for flow in (
                make_flow("example.com", "/upload", length=10 * CAP),
                make_flow("api.openai.com", "/v1/models", "GET"),  # a model host, no route polar answers
            ):
                limits_of(tctx).requestheaders(flow)
                assert flow.request.stream is True
                assert "proxy-authorization" not in flow.request.headers
                assert flow.request.headers["x-other"] == "kept"
                assert "polar_counted" not in flow.metadata and not redirected(flow)
            assert shared.budget.held(CLIENT) == 0
            # Without proxy credentials there is nothing to remove.
            flow = make_flow("example.com", "/", "GET")
            del flow.request.headers["proxy-authorization"]
            limits_of(tctx).requestheaders(flow)
            assert flow.request.stream is True

    run(scenario)


@pytest.mark.parametrize("block_other", [False, True])
def test_a_responses_websocket_upgrade_keeps_its_proxy_credentials_for_the_capture_addon(block_other: bool) -> None:
    """Codex's WebSocket upgrade is a model call (the capture addon answers it, reading its session from the proxy
    credentials): it is neither streamed upstream nor stripped, whether other traffic is blocked or not."""

    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            tctx.options.update(polar_block_other=block_other)
            flow = make_flow("api.openai.com", "/v1/responses", "GET")
            flow.request.headers["upgrade"] = "websocket"
            limits_of(tctx).requestheaders(flow)
            assert flow.request.headers["proxy-authorization"] == "Basic eA=="
            assert flow.request.stream is False and "polar_counted" not in flow.metadata
            # One with a body has it bounded like any model call's, never streamed upstream.
            flow = make_flow("api.openai.com", "/v1/responses", "GET", length=CAP + 1)
            flow.request.headers["upgrade"] = "websocket"
            limits_of(tctx).requestheaders(flow)
            assert flow.metadata["polar_counted"].refused == TOO_LARGE and redirected(flow)

    run(scenario)


def test_other_traffic_is_dropped_unread_with_polar_block_other_and_left_to_the_scopes_403() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            tctx.options.update(polar_block_other=True)
            flow = make_flow("example.com", "/upload", length=5)
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            counted: CountedBody = flow.metadata["polar_counted"]
            assert counted.cap == 0 and counted.refused == TOO_LARGE and redirected(flow)
            assert flow.request.stream == counted.count
            limits.request(flow)
            assert flow.response is None  # the scope answers it (403), not a 413
            # An empty body is within a cap of 0: nothing to count.
            empty = make_flow("example.com", "/", length=0)
            limits.requestheaders(empty)
            assert "polar_counted" not in empty.metadata and not redirected(empty)

    run(scenario)


def test_a_reverse_listener_counts_every_model_route_whatever_its_host() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow("engine.local", length=CAP + 1, mode="reverse:http://engine.local:8000")
            limits_of(tctx).requestheaders(flow)
            assert flow.metadata["polar_counted"].refused == TOO_LARGE

    run(scenario)


def test_nothing_is_counted_without_a_gateway_or_on_an_answered_flow() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(length=CAP + 1)
            flow.response = http.Response.make(200)
            limits_of(tctx).requestheaders(flow)
            assert "polar_counted" not in flow.metadata and flow.request.stream is False
        idle = Shared()
        with context(idle) as tctx:
            flow = make_flow("example.com", length=CAP + 1)
            limits_of(tctx).requestheaders(flow)
            assert flow.request.stream is False and "proxy-authorization" in flow.request.headers

    run(scenario)


# --- the deadline -----------------------------------------------------------------------------------------------------


def test_a_counted_body_has_until_polar_body_timeout_and_the_deadline_ends_with_it() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            tctx.options.update(polar_body_timeout="7")
            loop = asyncio.get_running_loop()
            flow = make_flow(length=10)
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            deadline: asyncio.TimerHandle = flow.metadata["polar_body_deadline"]
            assert 6.5 < deadline.when() - loop.time() <= 7
            limits.request(flow)
            assert deadline.cancelled() and "polar_body_deadline" not in flow.metadata
            failed = make_flow(length=10)
            limits.requestheaders(failed)
            deadline = failed.metadata["polar_body_deadline"]
            limits.error(failed)
            assert deadline.cancelled() and "polar_body_deadline" not in failed.metadata
            limits.error(make_flow())  # no deadline: nothing to cancel

    run(scenario)


class _Handler:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, why: str) -> None:
        self.cancelled.append(why)


class _Transport:
    def __init__(self, handler: _Handler | None) -> None:
        self.handler = handler


class _Connection:
    def __init__(self, transport: _Transport | None) -> None:
        self.client = object()
        self.transports = {self.client: transport} if transport is not None else {}


class _ProxyServer:
    name = "proxyserver"

    def __init__(self) -> None:
        self.connections: dict[str, _Connection] = {}


def _timer_errors() -> list[dict]:
    """What the loop's timer callbacks raised (asyncio only logs it)."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    return errors


def test_a_late_body_has_its_connection_cut(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        errors = _timer_errors()
        server = _ProxyServer()
        shared = make_shared()
        with context(shared, server) as tctx:
            tctx.options.update(polar_body_timeout="0.01")
            late, gone, closing, unknown = (make_flow(length=10) for _ in range(4))
            handler = _Handler()
            server.connections[late.client_conn.id] = _Connection(_Transport(handler))
            server.connections[closing.client_conn.id] = _Connection(_Transport(None))
            server.connections[gone.client_conn.id] = _Connection(None)
            for flow in (late, gone, closing, unknown):
                limits_of(tctx).requestheaders(flow)
            with caplog.at_level(logging.WARNING, logger="polar"):
                await asyncio.sleep(0.2)
            assert handler.cancelled == ["polar_body_timeout"]
            assert errors == []  # a connection already gone, or closing, is left alone
            said = [r.getMessage() for r in caplog.records if "polar_body_timeout" in r.getMessage()]
            assert said == [
                f"polar: a request body from {(CLIENT, 50000)} was not complete after polar_body_timeout (0.01 s): "
                "connection closed"
            ]

    asyncio.run(scenario())


def test_a_late_body_after_the_proxy_server_is_gone_is_left_alone() -> None:
    async def scenario() -> None:
        errors = _timer_errors()
        shared = make_shared()
        with context(shared) as tctx:
            tctx.options.update(polar_body_timeout="0.01")
            limits_of(tctx).requestheaders(make_flow(length=10))
            await asyncio.sleep(0.1)
            assert errors == []  # no proxyserver addon: the timer must not raise

    asyncio.run(scenario())


# --- the counted flow put back, refused or parked ---------------------------------------------------------------------


def test_a_counted_body_is_put_back_as_the_client_sent_it_and_its_answer_parked() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(chunked=True, host_header="api.anthropic.com:443")
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            counted: CountedBody = flow.metadata["polar_counted"]
            counted.count(b'{"model": "m"}')
            flow.request.data.content = None  # streamed through the counter: mitmproxy kept nothing
            limits.request(flow)
            request = flow.request
            assert (request.scheme, request.host, request.port, request.path) == (
                "https",
                "api.anthropic.com",
                443,
                "/v1/messages",
            )
            assert request.host_header == "api.anthropic.com:443"
            assert request.raw_content == b'{"model": "m"}' and counted.kept == bytearray()
            assert flow.metadata["polar_park"] is True and flow.response is None
            assert request.headers["transfer-encoding"] == "chunked"

    run(scenario)


def test_a_body_mitmproxy_read_itself_is_not_parked() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(length="12abc", content=b"read by mitmproxy")
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            flow.metadata["polar_counted"].kept = bytearray(b"counted")
            limits.request(flow)
            assert flow.request.host == "api.anthropic.com" and flow.request.path == "/v1/messages"
            assert flow.request.raw_content == b"read by mitmproxy"
            assert "polar_park" not in flow.metadata
            plain = make_flow(length=10, content=b"0123456789")
            limits.requestheaders(plain)
            limits.request(plain)
            assert "polar_park" not in plain.metadata and plain.response is None

    run(scenario)


def test_a_body_over_the_cap_is_refused_413_in_its_callers_protocol() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(chunked=True)
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            flow.metadata["polar_counted"].count(b"z" * (CAP + 5))
            flow.request.data.content = None
            limits.request(flow)
            assert flow.response is not None and flow.response.status_code == 413
            assert orjson.loads(flow.response.content) == {
                "type": "error",
                "error": {
                    "type": "request_too_large",
                    "message": f"request body of {CAP + 5} bytes exceeds the proxy limit of {CAP}",
                },
            }
            assert flow.metadata["polar_park"] is True

    run(scenario)


def test_a_body_over_the_budget_is_refused_429_retryable() -> None:
    def scenario() -> None:
        shared = make_shared(budget=50)
        with context(shared) as tctx:
            flow = make_flow("api.openai.com", "/v1/chat/completions", length=60)
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            limits.request(flow)
            assert flow.response is not None and flow.response.status_code == 429
            error = orjson.loads(flow.response.content)["error"]
            assert error["code"] == "overloaded"
            assert error["message"] == (
                "polar: this client already has 50 bytes of request bodies in flight (polar_client_inflight_mb): "
                "retry once its other calls are answered"
            )

    run(scenario)


def test_request_does_nothing_without_a_gateway_or_on_an_answered_flow() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            flow = make_flow(length=CAP + 1)
            limits = limits_of(tctx)
            limits.requestheaders(flow)
            flow.response = http.Response.make(204)
            limits.request(flow)
            assert flow.response.status_code == 204 and redirected(flow)
            shared.gateway = None
            other = make_flow(length=CAP + 1)
            other.metadata["polar_counted"] = flow.metadata["polar_counted"]
            limits.request(other)
            assert other.response is None and "polar_park" not in other.metadata

    run(scenario)


def test_a_flows_end_gives_its_budget_back() -> None:
    def scenario() -> None:
        shared = make_shared()
        with context(shared) as tctx:
            limits = limits_of(tctx)
            answered, failed, cut = make_flow(length=10), make_flow(length=20), make_flow(length=30)
            for flow in (answered, failed, cut):
                limits.requestheaders(flow)
            assert shared.budget.held(CLIENT) == 60
            limits.response(answered)
            assert shared.budget.held(CLIENT) == 50 and shared.heap._released == 10
            limits.error(failed)
            assert shared.budget.held(CLIENT) == 30 and shared.heap._released == 30
            limits.client_disconnected(cut.client_conn)
            assert shared.budget.held(CLIENT) == 0 and shared.heap._released == 60

    run(scenario)


def test_the_client_address_is_its_peer_host() -> None:
    flow = make_flow()
    assert client_address(flow.client_conn) == CLIENT
    flow.client_conn.peername = None
    assert client_address(flow.client_conn) == ""


# --- WebSocket messages -----------------------------------------------------------------------------------------------


def _ws_flow(*sizes: int, from_client: bool = True, injected: bool = False) -> http.HTTPFlow:
    flow = tflow.tflow(ws=True)
    flow.metadata["polar_websocket"] = True
    flow.websocket.messages = [
        WebSocketMessage(Opcode.TEXT, from_client, b"m" * size, 946681203, injected=injected) for size in sizes
    ]
    return flow


def _injections(tctx: taddons.context, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []
    monkeypatch.setattr(tctx.master.commands, "call", lambda *args: calls.append(args))
    return calls


def test_a_websocket_message_over_the_cap_is_dropped_and_refused_in_the_responses_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = make_shared()
    with context(shared) as tctx:
        calls = _injections(tctx, monkeypatch)
        flow = _ws_flow(CAP)
        limits_of(tctx).websocket_message(flow)
        assert calls == [] and not flow.websocket.messages[-1].dropped
        flow.websocket.messages.append(WebSocketMessage(Opcode.TEXT, True, b"m" * (CAP + 1), 946681204))
        limits_of(tctx).websocket_message(flow)
        assert flow.websocket.messages[-1].dropped
        assert len(calls) == 1
        name, target, to_client, event, is_text = calls[0]
        assert (name, target, to_client, is_text) == ("inject.websocket", flow, True, True)
        assert b'"status":413' in event
        assert f"message of {CAP + 1} bytes exceeds the proxy limit of {CAP} bytes".encode() in event


def test_only_the_clients_own_messages_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = make_shared()
    with context(shared) as tctx:
        calls = _injections(tctx, monkeypatch)
        for flow in (_ws_flow(CAP + 1, from_client=False), _ws_flow(CAP + 1, injected=True)):
            limits_of(tctx).websocket_message(flow)
            assert not flow.websocket.messages[-1].dropped
        unmarked = _ws_flow(CAP + 1)
        del unmarked.metadata["polar_websocket"]
        limits_of(tctx).websocket_message(unmarked)
        assert not unmarked.websocket.messages[-1].dropped and len(unmarked.websocket.messages) == 1
        assert calls == []


def test_a_long_websocket_session_keeps_only_its_last_message_unless_flows_are_saved(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    shared = make_shared()
    with context(shared) as tctx:
        _injections(tctx, monkeypatch)
        flow = _ws_flow(1, 2, 3)
        limits_of(tctx).websocket_message(flow)
        assert [len(m.content) for m in flow.websocket.messages] == [3]
    with context(shared, Save()) as tctx:
        _injections(tctx, monkeypatch)
        flow = _ws_flow(1, 2, 3)
        limits_of(tctx).websocket_message(flow)
        assert [len(m.content) for m in flow.websocket.messages] == [3]  # the option exists but is unset
    with context(shared, Save()) as tctx:
        _injections(tctx, monkeypatch)
        tctx.options.update(save_stream_file=str(tmp_path / "flows"))
        flow = _ws_flow(1, 2, 3)
        limits_of(tctx).websocket_message(flow)
        assert [len(m.content) for m in flow.websocket.messages] == [1, 2, 3]


def test_websocket_messages_are_left_alone_without_a_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    with context(Shared()) as tctx:
        calls = _injections(tctx, monkeypatch)
        flow = _ws_flow(1, 10**6)
        limits_of(tctx).websocket_message(flow)
        assert len(flow.websocket.messages) == 2 and calls == []
        flow = tflow.tflow()
        flow.metadata["polar_websocket"] = True
        limits_of(tctx).websocket_message(flow)  # not (yet) a WebSocket: nothing to bound


# --- parked replies ---------------------------------------------------------------------------------------------------


async def _body(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in chunks])


def _parked_flow(shared: Shared) -> tuple[http.HTTPFlow, CountedBody]:
    flow = make_flow(chunked=True)
    with context(shared) as tctx:
        limits_of(tctx).requestheaders(flow)
    flow.metadata["polar_park"] = True
    return flow, flow.metadata["polar_counted"]


def test_the_answer_of_a_counted_flow_is_handed_over_through_the_relay() -> None:
    async def scenario() -> None:
        shared = make_shared()
        flow, counted = _parked_flow(shared)
        flow.response = http.Response.make(418, b'{"a": 1}', {"content-type": "application/x-teapot"})
        ParkedReplies(shared).request(flow)
        assert flow.response is None and "polar_park" not in flow.metadata
        status, content_type, chunks = shared.relay._pending[counted.token]
        assert (status, content_type, await _body(chunks)) == (418, "application/x-teapot", b'{"a": 1}')

        flow, counted = _parked_flow(shared)
        flow.response = http.Response.make(200, b"")  # no content-type
        ParkedReplies(shared).request(flow)
        status, content_type, chunks = shared.relay._pending[counted.token]
        assert (status, content_type, await _body(chunks)) == (200, "application/json", b"")

    asyncio.run(scenario())


def test_a_counted_flow_nobody_answered_gets_a_500() -> None:
    async def scenario() -> None:
        shared = make_shared()
        flow, counted = _parked_flow(shared)
        ParkedReplies(shared).request(flow)
        status, content_type, chunks = shared.relay._pending[counted.token]
        assert (status, content_type) == (500, "application/json")
        assert orjson.loads(await _body(chunks)) == {"error": {"type": "api_error", "message": "polar internal error"}}

    asyncio.run(scenario())


def test_only_a_parked_flow_without_its_own_stream_goes_through_the_relay() -> None:
    async def scenario() -> None:
        shared = make_shared()
        flow, _ = _parked_flow(shared)
        flow.metadata["polar_stream"] = True  # the capture addon parked its stream under the flow's token itself
        flow.response = http.Response.make(200)
        ParkedReplies(shared).request(flow)
        assert flow.response is not None and shared.relay._pending == {} and "polar_park" not in flow.metadata
        flow, _ = _parked_flow(shared)
        del flow.metadata["polar_park"]
        flow.response = http.Response.make(200)
        ParkedReplies(shared).request(flow)
        assert flow.response is not None and shared.relay._pending == {}

    asyncio.run(scenario())


def test_relayed_answers_stream_through() -> None:
    replies = ParkedReplies(make_shared())
    for metadata, streams in (
        ({"polar_stream": True}, True),
        ({"polar_counted": None}, True),
        ({"polar_stream": False}, False),
        ({}, False),
    ):
        flow = tflow.tflow(resp=True)
        flow.metadata.update(metadata)
        replies.responseheaders(flow)
        assert flow.response.stream is streams, metadata


# --- what the addons share --------------------------------------------------------------------------------------------


def test_a_reply_and_a_refusal_answer_the_flow_here() -> None:
    shared = make_shared()
    flow = make_flow()
    shared.reply(flow, FullReply(201, b"done", "text/x-done"))
    assert (flow.response.status_code, flow.response.content, flow.response.headers["content-type"]) == (
        201,
        b"done",
        "text/x-done",
    )
    flow = make_flow("api.openai.com", "/v1/chat/completions")
    shared.refuse(flow, PolarError(403, "authentication", "no"))
    assert flow.response.status_code == 403
    assert flow.response.headers["content-type"] == "application/json"
    assert orjson.loads(flow.response.content)["error"]["message"] == "no"
    flow = make_flow("api.openai.com", "/elsewhere")
    shared.refuse(flow, PolarError(404, "not_found", "gone"))
    assert orjson.loads(flow.response.content) == {"error": {"type": "not_found", "message": "gone"}}


class _Store:
    pass


def test_a_registered_session_that_ended_is_refused_on_its_open_websocket() -> None:
    shared = make_shared()
    shared.still_live(Identity("s1", source="registered"))  # no control plane: nothing ended
    shared.control = ControlPlane(_Store(), "t" * 24)  # type: ignore[arg-type]
    shared.still_live(Identity("s1", source="registered"))
    shared.control.sessions.end("s1")
    with pytest.raises(PolarError) as err:
        shared.still_live(Identity("s1", source="registered"))
    assert (err.value.status, err.value.kind, err.value.message) == (
        403,
        "authentication",
        "polar identity: this session has ended (its final status was posted): its credential is refused",
    )
    shared.still_live(Identity("s1", source="header"))  # a claimed session is not the registry's
    shared.still_live(Identity("s2", source="registered"))


def test_the_websocket_server_reads_the_gateway_and_budget_the_addons_share() -> None:
    shared = Shared()
    assert shared.websockets._gateway() is None
    shared.gateway = make_shared().gateway
    assert shared.websockets._gateway() is shared.gateway
    assert shared.websockets._budget is shared.budget
    shared.control = ControlPlane(_Store(), "t" * 24)  # type: ignore[arg-type]
    shared.control.sessions.end("gone")
    with pytest.raises(PolarError):
        shared.websockets._still_live(Identity("gone", source="registered"))
