"""The capture addon (polar_addon.addons.capture), in-process on mitmproxy test flows: the gateway built from its
options (and the refusals of bad ones at start), and how a model call reaches the gateway: its identity, the secrets
kept out of its record, and its answer handed back finished, streamed through the relay or, for Codex's WebSocket,
through the loopback WebSocket server. A model call must never continue upstream: an unexpected error is answered
here too."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from mitmproxy import exceptions, http
from mitmproxy.test import taddons, tflow, tutils

from polar_addon.addons import BodyLimits, Capture, ControlPlaneAddon, InterceptionScope, Shared
from polar_addon.addons import capture as capture_module
from polar_addon.addons.capture import engine_settings, gateway_config, sampling_defaults, start_banner
from polar_addon.canonical import PolarError, SamplingDefaults
from polar_addon.control import ControlPlane
from polar_addon.engines.sglang import SGLangEngine
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall, StreamReply
from polar_addon.identity import registration
from polar_addon.relay import STREAM_PREFIX
from polar_addon.responses_websocket import WEBSOCKET_PREFIX

ENGINE = "sglang:http://127.0.0.1:9"


def basic(user: str, password: str = "") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards and tokens of the default polar_out ("shards", relative) land in the test's directory."""
    monkeypatch.chdir(tmp_path)


def addons(shared: Shared) -> tuple[object, ...]:
    # In hook order, as mitmdump loads them: adding an addon sends its options' first values to those before it.
    return BodyLimits(shared), InterceptionScope(shared), Capture(shared), ControlPlaneAddon(shared)


def capture_of(tctx: taddons.context) -> Capture:
    return tctx.master.addons.get("capture")


# --- the options read at start ----------------------------------------------------------------------------------------


def test_the_banner_says_the_engine_the_output_and_where_each_listener_is() -> None:
    store = SimpleNamespace(uri="/data/out", journal_root="/data/out/.journal")
    assert start_banner("sglang:http://e", store, [], "", None) == (  # type: ignore[arg-type]
        "engine sglang:http://e; output /data/out (journal /data/out/.journal); listening: regular on *:8080"
    )
    modes = ["regular@9000", "reverse:http://x:1@9001", "socks5", "reverse:http://user@host", "reverse:http://u@h@9002"]
    assert start_banner("e", store, modes, "127.0.0.1", 8081) == (  # type: ignore[arg-type]
        "engine e; output /data/out (journal /data/out/.journal); listening: regular on 127.0.0.1:9000, "
        "reverse:http://x:1 on 127.0.0.1:9001, socks5 on 127.0.0.1:8081, reverse:http://user@host on 127.0.0.1:8081, "
        "reverse:http://u@h on 127.0.0.1:9002"
    )


def test_the_gateway_config_is_read_from_the_options() -> None:
    shared = Shared()
    with taddons.context(*addons(shared)) as tctx:
        opts = tctx.options
        for name, value in {
            "polar_keepalive": "2.5",
            "polar_max_body_mb": 3,
            "polar_max_tokens": 77,
            "polar_tito": "OFF",
            "polar_temperature": "0.7",
            "polar_top_p": "0.9",
            "polar_top_k": 5,
            "polar_min_p": "0.05",
            "polar_sampling": "fixed",
        }.items():
            opts._options[name].set(value)  # the values alone: no configure (no engine here)
        assert gateway_config() == GatewayConfig(
            keepalive_s=2.5,
            max_body_bytes=3 * 1024 * 1024,
            max_tokens_cap=77,
            sampling_defaults=SamplingDefaults(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05),
            sampling_fixed=True,
            tito="off",
        )
        opts._options["polar_sampling"].set("client")
        assert gateway_config().sampling_fixed is False


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        (
            "polar_temperature",
            "hot",
            "polar: sampling defaults (polar_temperature, polar_top_p, polar_top_k, polar_min_p): "
            "could not convert string to float: 'hot'",
        ),
        (
            "polar_top_p",
            "1.5",
            "polar: sampling defaults (polar_temperature, polar_top_p, polar_top_k, polar_min_p): "
            "default top_p must be in (0, 1], got 1.5",
        ),
        (
            "polar_min_p",
            "-0.1",
            "polar: sampling defaults (polar_temperature, polar_top_p, polar_top_k, polar_min_p): "
            "default min_p must be in [0, 1], got -0.1",
        ),
        ("polar_tito", "maybe", "polar: polar_tito must be auto, on or off, not 'maybe'"),
        ("polar_keepalive", "0", "polar: polar_keepalive must be positive, got '0'"),
    ],
)
def test_a_bad_sampling_or_continuity_option_fails_at_start(name: str, value: str, said: str) -> None:
    shared = Shared()
    with taddons.context(*addons(shared)) as tctx:
        tctx.options._options[name].set(value)
        with pytest.raises(exceptions.OptionsError) as err:
            gateway_config()
        assert str(err.value) == said


