"""The interception scope (polar_addon.addons.scope), in-process on mitmproxy test flows: which hosts have their TLS
intercepted, which flows are model calls, control flows or neither, and what happens to the rest. The agent under
training chooses every host, port, path and header here: each decision is checked where it flips."""

from __future__ import annotations

import logging
import re

import orjson
import pytest
from mitmproxy import http
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow, tutils

from polar_addon.addons import InterceptionScope, Shared
from polar_addon.addons.scope import (
    BLOCKED_BODY,
    host_name,
    intercept_patterns,
    is_control_flow,
    is_model_call,
    is_model_host,
    is_ours,
)
from polar_addon.gateway import Gateway

PROVIDERS = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com")
CONTROL_404 = {"error": {"type": "not_found", "message": "polar control paths are served only on polar.local"}}


def make_flow(
    host: str,
    path: str = "/v1/messages",
    method: str = "POST",
    *,
    port: int = 443,
    mode: str = "regular",
    headers: dict[str, str] | None = None,
) -> http.HTTPFlow:
    fields = {"proxy-authorization": "Basic cG9sYXI6c2Vzc2lvbj1zMQ==", "x-other": "kept", **(headers or {})}
    request = tutils.treq(
        host=host,
        port=port,
        method=method.encode(),
        scheme=b"https",
        path=path.encode(),
        headers=http.Headers([(k.encode(), v.encode()) for k, v in fields.items()]),
        content=b"{}",
    )
    flow = tflow.tflow(req=request)
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    return flow


def intercepted(patterns: list[str], address: str) -> bool:
    return any(re.search(p, address, re.IGNORECASE) for p in patterns)


# --- which TLS is intercepted ---------------------------------------------------------------------------------------


def test_the_allow_hosts_patterns_name_the_providers_the_control_host_polar_hosts_and_reverse_targets() -> None:
    patterns = intercept_patterns(
        ["llm.internal", "10.0.0.5:8000", "host:abc", ":8080", "8080"],
        ["regular", "reverse:http://engine.local:8000", "reverse:https://api.example.com"],
    )
    assert patterns == [
        r"^(?:api\.anthropic\.com|api\.openai\.com|generativelanguage\.googleapis\.com|polar\.local):\d+$",
        r"^llm\.internal:\d+$",  # a bare host: any port
        r"^10\.0\.0\.5:8000$",  # HOST:PORT: that port alone
        r"^host:abc:\d+$",  # not a port: the whole entry is a host name
        r"^:8080:\d+$",  # no host before the port: not a HOST:PORT
        r"^8080:\d+$",
        r"^engine\.local:8000$",
        r"^api\.example\.com:443$",
    ]
    # The port is what follows the last colon: an IPv6 literal's own colons stay in the host.
    assert intercept_patterns(["[::1]:8000", "a:b:80"], []) == [patterns[0], r"^\[::1\]:8000$", r"^a:b:80$"]


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("api.openai.com:443", True),
        ("api.anthropic.com:8443", True),
        ("generativelanguage.googleapis.com:443", True),
        ("polar.local:80", True),
        ("llm.internal:1", True),
        ("10.0.0.5:8000", True),
        ("engine.local:8000", True),
        # Anchored and escaped: a look-alike host is another host, passed through untouched.
        ("api.openai.com.evil.net:443", False),
        ("xapi.openai.com:443", False),
        ("apixopenai.com:443", False),
        ("api.openai.com:443x", False),
        ("10.0.0.5:8001", False),
        ("10.0.0.5:80001", False),
        ("engine.local:8001", False),
        ("example.com:443", False),
    ],
)
def test_only_model_hosts_have_their_tls_intercepted(address: str, expected: bool) -> None:
    patterns = intercept_patterns(["llm.internal", "10.0.0.5:8000"], ["reverse:http://engine.local:8000"])
    assert intercepted(patterns, address) is expected


def test_host_names_compare_case_insensitively_without_their_final_dots() -> None:
    assert host_name("API.OpenAI.com.") == "api.openai.com"
    assert host_name("Polar.Local..") == "polar.local"
    assert host_name("a.b") == "a.b"


def test_model_hosts_are_the_providers_polar_local_and_polar_hosts_by_name_or_by_name_and_port() -> None:
    with taddons.context(InterceptionScope(Shared())) as tctx:
        tctx.options.update(polar_hosts=["LLM.Internal.", "10.0.0.5:8000"])
        for host in PROVIDERS:
            assert is_model_host(host, 443)
            assert is_model_host(host.upper() + ".", 1)
        assert is_model_host("polar.local", 80)
        assert is_model_host("POLAR.local.", 80)
        assert is_model_host("llm.internal", 12345)
        assert is_model_host("10.0.0.5", 8000)
        assert not is_model_host("10.0.0.5", 8001)
        assert not is_model_host("api.openai.com.evil.net", 443)
        assert not is_model_host("openai.com", 443)
        assert not is_model_host("example.com", 443)


