"""Failure paths end to end: a real mitmdump with the polar addon, the official SDKs as clients, and
an engine that is slow, fails or times out when asked to.

The engine is the real SGLang engine client against the SGLang contract server (SGLang 0.5.23's own
protocol classes, real tokens from the tiny model underneath), whose fault injection makes it
answer late, answer 500, or both; the proxy runs with a short ``polar_engine_timeout``, short
keep-alives, and ``polar_hosts`` naming a plain HTTP server that stands in for a self-hosted API.
"""

from __future__ import annotations

import base64
import ssl
from collections.abc import Iterator

import anthropic
import httpx
import openai
import orjson
import pytest

from polar_addon.engines.local import LocalEngine
from tests.support.proxy import echo_server, run_mitmdump
from tests.support.shards import session_records

ENGINE_TIMEOUT_S = 2.0
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def echo() -> Iterator[int]:
    with echo_server() as port:
        yield port


@pytest.fixture(scope="module")
def engine(tiny_model_dir, sglang_protocol):
    from tests.support.sglang_contract_server import SGLangContractServer

    with SGLangContractServer(LocalEngine(tiny_model_dir), protocol=sglang_protocol) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(engine, echo, tmp_path_factory):
    out = tmp_path_factory.mktemp("failures") / "shards"
    options = {
        "polar_engine_timeout": str(ENGINE_TIMEOUT_S),
        "polar_keepalive": "0.3",
        "polar_shard_seconds": "0.2",
        "polar_hosts": f"127.0.0.1:{echo}",
    }
    with run_mitmdump(f"sglang:{engine.url}", out, options=options) as p:
        yield p


def https(proxy, session: str, **kw) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=60, **kw
    )


def test_engine_timeout_is_a_provider_timeout_and_a_failed_record(proxy, engine):
    with engine.configured(delay_s=ENGINE_TIMEOUT_S + 3):
        with pytest.raises(anthropic.APIStatusError) as ant:
            anthropic.Anthropic(api_key="x", http_client=https(proxy, "to-a"), max_retries=0).messages.create(
                model="tiny", max_tokens=4, messages=HI
            )
        with pytest.raises(openai.APIStatusError) as oai:
            openai.OpenAI(api_key="x", http_client=https(proxy, "to-o"), max_retries=0).chat.completions.create(
                model="tiny", max_tokens=4, messages=HI
            )
    assert ant.value.status_code == 504 and ant.value.body["error"]["type"] == "timeout_error"
    assert oai.value.status_code == 504 and oai.value.code == "timeout"
    for session in ("to-a", "to-o"):
        [record] = session_records(proxy.out, session)
        assert record.status == "failed" and record.error.startswith("504 timeout")
        assert f"within {ENGINE_TIMEOUT_S:g} s" in record.error


def test_engine_failing_after_keepalives_ends_the_stream_in_a_provider_error(proxy, engine):
    with engine.configured(delay_s=1.0, fail="internal"):
        with https(proxy, "late-raw").stream(
            "POST",
            "https://api.anthropic.com/v1/messages",
            json={"model": "tiny", "max_tokens": 4, "stream": True, "messages": HI},
        ) as r:
            assert r.status_code == 200  # headers went out with the first keep-alive
            lines = [line for line in r.iter_lines() if line]
        with pytest.raises(anthropic.APIStatusError, match="engine error 500"):
            client = anthropic.Anthropic(api_key="x", http_client=https(proxy, "late-a"), max_retries=0)
            with client.messages.stream(model="tiny", max_tokens=4, messages=HI) as stream:
                stream.get_final_message()
        with pytest.raises(openai.APIError, match="engine error 500"):
            client = openai.OpenAI(api_key="x", http_client=https(proxy, "late-o"), max_retries=0)
            list(client.chat.completions.create(model="tiny", max_tokens=4, messages=HI, stream=True))
    # Keep-alive pings, then one error event and nothing after it.
    assert lines[0] == "event: ping" and lines[-2] == "event: error"
    error = orjson.loads(lines[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert not any(line.startswith("event: message") for line in lines)
    for session in ("late-raw", "late-a", "late-o"):
        [record] = session_records(proxy.out, session)
        assert record.status == "failed" and record.error.startswith("502 api_error") and record.response_ids == []


def test_a_client_leaving_mid_stream_leaves_the_call_recorded_and_the_proxy_serving(proxy, engine):
    with engine.configured(delay_s=1.5):
        client = https(proxy, "gone")
        with client.stream(
            "POST",
            "https://api.openai.com/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 4, "stream": True, "messages": HI},
        ) as r:
            first = next(line for line in r.iter_lines() if line)
            assert first == ": keep-alive"
        client.close()  # hang up while the engine is still working
    # The engine's answer was still captured (the sample happened), and the proxy carries on.
    [record] = session_records(proxy.out, "gone", at_least=1)
    assert record.status == "ok" and record.response_ids
    after = openai.OpenAI(api_key="x", http_client=https(proxy, "after"), max_retries=0).chat.completions.create(
        model="tiny", max_tokens=3, messages=HI
    )
    assert after.choices[0].message.content is not None


def test_polar_hosts_captures_a_listed_host_and_passes_the_rest(proxy, echo):
    client = httpx.Client(proxy=proxy.proxy_url("hosted"), timeout=60)
    body = {"model": "tiny", "max_tokens": 3, "messages": HI}
    captured = client.post(f"http://127.0.0.1:{echo}/v1/chat/completions", json=body)
    assert captured.status_code == 200 and captured.json()["object"] == "chat.completion"
    # Not a model route on the listed host, and the same server under a name not listed: untouched.
    assert client.post(f"http://127.0.0.1:{echo}/upload", content=b"x").content == b"echo:x"
    assert client.post(f"http://localhost:{echo}/v1/chat/completions", content=b"y").content == b"echo:y"
    [record] = session_records(proxy.out, "hosted")
    assert record.status == "ok" and record.api == "openai_chat"


def _proxy_auth_client(proxy, value: str) -> httpx.Client:
    return httpx.Client(proxy=httpx.Proxy(proxy.url, headers={"proxy-authorization": value}), timeout=60)


def test_a_malformed_basic_proxy_authorization_gets_the_addons_own_400(proxy, echo):
    url = f"http://127.0.0.1:{echo}/v1/chat/completions"
    body = {"model": "tiny", "max_tokens": 3, "messages": HI}
    bad = _proxy_auth_client(proxy, "Basic " + base64.b64encode(b"\xff\xfe:x").decode())
    r = bad.post(url, json=body, headers={"x-polar-session": "never"})
    assert r.status_code == 400 and "Proxy-Authorization" in r.text
    # Any other scheme is not ours to read: the call goes on with the next identity source.
    other = _proxy_auth_client(proxy, "Bearer some-token")
    ok = other.post(url, json=body, headers={"x-polar-session": "non-basic"})
    assert ok.status_code == 200
    [record] = session_records(proxy.out, "non-basic")
    assert record.status == "ok"
    assert session_records(proxy.out, "never") == []