def test_sampling_defaults_take_each_option() -> None:
    with taddons.context(*addons(Shared())) as tctx:
        for name, value in {
            "polar_temperature": "0.3",
            "polar_top_p": "0.8",
            "polar_top_k": 7,
            "polar_min_p": "0.1",
        }.items():
            tctx.options._options[name].set(value)
        assert sampling_defaults() == SamplingDefaults(temperature=0.3, top_p=0.8, top_k=7, min_p=0.1)


def test_engine_settings_are_the_tool_parser_and_the_tokenizer() -> None:
    with taddons.context(*addons(Shared())) as tctx:
        settings = engine_settings()
        assert settings.tokenizer_dir is None and settings.tool_parsers.name_for("m") == "hermes"
        tctx.options._options["polar_tool_parser"].set("m=qwen25,qwen3_coder")
        tctx.options._options["polar_tokenizer"].set("/models/tok")
        settings = engine_settings()
        assert settings.tokenizer_dir == "/models/tok"
        assert (settings.tool_parsers.name_for("m"), settings.tool_parsers.name_for("other")) == (
            "qwen25",
            "qwen3_coder",
        )
        tctx.options._options["polar_tool_parser"].set("nosuch")
        with pytest.raises(exceptions.OptionsError) as err:
            engine_settings()
        assert str(err.value).startswith("polar: polar_tool_parser: ") and "nosuch" in str(err.value)


# --- the gateway built ------------------------------------------------------------------------------------------------


def _close(shared: Shared) -> None:
    if shared.gateway is not None:
        asyncio.run(shared.gateway.close())


def test_the_gateway_is_built_once_from_the_engine_output_and_shard_options(tmp_path: Path) -> None:
    shared = Shared()
    try:
        with taddons.context(*addons(shared)) as tctx:
            tctx.configure(
                capture_of(tctx),
                polar_engine=ENGINE + ",vllm:http://127.0.0.1:10",
                polar_out=str(tmp_path / "out"),
                polar_engine_timeout="12",
                polar_shard_records=3,
                polar_shard_seconds="4",
                polar_durability="write",
                polar_tokenizer="/models/tok",
                polar_max_body_mb=2,
            )
            gateway = shared.gateway
            assert gateway is not None
            assert [e.name for e in gateway.pool.engines] == [ENGINE, "vllm:http://127.0.0.1:10"]
            assert [e.timeout_s for e in gateway.pool.engines] == [12.0, 12.0]
            assert [e.tokenizer_dir for e in gateway.pool.engines] == ["/models/tok", "/models/tok"]
            store = gateway.store
            assert (store.uri, store.shard_max_records, store.shard_max_seconds, store.durability) == (
                str(tmp_path / "out"),
                3,
                4.0,
                "write",
            )
            assert gateway.config.max_body_bytes == 2 * 1024 * 1024
            # Options read per call change the running gateway; the engines take their settings again.
            tctx.configure(capture_of(tctx), polar_max_tokens=9, polar_tokenizer="/models/other")
            assert shared.gateway is gateway and gateway.config.max_tokens_cap == 9
            assert [e.tokenizer_dir for e in gateway.pool.engines] == ["/models/other", "/models/other"]
            # Others were read once: changing one now is refused, and the gateway kept.
            for change in ({"polar_engine": "sglang:http://127.0.0.1:11"}, {"polar_shard_records": 4}):
                with pytest.raises(exceptions.OptionsError) as err:
                    tctx.configure(capture_of(tctx), **change)
                assert str(err.value) == (
                    "polar: engine and output options cannot change while running; restart mitmdump"
                )
            assert shared.gateway is gateway
    finally:
        _close(shared)


