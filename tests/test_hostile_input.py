"""Hostile input never crashes polar, never stops the store, never reaches upstream (issue 11, items 1, 2, 6).

In-process through ``Gateway.handle`` (every translator, identity parsing) and through a real mitmdump in
reverse mode in front of a recording fake upstream: anything the addon lets through would show up there.
The hypothesis budget is small here (``POLAR_FUZZ_EXAMPLES``, default 12 per translator); ``bench/reliability.py
--long`` runs more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_addon import identity
from polar_addon.canonical import PolarError
from polar_addon.capture import Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall
from polar_addon.providers.openai_responses import ResponseHistory
from polar_addon.store import TraceStore, read_records
from polar_addon.store.validate import validate_store
from tests.support.hostile import (
    PATHS,
    RecordingUpstream,
    hostile_body,
    hostile_identity,
    is_provider_error,
    triggers,
    valid_body,
    write_script,
)
from tests.support.proxy import run_mitmdump
from tests.support.shards import session_records, wait_for_shards

EXAMPLES = int(os.environ.get("POLAR_FUZZ_EXAMPLES", "12"))
TRIGGERS = triggers()


def _headers_for_gateway(raw: dict[str, Any]) -> dict[str, str]:
    """Header values as mitmproxy hands them to the addon: bytes decoded with surrogateescape."""
    return {k: v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v for k, v in raw.items()}


async def _answer(
    gateway: Gateway, api: str, body: bytes, headers: dict[str, str], session: str = "fuzz"
) -> tuple[int, bytes]:
    """What the addon does for one call: identity from the headers, then the gateway."""
    try:
        ident = identity.resolve(None, headers, "conn-1") if headers else Identity(session_id=session, source="header")
    except PolarError as err:
        reply = gateway.error_reply("POST", PATHS[api], err)
        return reply.status, reply.body
    call = IncomingCall(method="POST", path=PATHS[api], headers=headers, body=body, identity=ident)
    reply = await gateway.handle(call)
    if isinstance(reply, FullReply):
        return reply.status, reply.body
    return reply.status, b"".join([chunk async for chunk in reply.chunks])


@pytest.fixture()
def engine(tiny_model_dir: Path, tmp_path: Path) -> str:
    return write_script(tmp_path / "script.json", tiny_model_dir)


@pytest.mark.parametrize("trigger", TRIGGERS, ids=[t.name for t in TRIGGERS])
def test_each_known_trigger_gets_a_provider_shaped_answer_and_the_store_keeps_writing(
    trigger, engine: str, tmp_path: Path
) -> None:
    out = tmp_path / "shards"

    async def main() -> tuple[int, bytes, int]:
        gateway = Gateway(
            EnginePool([ScriptedEngine(engine.removeprefix("scripted:"))]),
            TraceStore(str(out), shard_max_records=2, shard_max_seconds=0.2),
        )
        body = trigger.encoded()
        status, answer = await _answer(gateway, trigger.api, body, _headers_for_gateway(trigger.headers))
        after, _ = await _answer(gateway, "openai_chat", orjson.dumps(valid_body("openai_chat")), {}, session="after")
        # The store's writer and converter are threads: blocking this loop holds nothing up.
        wait_for_shards(out, check=gateway.store.check_writable)
        await gateway.close()
        return status, answer, after

    status, answer, after = asyncio.run(main())
    assert status == trigger.expect, answer[:300]
    if status != 200:
        assert is_provider_error(trigger.api, status, answer), answer[:300]
        # Each known trigger has its own clear message, not the translator-exception fallback.
        assert b"could not be read" not in answer, answer[:300]
    assert after == 200
    records = read_records(str(out))
    assert [r.status for r in records if r.session_id == "after"] == ["ok"]
    assert not [p for p in validate_store(str(out)) if "quarantined" in p]


def test_non_utf8_user_agent_is_recorded_readably(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def main() -> int:
        gateway = Gateway(EnginePool([ScriptedEngine(engine.removeprefix("scripted:"))]), TraceStore(str(out)))
        status, _ = await _answer(
            gateway,
            "openai_chat",
            orjson.dumps(valid_body("openai_chat")),
            {"user-agent": b"agent\xff/1".decode("utf-8", "surrogateescape")},
            session="ua",
        )
        await gateway.close()
        return status

    assert asyncio.run(main()) == 200
    (record,) = read_records(str(out))
    assert record.harness == "agent\ufffd/1"


@pytest.mark.parametrize("api", list(PATHS))
def test_fuzzed_bodies_through_the_gateway(api: str, engine: str, tmp_path: Path, caplog) -> None:
    """Property: every fuzzed body gets a provider-shaped 4xx or a valid answer, never an internal error, and
    the store still writes afterwards."""
    out = tmp_path / "shards"
    loop = asyncio.new_event_loop()
    gateway = Gateway(
        EnginePool([ScriptedEngine(engine.removeprefix("scripted:"))]),
        TraceStore(str(out), shard_max_records=16, shard_max_seconds=0.2),
        GatewayConfig(max_body_bytes=1 << 20),
    )
    seen: list[int] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(body=hostile_body(api))
    def check(body: bytes) -> None:
        status, answer = loop.run_until_complete(_answer(gateway, api, body, {}))
        seen.append(status)
        assert status == 200 or 400 <= status < 500, (status, answer[:300])
        if status != 200:
            assert is_provider_error(api, status, answer), answer[:300]

    try:
        with caplog.at_level(logging.ERROR, logger="polar"):
            check()
        status, _ = loop.run_until_complete(
            _answer(gateway, "openai_chat", orjson.dumps(valid_body("openai_chat")), {}, session="after")
        )
        assert status == 200
        gateway.store.check_writable()
    finally:
        loop.run_until_complete(gateway.close())
        loop.close()
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert any(r.session_id == "after" and r.status == "ok" for r in read_records(str(out)))
    assert not [p for p in validate_store(str(out)) if "quarantined" in p]


def test_fuzzed_identity(engine: str, tmp_path: Path) -> None:
    """Property: any identity header text gives a 400 from identity parsing or a call the store accepts."""
    out = tmp_path / "shards"
    loop = asyncio.new_event_loop()
    gateway = Gateway(
        EnginePool([ScriptedEngine(engine.removeprefix("scripted:"))]),
        TraceStore(str(out), shard_max_records=16, shard_max_seconds=0.2),
    )
    body = orjson.dumps(valid_body("anthropic_messages"))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(headers=hostile_identity())
    def check(headers: dict[str, Any]) -> None:
        status, answer = loop.run_until_complete(_answer(gateway, "anthropic_messages", body, headers))
        assert status in (200, 400), answer[:300]
        if status == 400:
            assert is_provider_error("anthropic_messages", 400, answer)

    try:
        check()
        gateway.store.check_writable()
    finally:
        loop.run_until_complete(gateway.close())
        loop.close()
    assert not [p for p in validate_store(str(out)) if "quarantined" in p]


def test_responses_history_is_bounded_by_bytes_and_prewarms_do_not_grow_it() -> None:
    history = ResponseHistory(size=100, max_bytes=1000, session_bytes=400)
    for i in range(10):
        history.remember(f"a{i}", [], session="a", cost=100)
    assert history.total_bytes <= 400 and history.get("a9") is not None and history.get("a0") is None
    for i in range(10):
        history.remember(f"b{i}", [], session=f"b{i}", cost=300)
    assert history.total_bytes <= 1000 and history.get("b9") is not None
    for i in range(50):
        history.remember(f"p{i}", [], session="p", cost=10, prewarm=True)
    assert len([r for r in ("p48", "p49") if history.get(r) is not None]) == 1
    history.remember("huge", [], session="h", cost=401)
    assert history.get("huge") is None


def test_engine_pool_session_table_is_bounded_and_released() -> None:
    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

    pool = EnginePool([Named("e0"), Named("e1")], max_sessions=100)  # type: ignore[list-item]
    for i in range(1000):
        pool.for_session(f"s{i}")
    assert len(pool) == 100 and sum(pool.affinity.load()) == 100
    pool.release("s999")
    assert len(pool) == 99


# ---- through a real mitmdump ---------------------------------------------------------------------------------


def _post(url: str, trigger_api: str, body: bytes, headers: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        url + PATHS[trigger_api],
        content=body,
        headers={"content-type": "application/json", "authorization": "Bearer sk-real-secret", **headers},
        timeout=60,
    )


@pytest.mark.timeout(600)
def test_triggers_and_fuzz_through_mitmdump_never_reach_upstream(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    with (
        RecordingUpstream() as upstream,
        run_mitmdump(
            engine,
            out,
            mode=f"reverse:http://127.0.0.1:{upstream.port}",
            options={"polar_shard_seconds": "0.2", "polar_max_body_mb": "1"},
        ) as proxy,
    ):
        for trigger in TRIGGERS:
            body = trigger.encoded()
            response = _post(proxy.url, trigger.api, body, trigger.headers)
            assert response.status_code == trigger.expect, (trigger.name, response.text[:300])
            if trigger.expect != 200:
                assert is_provider_error(trigger.api, response.status_code, response.content), (
                    trigger.name,
                    response.text[:300],
                )

        @settings(
            max_examples=max(10, EXAMPLES // 4),
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        )
        @given(api=st.sampled_from(list(PATHS)), data=st.data())
        def fuzz(api: str, data: st.DataObject) -> None:
            response = _post(proxy.url, api, data.draw(hostile_body(api)), {"x-polar-session": "fuzz"})
            assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:300]

        fuzz()
        big = orjson.dumps({**valid_body("openai_chat"), "messages": [{"role": "user", "content": "x" * (3 << 20)}]})
        response = _post(proxy.url, "openai_chat", big, {})
        assert response.status_code == 413 and is_provider_error("openai_chat", 413, response.content)
        after = _post(proxy.url, "openai_chat", orjson.dumps(valid_body("openai_chat")), {"x-polar-session": "after"})
        assert after.status_code == 200
        logs = proxy.logs()
    assert upstream.requests == [], upstream.requests[:3]
    assert "sk-real-secret" not in logs
    records = read_records(str(out))
    assert any(r.session_id == "after" and r.status == "ok" for r in records)
    assert not any("sk-real-secret" in (r.error or "") + r.messages_json for r in records)
    assert not [p for p in validate_store(str(out)) if "quarantined" in p]


@pytest.mark.timeout(300)
def test_responses_websocket_answers_hostile_messages_with_error_events(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    base = {"type": "response.create", "model": "tiny", "stream": True, "store": False, "input": "hi"}
    with run_mitmdump(engine, out, options={"polar_shard_seconds": "0.2", "polar_max_body_mb": "1"}) as proxy:

        async def session() -> list[Any]:
            ssl_ctx = ssl.create_default_context(cafile=str(proxy.ca))
            answers: list[Any] = []
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(
                    "wss://api.openai.com/v1/responses", proxy=proxy.proxy_url("ws-hostile"), ssl=ssl_ctx
                ) as ws:
                    for message in (
                        {**base, "tools": [{"type": ["function"], "name": "x"}]},
                        {**base, "max_output_tokens": 2**63 + 5},
                        {
                            **base,
                            "tools": [{"type": "function", "name": "f", "parameters": {"a": 1}}],
                            "tool_choice": {"type": "function", "name": ["f"]},
                        },
                        {**base, "generate": False, "tools": [{"type": ["x"]}]},
                        base,
                        {**base, "input": "x" * (2 << 20)},
                    ):
                        await ws.send_str(orjson.dumps(message).decode())
                        events = []
                        while True:
                            msg = await ws.receive(timeout=60)
                            if msg.type != aiohttp.WSMsgType.TEXT:
                                events.append(("closed", ws.close_code))
                                break
                            event = orjson.loads(msg.data)
                            events.append(event)
                            if event["type"] in ("response.completed", "response.failed", "error"):
                                break
                        answers.append(events)
            return answers

        answers = asyncio.run(session())
    kinds = [[e["type"] if isinstance(e, dict) else e[0] for e in events] for events in answers]
    assert [k[-1] for k in kinds[:4]] == ["error"] * 4, answers[:4]
    assert all(events[-1]["status"] == 400 for events in answers[:4]), answers[:4]
    assert kinds[4][-1] == "response.completed"  # the socket survived every bad message
    assert kinds[5][0] == "error" and answers[5][0]["status"] == 413, answers[5]


def _chunks(body: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


@pytest.mark.timeout(300)
def test_bodies_over_every_limit_get_a_provider_shaped_413_declared_or_chunked(engine: str, tmp_path: Path) -> None:
    """A body past mitmproxy's own buffering would be answered by mitmproxy (a plain-text 413) unless polar
    counts it on its way in: declared or chunked, it gets the provider's 413 and nothing reaches upstream."""
    out = tmp_path / "shards"
    huge = b'{"model":"tiny","messages":[{"role":"user","content":"' + b"x" * (20 << 20) + b'"}]}'
    with (
        RecordingUpstream() as upstream,
        run_mitmdump(
            engine,
            out,
            mode=f"reverse:http://127.0.0.1:{upstream.port}",
            options={"polar_shard_seconds": "0.2", "polar_max_body_mb": "1"},
        ) as proxy,
    ):
        answers = []
        for api in ("openai_chat", "anthropic_messages"):
            headers = {"content-type": "application/json", "x-api-key": "sk-real-secret", "x-polar-session": "big"}
            declared = httpx.post(proxy.url + PATHS[api], content=huge, headers=headers, timeout=120)
            chunked = httpx.post(proxy.url + PATHS[api], content=_chunks(huge), headers=headers, timeout=120)
            answers += [(api, "declared", declared), (api, "chunked", chunked)]
        # A chunked body within the limit is answered as any other call, streamed or not, and recorded.
        small = orjson.dumps(valid_body("openai_chat"))
        plain = httpx.post(
            proxy.url + PATHS["openai_chat"],
            content=_chunks(small, 7),
            headers={"content-type": "application/json", "x-polar-session": "chunked"},
            timeout=60,
        )
        streamed = httpx.post(
            proxy.url + PATHS["openai_chat"],
            content=_chunks(orjson.dumps({**valid_body("openai_chat"), "stream": True}), 7),
            headers={"content-type": "application/json", "x-polar-session": "chunked"},
            timeout=60,
        )
        after = _post(proxy.url, "openai_chat", small, {"x-polar-session": "after"})
    for api, how, response in answers:
        assert response.status_code == 413, (api, how, response.text[:300])
        assert is_provider_error(api, 413, response.content), (api, how, response.text[:300])
        assert str(len(huge)) in response.json()["error"]["message"], (api, how, response.text[:300])
        # Anthropic's own 413 says request_too_large; OpenAI has no such type.
        expected = "request_too_large" if api == "anthropic_messages" else "invalid_request_error"
        assert response.json()["error"]["type"] == expected, (api, how, response.text[:300])
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["role"] == "assistant", plain.text[:300]
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-300:]
    assert after.status_code == 200, after.text[:300]
    assert upstream.requests == [], upstream.requests[:3]
    records = session_records(out, "chunked", at_least=2)
    assert [r.status for r in records] == ["ok", "ok"]
    assert [r.status for r in session_records(out, "after", at_least=1)] == ["ok"]
