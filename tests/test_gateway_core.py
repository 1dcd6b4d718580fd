"""The gateway's call handling in-process (no mitmproxy): real providers, the scripted engine on the
tiny model's tokenizer and template, and a real TraceStore."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
import pytest

from polar_addon.capture import Identity
from polar_addon.control import ControlPlane
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall
from polar_addon.store import StorageUnavailable, TraceStore, read_records

TOOL = {
    "name": "ls",
    "description": "List files.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


@pytest.fixture()
def script(tiny_model_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "script.json"
    # Arguments written with spaces, as models write them; Anthropic clients echo them back as objects.
    path.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "cycle": True,
                "turns": [
                    {
                        "content": "Let me look.",
                        "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}],
                    },
                    {"content": "There is one file."},
                ],
            }
        )
    )
    return path


def anthropic_call(session: str, messages: list, **body) -> IncomingCall:
    payload = {"model": "tiny", "max_tokens": 64, "tools": [TOOL], "messages": messages, **body}
    return IncomingCall(
        method="POST",
        path="/v1/messages?beta=true",
        headers={"user-agent": "claude-cli/2.1.197"},
        body=orjson.dumps(payload),
        identity=Identity(session_id=session, source="header"),
    )


async def _agent_loop(gateway: Gateway, session: str) -> list[dict]:
    messages: list[dict] = [{"role": "user", "content": "What is here?"}]
    reply = await gateway.handle(anthropic_call(session, messages))
    assert isinstance(reply, FullReply) and reply.status == 200, reply.body
    first = orjson.loads(reply.body)
    tool_use = next(b for b in first["content"] if b["type"] == "tool_use")
    assert tool_use["input"] == {"path": "."}
    messages += [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": "a.txt"}]},
    ]
    reply = await gateway.handle(anthropic_call(session, messages))
    assert reply.status == 200
    return messages


def test_tool_loop_prompts_stay_token_prefixes(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def main() -> None:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(out)))
        await _agent_loop(gateway, "loop-1")
        await gateway.close()

    asyncio.run(main())
    first, second = read_records(str(out))
    assert (first.seq, second.seq) == (0, 1) and first.finish_reason == "tool_calls"
    # The echoed tool input re-rendered to exactly the sampled tokens: the next prompt extends the last.
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids
    assert second.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"path": "."}'


def test_proxy_cap_is_recorded_as_length_but_ends_normally_for_the_client(tiny_model_dir: Path, tmp_path: Path) -> None:
    from polar_addon.engines.local import LocalEngine

    out = tmp_path / "shards"

    async def main() -> dict:
        gateway = Gateway(
            EnginePool([LocalEngine(str(tiny_model_dir))]), TraceStore(str(out)), GatewayConfig(max_tokens_cap=3)
        )
        reply = await gateway.handle(
            anthropic_call("cap-1", [{"role": "user", "content": "hi"}], temperature=0, max_tokens=500, tools=[])
        )
        await gateway.close()
        return orjson.loads(reply.body)

    body = asyncio.run(main())
    (record,) = read_records(str(out))
    assert record.max_tokens == 3 and len(record.response_ids) == 3 and record.finish_reason == "length"
    assert body["stop_reason"] == "end_turn" and body["usage"]["output_tokens"] == 3


def test_unwritable_store_answers_503_in_the_callers_shape(script: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "shards"

    async def main() -> FullReply:
        store = TraceStore(str(out))
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), store)

        def broken() -> None:
            raise StorageUnavailable("disk full")

        monkeypatch.setattr(store, "check_writable", broken)
        reply = await gateway.handle(anthropic_call("full-1", [{"role": "user", "content": "hi"}]))
        await gateway.close()
        return reply

    reply = asyncio.run(main())
    body = orjson.loads(reply.body)
    assert reply.status == 503 and body["type"] == "error" and "disk full" in body["error"]["message"]


def test_session_rows_are_remembered_within_a_bound(script: Path, tmp_path: Path, monkeypatch) -> None:
    """One "running" row per session while remembered; the memory of sessions stays bounded."""
    import polar_addon.gateway as gateway_module
    from polar_addon.store import read_table

    monkeypatch.setattr(gateway_module, "MAX_SEEN_SESSIONS", 2)
    out = tmp_path / "shards"

    async def main() -> None:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(out)))
        for session in ("a", "a", "b", "a", "c", "b"):  # "b" was pushed out by "c"
            reply = await gateway.handle(anthropic_call(session, [{"role": "user", "content": "hi"}]))
            assert reply.status == 200
        assert list(gateway._seen_sessions) == ["c", "b"]
        await gateway.close()

    asyncio.run(main())
    rows = read_table(str(out), "sessions").to_pylist()
    assert sorted(r["session_id"] for r in rows) == ["a", "b", "b", "c"]


@pytest.mark.parametrize(
    "client_max,proxy_cut,finish,seen",
    [
        (7, True, "length", "length"),  # the client's own limit was reached exactly: its own overflow
        (6, True, "length", "length"),
        (8, True, "length", "stop"),  # cut below what the client allowed: ends normally
        (None, True, "length", "stop"),  # the client set no limit; only the proxy's cap cut it
        (8, False, "length", "length"),  # no proxy cap in force: nothing to hide
        (8, True, "stop", "stop"),
    ],
)
def test_the_client_sees_length_only_when_its_own_limit_was_reached(client_max, proxy_cut, finish, seen) -> None:
    from polar_addon.canonical import CanonicalRequest
    from tests.support.providers import completion

    request = CanonicalRequest(api="anthropic_messages", model="tiny", messages=[])
    if proxy_cut:
        request.extra["client_max_tokens"] = client_max
    comp = completion(finish_reason=finish)  # 7 response tokens
    assert len(comp.response_ids) == 7
    assert Gateway._as_client_sees(request, comp).finish_reason == seen
    assert comp.finish_reason == finish  # the record keeps what the engine said


def test_a_session_that_ends_frees_its_engine_slot(script: Path, tmp_path: Path) -> None:
    """Least-loaded assignment counts live sessions: one that posted its final status no longer counts."""
    second = tmp_path / "script2.json"
    second.write_bytes(script.read_bytes())
    out = tmp_path / "shards"

    async def main() -> None:
        pool = EnginePool([ScriptedEngine(str(script)), ScriptedEngine(str(second))])
        gateway = Gateway(pool, TraceStore(str(out)))
        for session in ("a", "b", "c"):  # e0, e1, e0
            assert (await gateway.handle(anthropic_call(session, [{"role": "user", "content": "hi"}]))).status == 200
        # The addon wires the control plane to the pool this way.
        control = ControlPlane(gateway.store, "t" * 32, on_session_end=pool.release)
        status, _ = await control.handle("POST", "/sessions/a/status", "Bearer " + "t" * 32, b'{"status": "completed"}')
        assert status == 200
        assert (await gateway.handle(anthropic_call("d", [{"role": "user", "content": "hi"}]))).status == 200
        await gateway.close()

    asyncio.run(main())
    engines = {r.session_id: r.engine for r in read_records(str(out))}
    assert engines["a"] == engines["c"] == engines["d"] == f"scripted:{script}"
    assert engines["b"] == f"scripted:{second}"


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_bug_is_a_502_in_the_callers_shape_and_a_failed_record(
    script: Path, tmp_path: Path, stream: bool
) -> None:
    out = tmp_path / "shards"

    async def main() -> tuple[int, bytes]:
        engine = ScriptedEngine(str(script))

        async def broken(request):
            await asyncio.sleep(0.3)  # past the first keep-alive when streaming
            raise KeyError("choices")

        engine.complete = broken  # type: ignore[method-assign]
        gateway = Gateway(EnginePool([engine]), TraceStore(str(out)), GatewayConfig(keepalive_s=0.05))
        reply = await gateway.handle(anthropic_call("bug", [{"role": "user", "content": "hi"}], stream=stream))
        if isinstance(reply, FullReply):
            body = reply.body
        else:
            body = b"".join([chunk async for chunk in reply.chunks])
        await gateway.close()
        return reply.status, body

    status, body = asyncio.run(main())
    if stream:
        # Headers (200) left with the first keep-alive; the stream ends in Anthropic's error event.
        assert status == 200 and body.startswith(b"event: ping")
        event, data = body.rstrip(b"\n").split(b"\n")[-2:]
        assert event == b"event: error"
        error = orjson.loads(data.removeprefix(b"data: "))
    else:
        assert status == 502
        error = orjson.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    [record] = read_records(str(out))
    assert record.status == "failed" and record.error.startswith("502 api_error") and "KeyError" in record.error