def test_a_proxy_without_an_engine_fails_at_start_once_an_option_of_the_gateway_is_set() -> None:
    shared = Shared()
    with taddons.context(*addons(shared)) as tctx:
        tctx.configure(capture_of(tctx), polar_hosts=["x"])  # not the gateway's: nothing to build
        assert shared.gateway is None
        with pytest.raises(exceptions.OptionsError) as err:
            tctx.configure(capture_of(tctx), polar_max_tokens=5)
        assert str(err.value) == "polar: set --set polar_engine=sglang:URL|vllm:URL|local:MODEL_DIR"


def test_a_bad_engine_spec_or_an_engine_that_cannot_load_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = Shared()
    with taddons.context(*addons(shared)) as tctx:
        capture = capture_of(tctx)
        # Set without configure: mitmproxy's rollback of a refused value would configure the empty engine again.
        tctx.options._options["polar_engine"].set("gpu:http://x")
        with pytest.raises(exceptions.OptionsError) as err:
            capture.configure({"polar_engine"})
        assert str(err.value).startswith("polar: unknown engine kind 'gpu'")

        class Broken(SGLangEngine):
            def load(self) -> None:
                raise PolarError(500, "api_error", "no model at /nowhere")

        monkeypatch.setattr(
            capture_module.EnginePool, "from_spec", classmethod(lambda cls, spec, timeout_s: cls([Broken("http://x")]))
        )
        tctx.options._options["polar_engine"].set(ENGINE)
        with pytest.raises(exceptions.OptionsError) as err:
            capture.configure({"polar_engine"})
        assert str(err.value) == "polar: no model at /nowhere"
        assert shared.gateway is None


class _RenderingEngine(SGLangEngine):
    """An engine that samples only after rendered messages (no token input)."""

    complete_tokens = None  # type: ignore[assignment]


def test_polar_tito_on_names_each_engine_without_token_input(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    engines = [SGLangEngine("http://a"), _RenderingEngine("http://b")]
    monkeypatch.setattr(capture_module.EnginePool, "from_spec", classmethod(lambda cls, spec, timeout_s: cls(engines)))
    said = "polar: polar_tito=on, but engine sglang:http://b takes no token input: its calls are rendered in full"
    for tito, warned in (("on", [said]), ("auto", [])):
        shared = Shared()
        try:
            with taddons.context(*addons(shared)) as tctx:
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="polar"):
                    tctx.configure(capture_of(tctx), polar_engine=ENGINE, polar_tito=tito, polar_out=str(tmp_path))
                assert [m for m in caplog.messages if "polar_tito" in m] == warned
        finally:
            _close(shared)


# --- a model call reaching the gateway --------------------------------------------------------------------------------


class _Gateway(Gateway):
    """The real routes and error shapes; ``handle`` answers what the test says and keeps the call."""

    def __init__(self, reply: Any = None) -> None:
        super().__init__(None, None, GatewayConfig())  # type: ignore[arg-type]
        self.calls: list[IncomingCall] = []
        self.reply = reply or FullReply(200, b'{"ok": true}', "application/json")

    async def handle(self, call: IncomingCall) -> Any:
        self.calls.append(call)
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