def test_without_polar_hosts_only_the_fixed_hosts_are_model_hosts() -> None:
    with taddons.context(InterceptionScope(Shared())):
        assert is_model_host("api.anthropic.com", 443)
        assert not is_model_host("llm.internal", 443)


# --- which flows are ours, control flows, model calls ---------------------------------------------------------------


def test_a_reverse_listener_flow_is_ours_whatever_its_host() -> None:
    with taddons.context(InterceptionScope(Shared())) as tctx:
        tctx.options.update(polar_hosts=["10.0.0.5:8000"])
        assert is_ours(make_flow("10.0.0.5", port=8000))
        assert not is_ours(make_flow("10.0.0.5", port=8001))
        assert is_ours(make_flow("example.com", mode="reverse:http://engine.local:8000"))
        assert is_ours(make_flow("api.anthropic.com"))
        assert not is_ours(make_flow("example.com"))
        # The Host header is the host: a spoofed one names where polar thinks the call goes.
        assert is_ours(make_flow("example.com", headers={"host": "api.openai.com"}))


def test_control_flows_are_polar_local_and_control_paths_on_a_reverse_listener_only() -> None:
    with taddons.context(InterceptionScope(Shared())):
        assert is_control_flow(make_flow("polar.local", "/anything"))
        assert is_control_flow(make_flow("POLAR.LOCAL.", "/sessions"))
        reverse = "reverse:http://engine.local:8000"
        assert is_control_flow(make_flow("engine.local", "/sessions/s1/reward", mode=reverse))
        assert not is_control_flow(make_flow("engine.local", "/v1/messages", mode=reverse))
        # On a provider host through the regular proxy, a control path is the agent's own route, not the control plane.
        assert not is_control_flow(make_flow("api.openai.com", "/sessions/s1/reward"))


def test_model_calls_are_provider_routes_or_a_responses_upgrade_on_a_model_host() -> None:
    gateway = Gateway(None, None)  # type: ignore[arg-type]
    upgrade = {"upgrade": "websocket", "connection": "Upgrade"}
    with taddons.context(InterceptionScope(Shared(gateway=gateway))):
        assert is_model_call(make_flow("api.anthropic.com", "/v1/messages"), gateway)
        assert is_model_call(make_flow("api.openai.com", "/v1/responses", "GET", headers=upgrade), gateway)
        assert not is_model_call(make_flow("api.openai.com", "/v1/responses", "GET"), gateway)
        assert not is_model_call(make_flow("api.openai.com", "/v1/models", "GET"), gateway)
        assert not is_model_call(make_flow("example.com", "/v1/messages"), gateway)
        assert not is_model_call(make_flow("example.com", "/v1/responses", "GET", headers=upgrade), gateway)


# --- what happens to each flow ----------------------------------------------------------------------------------------


@pytest.fixture()
def scope() -> InterceptionScope:
    return InterceptionScope(Shared(gateway=Gateway(None, None)))  # type: ignore[arg-type]


def test_a_control_path_on_a_provider_host_is_refused_not_forwarded(scope: InterceptionScope) -> None:
    with taddons.context(scope):
        flow = make_flow("api.openai.com", "/sessions/s1/reward?x=1")
        scope.request(flow)
        assert flow.response is not None
        assert flow.response.status_code == 404
        assert orjson.loads(flow.response.content) == CONTROL_404
        assert flow.response.headers["content-type"] == "application/json"


def test_other_traffic_passes_through_without_the_proxy_credentials(scope: InterceptionScope) -> None:
    with taddons.context(scope):
        flow = make_flow("example.com", "/index.html", "GET")
        scope.request(flow)
        assert flow.response is None
        assert "proxy-authorization" not in flow.request.headers
        assert flow.request.headers["x-other"] == "kept"
        # A provider host's route polar does not answer passes through too, without the credentials.
        flow = make_flow("api.openai.com", "/v1/models", "GET")
        scope.request(flow)
        assert flow.response is None and "proxy-authorization" not in flow.request.headers
        # Without proxy credentials there is nothing to remove.
        flow = make_flow("example.com", "/index.html", "GET")
        del flow.request.headers["proxy-authorization"]
        scope.request(flow)
        assert flow.response is None and flow.request.headers["x-other"] == "kept"


def test_other_traffic_is_refused_with_polar_block_other(scope: InterceptionScope) -> None:
    with taddons.context(scope) as tctx:
        tctx.options.update(polar_block_other=True)
        flow = make_flow("example.com", "/index.html", "GET")
        scope.request(flow)
        assert flow.response is not None
        assert flow.response.status_code == 403
        assert flow.response.content == BLOCKED_BODY == b"polar: non-model traffic is blocked (polar_block_other)"
        assert flow.response.headers["content-type"] == "text/plain"