def make_flow(
    host: str = "api.anthropic.com",
    path: str = "/v1/messages",
    method: str = "POST",
    *,
    headers: dict[str, str] | None = None,
    content: bytes | None = b'{"model": "m"}',
) -> http.HTTPFlow:
    request = tutils.treq(
        host=host,
        port=443,
        method=method.encode(),
        scheme=b"https",
        path=path.encode(),
        headers=http.Headers([(k.encode(), v.encode()) for k, v in (headers or {}).items()]),
        content=content,
        timestamp_start=1234.5,
    )
    flow = tflow.tflow(req=request)
    flow.client_conn.peername = ("10.9.8.7", 40000)
    return flow


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def answer(shared: Shared, flow: http.HTTPFlow, loop: asyncio.AbstractEventLoop, mode: str = "claimed") -> None:
    async def main() -> None:
        with taddons.context(*addons(shared)) as tctx:
            tctx.options._options["polar_sessions"].set(mode)
            await capture_of(tctx).request(flow)

    loop.run_until_complete(main())


def test_a_model_call_reaches_the_gateway_without_its_secrets_and_its_answer_comes_back(
    loop: asyncio.AbstractEventLoop,
) -> None:
    gateway = _Gateway(FullReply(201, b'{"id": "msg_1"}', "application/x-json"))
    shared = Shared(gateway=gateway)
    secrets = {
        "Authorization": "Bearer polar:session=s1",
        "X-Api-Key": "sk-real",
        "x-goog-api-key": "g-real",
        "Proxy-Authorization": basic("from-header"),
        "Cookie": "c=1",
    }
    flow = make_flow("API.Anthropic.com", headers={**secrets, "User-Agent": "claude-cli/2", "X-Polar-Task": "t"})
    answer(shared, flow, loop)
    [call] = gateway.calls
    assert call.headers == {"user-agent": "claude-cli/2", "x-polar-task": "t"}
    assert (call.method, call.path, call.body, call.host, call.started_at) == (
        "POST",
        "/v1/messages",
        b'{"model": "m"}',
        "API.Anthropic.com",
        1234.5,
    )
    # The proxy credentials on the request win over any other claim.
    assert (call.identity.session_id, call.identity.source) == ("from-header", "proxy_auth")
    assert flow.response is not None
    assert (flow.response.status_code, flow.response.content, flow.response.headers["content-type"]) == (
        201,
        b'{"id": "msg_1"}',
        "application/x-json",
    )


def test_the_credentials_a_connection_gave_on_its_connect_name_its_calls(loop: asyncio.AbstractEventLoop) -> None:
    gateway = _Gateway()
    shared = Shared(gateway=gateway)
    capture = Capture(shared)
    connect = make_flow(method="CONNECT", headers={"proxy-authorization": basic("from-connect")})
    capture.http_connect(connect)
    assert shared.proxy_auth == {connect.client_conn.id: basic("from-connect")}
    flow = make_flow(content=None)
    flow.client_conn = connect.client_conn
    answer(shared, flow, loop)
    assert gateway.calls[0].identity.session_id == "from-connect" and gateway.calls[0].body == b""
    capture.client_disconnected(connect.client_conn)
    assert shared.proxy_auth == {}
    capture.client_disconnected(connect.client_conn)  # twice: nothing left to forget
    # A refused CONNECT, or one without credentials, leaves nothing behind.
    refused = make_flow(method="CONNECT", headers={"proxy-authorization": basic("x")})
    refused.response = http.Response.make(403)
    capture.http_connect(refused)
    capture.http_connect(make_flow(method="CONNECT"))
    assert shared.proxy_auth == {}


def test_a_call_without_any_claim_gets_a_session_of_its_connection(loop: asyncio.AbstractEventLoop) -> None:
    gateway = _Gateway()
    flow = make_flow()
    answer(Shared(gateway=gateway), flow, loop)
    identity = gateway.calls[0].identity
    assert (identity.session_id, identity.source) == (f"anon-{flow.client_conn.id[:12]}", "generated")


def test_a_registered_proxy_refuses_a_claim_in_the_callers_protocol(loop: asyncio.AbstractEventLoop) -> None:
    gateway = _Gateway()
    shared = Shared(gateway=gateway)
    flow = make_flow("api.openai.com", "/v1/chat/completions", headers={"authorization": "Bearer polar:session=s1"})
    answer(shared, flow, loop, mode="registered")
    assert gateway.calls == []
    assert flow.response is not None and flow.response.status_code == 403
    assert "claimed identities are refused" in orjson.loads(flow.response.content)["error"]["message"]


def test_a_registered_proxy_takes_the_identity_from_the_control_planes_registry(
    loop: asyncio.AbstractEventLoop,
) -> None:
    gateway = _Gateway()
    shared = Shared(gateway=gateway, control=ControlPlane(None, "t" * 24))  # type: ignore[arg-type]
    secret = shared.control.sessions.register(registration("s9", "task-1", None, None))
    flow = make_flow(headers={"x-api-key": f"polar:{secret}"})
    answer(shared, flow, loop, mode="registered")
    identity = gateway.calls[0].identity
    assert (identity.session_id, identity.task_id, identity.source) == ("s9", "task-1", "registered")


def test_a_streamed_answer_is_parked_at_the_relay_and_the_flow_pointed_there(loop: asyncio.AbstractEventLoop) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    stream = chunks()
    gateway = _Gateway(StreamReply(200, stream, "text/event-stream"))
    shared = Shared(gateway=gateway)
    shared.relay.port = 5555
    flow = make_flow()
    answer(shared, flow, loop)
    request = flow.request
    token = request.path.removeprefix(STREAM_PREFIX)
    assert request.path.startswith(STREAM_PREFIX) and token
    assert (request.scheme, request.host, request.port) == ("http", "127.0.0.1", 5555)
    assert request.data.method == b"GET"  # as sent: the relay's HTTP parser takes no lower-case method
    assert request.content == b"" and flow.metadata["polar_stream"] is True and flow.response is None
    assert shared.relay._pending[token] == (200, "text/event-stream", stream)


def test_a_counted_flows_stream_is_parked_under_its_own_token(loop: asyncio.AbstractEventLoop) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b""

    gateway = _Gateway(StreamReply(200, chunks()))
    shared = Shared(gateway=gateway)
    flow = make_flow()
    flow.metadata["polar_counted"] = SimpleNamespace(token="tok-of-the-body")
    answer(shared, flow, loop)
    assert flow.request.path == STREAM_PREFIX + "tok-of-the-body"
    assert list(shared.relay._pending) == ["tok-of-the-body"]


def test_codexs_websocket_upgrade_is_pointed_at_the_loopback_websocket_server(loop: asyncio.AbstractEventLoop) -> None:
    gateway = _Gateway()
    shared = Shared(gateway=gateway)
    shared.websockets.port = 6666
    flow = make_flow(
        "api.openai.com",
        "/v1/responses",
        "GET",
        headers={"upgrade": "websocket", "connection": "Upgrade", "authorization": "Bearer polar:session=ws1"},
        content=b"",
    )
    answer(shared, flow, loop)
    assert gateway.calls == []
    request = flow.request
    assert (request.scheme, request.host, request.port) == ("http", "127.0.0.1", 6666)
    assert request.path.startswith(WEBSOCKET_PREFIX) and flow.metadata["polar_websocket"] is True
    [parked] = shared.websockets._parked.values()
    assert parked.identity.session_id == "ws1"
    assert "authorization" not in parked.headers and parked.headers["upgrade"] == "websocket"
    assert (parked.host, parked.client, parked.connection) == ("api.openai.com", "10.9.8.7", flow.client_conn.id)