def test_model_calls_and_control_flows_are_left_to_their_addons(scope: InterceptionScope) -> None:
    with taddons.context(scope) as tctx:
        tctx.options.update(polar_block_other=True)
        for flow in (
            make_flow("api.anthropic.com", "/v1/messages"),
            make_flow("polar.local", "/sessions/s1/reward"),
            make_flow("polar.local", "/nowhere"),
            make_flow("engine.local", "/sessions", "GET", mode="reverse:http://engine.local:8000"),
        ):
            scope.request(flow)
            assert flow.response is None
            # Capture reads the session from the credentials: a model call keeps them.
            assert "proxy-authorization" in flow.request.headers


def test_a_flow_already_answered_or_a_proxy_without_gateway_is_left_alone() -> None:
    answered = InterceptionScope(Shared(gateway=Gateway(None, None)))  # type: ignore[arg-type]
    with taddons.context(answered) as tctx:
        tctx.options.update(polar_block_other=True)
        flow = make_flow("example.com", "/", "GET")
        flow.response = http.Response.make(200, b"earlier")
        answered.request(flow)
        assert flow.response.content == b"earlier" and "proxy-authorization" in flow.request.headers
    idle = InterceptionScope(Shared())
    with taddons.context(idle) as tctx:
        tctx.options.update(polar_block_other=True)
        flow = make_flow("example.com", "/", "GET")
        idle.request(flow)
        assert flow.response is None and "proxy-authorization" in flow.request.headers


def test_connect_to_another_host_is_refused_only_with_polar_block_other(caplog: pytest.LogCaptureFixture) -> None:
    scope = InterceptionScope(Shared())
    with taddons.context(scope) as tctx:
        flow = make_flow("example.com", "/", "CONNECT")
        scope.http_connect(flow)
        assert flow.response is None
        tctx.options.update(polar_block_other=True, polar_hosts=["llm.internal", "10.0.0.5:8000"])
        for host, port in (("api.openai.com", 443), ("llm.internal", 443), ("polar.local", 443), ("10.0.0.5", 8000)):
            flow = make_flow(host, "/", "CONNECT", port=port)
            scope.http_connect(flow)
            assert flow.response is None, host
        flow = make_flow("10.0.0.5", "/", "CONNECT", port=8001)
        scope.http_connect(flow)
        assert flow.response is not None and flow.response.status_code == 403
        flow = make_flow("example.com", "/", "CONNECT", port=8443)
        with caplog.at_level(logging.INFO, logger="polar"):
            scope.http_connect(flow)
        assert flow.response is not None
        assert flow.response.status_code == 403 and flow.response.content == BLOCKED_BODY
        assert "polar: refused CONNECT example.com:8443 (polar_block_other)" in caplog.messages


# --- options ----------------------------------------------------------------------------------------------------------


def test_allow_hosts_is_set_to_the_model_hosts_and_follows_polar_hosts() -> None:
    scope = InterceptionScope(Shared())
    with taddons.context(scope) as tctx:
        tctx.configure(scope, polar_hosts=["llm.internal"])
        assert tctx.options.allow_hosts == intercept_patterns(["llm.internal"], [])
        tctx.configure(scope, polar_hosts=["llm.internal", "10.0.0.5:8000"])
        assert tctx.options.allow_hosts == intercept_patterns(["llm.internal", "10.0.0.5:8000"], [])
        tctx.configure(scope, mode=["reverse:http://engine.local:8000"])
        assert tctx.options.allow_hosts[-1] == r"^engine\.local:8000$"


def test_an_operators_own_allow_hosts_or_ignore_hosts_is_left_alone_until_cleared() -> None:
    ours = intercept_patterns(["llm.internal"], [])
    scope = InterceptionScope(Shared())
    with taddons.context(scope) as tctx:
        tctx.configure(scope, ignore_hosts=["^example\\.com:443$"])
        tctx.configure(scope, polar_hosts=["llm.internal"])
        assert tctx.options.allow_hosts == []
        # Neither list left: every TLS would be intercepted; only the model hosts are, again.
        tctx.configure(scope, ignore_hosts=[])
        assert tctx.options.allow_hosts == ours
    scope = InterceptionScope(Shared())
    with taddons.context(scope) as tctx:
        tctx.configure(scope, allow_hosts=["^mine:443$"])
        tctx.configure(scope, polar_hosts=["llm.internal"])
        assert tctx.options.allow_hosts == ["^mine:443$"]
        tctx.configure(scope, allow_hosts=[])
        assert tctx.options.allow_hosts == ours


def test_blocking_other_traffic_turns_raw_tcp_off() -> None:
    scope = InterceptionScope(Shared())
    with taddons.context(scope) as tctx:
        tctx.configure(scope, polar_hosts=["x"])
        assert tctx.options.rawtcp is True
        tctx.configure(scope, polar_block_other=False)
        assert tctx.options.rawtcp is True
        tctx.configure(scope, polar_block_other=True)
        assert tctx.options.rawtcp is False