def test_an_unexpected_error_is_answered_here_never_forwarded(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = _Gateway(RuntimeError("boom"))
    flow = make_flow("api.openai.com", "/v1/chat/completions")
    with caplog.at_level(logging.ERROR, logger="polar"):
        answer(Shared(gateway=gateway), flow, loop)
    assert flow.response is not None and flow.response.status_code == 500
    # In the caller's protocol (OpenAI's here), as an api_error: the class of the exception, nothing of its text.
    assert orjson.loads(flow.response.content) == {
        "error": {"message": "polar internal error (RuntimeError)", "type": "server_error", "param": None, "code": None}
    }
    anthropic = make_flow()
    answer(Shared(gateway=gateway), anthropic, loop)
    assert orjson.loads(anthropic.response.content) == {
        "type": "error",
        "error": {"type": "api_error", "message": "polar internal error (RuntimeError)"},
    }
    assert "polar: unexpected error on POST api.openai.com" in caplog.messages


def test_an_error_even_in_the_refusal_is_answered_with_a_plain_500(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = _Gateway(RuntimeError("boom"))
    monkeypatch.setattr(gateway, "error_reply", lambda *args: 1 / 0)
    flow = make_flow()
    answer(Shared(gateway=gateway), flow, loop)
    assert flow.response is not None and flow.response.status_code == 500
    assert orjson.loads(flow.response.content) == {"error": {"type": "api_error", "message": "polar internal error"}}
    assert flow.response.headers["content-type"] == "application/json"


def test_only_unanswered_model_calls_reach_the_gateway(loop: asyncio.AbstractEventLoop) -> None:
    gateway = _Gateway()
    shared = Shared(gateway=gateway)
    answered = make_flow()
    answered.response = http.Response.make(413)
    for flow in (
        answered,
        make_flow("polar.local", "/v1/messages"),  # the control plane's
        make_flow("example.com", "/v1/messages"),
        make_flow("api.openai.com", "/v1/models", "GET"),
    ):
        answer(shared, flow, loop)
    assert gateway.calls == [] and answered.response.status_code == 413
    answer(Shared(), make_flow(), loop)  # no gateway: nothing to do


# --- the proxy's start and end ----------------------------------------------------------------------------------------


class _ProxyOptions:
    """The proxy server's option the capture addon sets at start (its addon is not loaded here)."""

    def load(self, loader) -> None:
        loader.add_option("connection_strategy", str, "eager", "When to connect upstream.")


class _Closing:
    def __init__(self) -> None:
        self.closed = 0
        self.store = SimpleNamespace(uri="/o", journal_root="/o/.journal")

    async def close(self) -> None:
        self.closed += 1


def test_running_starts_the_loopback_servers_and_says_what_the_proxy_does(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        gateway = _Closing()
        shared = Shared(gateway=gateway)  # type: ignore[arg-type]
        with taddons.context(_ProxyOptions(), *addons(shared)) as tctx:
            tctx.options._options["polar_engine"].set(ENGINE)
            capture = capture_of(tctx)
            with caplog.at_level(logging.WARNING, logger="polar"):
                await capture.running()
            try:
                assert tctx.options.connection_strategy == "lazy"
                assert shared.relay.port > 0 and shared.websockets.port > 0
                assert (
                    "polar: mitmdump listens on all interfaces; pass --listen-host 127.0.0.1 unless others must "
                    "reach it" in caplog.messages
                )
                assert f"polar: engine {ENGINE}; output /o (journal /o/.journal); listening: regular on *:8080" in (
                    caplog.messages
                )
            finally:
                await capture.done()
            assert gateway.closed == 1
            assert shared.relay._runner is None or not shared.relay._runner.sites
            caplog.clear()
            tctx.options.update(listen_host="127.0.0.1")
            idle = Shared()
            capture = Capture(idle)
            with caplog.at_level(logging.WARNING, logger="polar"):
                await capture.running()
            await capture.done()
            assert caplog.messages == []  # no gateway: nothing to announce
            tctx.options.update(listen_port=8899, mode=["regular@9000", "socks5"])
            capture = Capture(Shared(gateway=_Closing()))  # type: ignore[arg-type]
            with caplog.at_level(logging.WARNING, logger="polar"):
                await capture.running()
            await capture.done()
            assert caplog.messages == [
                f"polar: engine {ENGINE}; output /o (journal /o/.journal); "
                "listening: regular on 127.0.0.1:9000, socks5 on 127.0.0.1:8899"
            ]

    asyncio.run(main())
