"""The gateway's own decisions, one at a time, in-process: what it refuses before the engine and how
(status, the caller's error shape, the failed record), the max_tokens cap, the stream's two paths, what it
remembers per session and its small helpers. Real providers, the scripted engine on the tiny model's
tokenizer, a real TraceStore."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

import polar_addon.gateway as gateway_module
from polar_addon.canonical import ContextLengthExceeded, EngineFault, PolarError, ToolCall
from polar_addon.capture import Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.gateway import (
    FullReply,
    Gateway,
    GatewayConfig,
    IncomingCall,
    StreamReply,
    _canonical_arguments,
    _json_depth,
    _printable_headers,
    _response_id,
)
from polar_addon.providers import all_providers
from polar_addon.store import StorageUnavailable, TraceStore, read_records, read_table
from tests.support.providers import completion

MESSAGES = "/v1/messages"
CHAT = "/v1/chat/completions"


@pytest.fixture()
def script(tiny_model_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "Hi there."}]}))
    return path


def call(path: str, body: Any, session: str = "s1", raw: bytes | None = None) -> IncomingCall:
    return IncomingCall(
        method="POST",
        path=path,
        headers={"user-agent": "claude-cli/2.1.197"},
        body=raw if raw is not None else orjson.dumps(body),
        identity=Identity(session_id=session, source="header"),
    )


def anthropic(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **body}


def run(script: Path, out: Path, steps, config: GatewayConfig | None = None) -> Any:
    """Run ``steps(gateway)`` against a fresh gateway, closing it (and flushing the store) after."""

    async def main() -> Any:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(out)), config)
        try:
            return await steps(gateway)
        finally:
            await gateway.close()

    return asyncio.run(main())


# ---------------------------------------------------------------- helpers


def test_json_depth_counts_levels_and_stops_past_the_limit() -> None:
    assert [_json_depth(v, 10) for v in ({}, [], {"a": 1}, {"a": [1, {"b": []}]}, [[], [[[]]]])] == [1, 1, 1, 4, 4]
    deep: Any = []
    for _ in range(50):
        deep = [deep]
    assert _json_depth(deep, 100) == 51
    assert _json_depth(deep, 5) == 6  # counted only up to limit + 1
    assert _json_depth({"a": {"b": 1}, "c": [[1]]}, 2) == 3


def test_canonical_arguments_sort_keys_and_keep_what_is_not_json() -> None:
    assert _canonical_arguments('{"b": 1, "a": {"d": 2, "c": 3}}') == '{"a":{"c":3,"d":2},"b":1}'
    assert _canonical_arguments("not json") == "not json"
    assert _canonical_arguments("") == ""


def test_header_values_become_printable_text() -> None:
    assert _printable_headers({"user-agent": "ok", "x": "caf\udcc3\udca9 \udcff"}) == {
        "user-agent": "ok",
        "x": "café \ufffd",
    }


def test_response_ids_in_each_providers_shape() -> None:
    ids = {p.name: _response_id(p) for p in all_providers()}
    prefixes = {"openai_chat": "chatcmpl-", "anthropic_messages": "msg_", "openai_responses": "resp_", "gemini": ""}
    for name, prefix in prefixes.items():
        assert ids[name].startswith(prefix) and len(ids[name]) == len(prefix) + 24
        int(ids[name][len(prefix) :], 16)


# ---------------------------------------------------------------- refused before the engine


def test_requests_refused_before_the_engine(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    deep: Any = "x"
    for _ in range(gateway_module.MAX_JSON_DEPTH - 2):  # the body object and "metadata" make two more levels
        deep = [deep]

    async def steps(gateway: Gateway) -> list[tuple[int, Any]]:
        assert gateway.owns("POST", MESSAGES) and not gateway.owns("POST", "/v1/embeddings")
        replies = [
            await gateway.handle(call("/v1/embeddings", {})),
            await gateway.handle(call(MESSAGES, None, raw=b"x" * 1001)),
            await gateway.handle(call(MESSAGES, None, raw=b"{nope")),
            await gateway.handle(call(MESSAGES, [1])),
            await gateway.handle(call(MESSAGES, None, raw=b"")),
            await gateway.handle(call(CHAT, {"model": "m", "messages": [], "metadata": [deep]})),
            await gateway.handle(call(CHAT, {"model": "m", "messages": [], "metadata": [[deep]]})),
        ]
        assert all(isinstance(r, FullReply) and r.content_type == "application/json" for r in replies)
        return [(r.status, orjson.loads(r.body)) for r in replies]

    got = run(script, out, steps, GatewayConfig(max_body_bytes=1000))
    assert got[0] == (
        404,
        {"error": {"type": "not_found", "message": "polar: no provider route for POST /v1/embeddings"}},
    )
    assert got[1] == (
        413,
        {
            "type": "error",
            "error": {
                "type": "request_too_large",
                "message": "request body of 1001 bytes exceeds the proxy limit of 1000",
            },
        },
    )
    status, body = got[2]
    assert status == 400 and body["error"]["message"].startswith("request body is not valid JSON: ")
    assert (
        got[3]
        == got[4]
        == (
            400,
            {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "request body must be a JSON object"},
            },
        )
    )
    # A body of exactly MAX_JSON_DEPTH levels reaches the translator (which wants messages); one more does not.
    assert got[5][0] == 400 and got[5][1]["error"]["message"] != "request body is nested deeper than 128 levels"
    assert got[6] == (
        400,
        {
            "error": {
                "message": "request body is nested deeper than 128 levels",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        },
    )
    records = read_records(str(out))
    # Every refused call of a provider route is recorded as failed, with its status and kind.
    assert [r.error.split(":")[0] for r in records] == [
        "413 request_too_large",
        "400 invalid_request",
        "400 invalid_request",
        "400 invalid_request",
        "400 invalid_request",
        "400 invalid_request",
    ]
    assert all(r.status == "failed" and r.api in ("anthropic_messages", "openai_chat") for r in records)
    [session] = read_table(str(out), "sessions").to_pylist()
    assert (session["session_id"], session["status"], session["harness"]) == ("s1", "running", "claude-cli/2.1.197")


def test_error_reply_uses_the_owners_shape_or_a_plain_one(script: Path, tmp_path: Path) -> None:
    async def steps(gateway: Gateway) -> list[FullReply]:
        err = PolarError(429, "overloaded", "busy")
        return [gateway.error_reply("POST", MESSAGES, err), gateway.error_reply("POST", "/other", err)]

    owned, other = run(script, tmp_path / "shards", steps)
    assert (owned.status, orjson.loads(owned.body)) == (
        429,
        {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
    )
    assert (other.status, orjson.loads(other.body)) == (429, {"error": {"type": "overloaded", "message": "busy"}})


def test_an_unexpected_error_is_a_500_in_the_callers_shape_and_a_failed_record(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> FullReply:
        async def broken(incoming: IncomingCall) -> Any:
            raise RuntimeError("bug")

        gateway._handle = broken  # type: ignore[method-assign]
        assert (await gateway.handle(call("/v1/embeddings", {}))).status == 500  # no provider: nothing to record
        return await gateway.handle(call(MESSAGES, anthropic()))

    reply = run(script, out, steps)
    assert (reply.status, orjson.loads(reply.body)) == (
        500,
        {"type": "error", "error": {"type": "api_error", "message": "polar internal error (RuntimeError)"}},
    )
    [record] = read_records(str(out))
    assert (record.status, record.api, record.error) == (
        "failed",
        "anthropic_messages",
        "500 api_error: polar internal error (RuntimeError)",
    )


# ---------------------------------------------------------------- the cap, the record, the stream


def test_max_tokens_cap_clamps_and_fills_in(script: Path, tmp_path: Path) -> None:
    async def steps(gateway: Gateway) -> list[tuple[Any, Any]]:
        provider, route = gateway.match("POST", CHAT)
        seen = []
        for body in (
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5},
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6},
        ):
            request = gateway._parse(provider, route, call(CHAT, body))
            seen.append((request.sampling.max_tokens, request.extra.get("client_max_tokens", "absent")))
        return seen

    assert run(script, tmp_path / "a", steps, GatewayConfig(max_tokens_cap=5)) == [(5, None), (3, 3), (5, 5), (5, 6)]
    assert run(script, tmp_path / "b", steps, GatewayConfig(max_tokens_cap=0)) == [
        (None, "absent"),
        (3, "absent"),
        (5, "absent"),
        (6, "absent"),
    ]


def test_a_counted_overflow_is_recorded_with_its_counts(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> None:
        await gateway._record_failure(
            call(MESSAGES, {}, session="o1"),
            "anthropic_messages",
            None,
            ContextLengthExceeded("too long", prompt_tokens=9000, window=8192),
        )
        await gateway._record_failure(
            call(MESSAGES, {}, session="o2"), "anthropic_messages", None, ContextLengthExceeded("too long", window=8192)
        )

    run(script, out, steps)
    assert [r.error for r in read_records(str(out))] == [
        "400 context_length_exceeded: prompt_tokens=9000 window=8192: too long",
        "400 context_length_exceeded: too long",
    ]


def test_stream_answered_whole_when_ready_else_kept_alive(script: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    slow = tmp_path / "slow.json"
    slow.write_text(
        json.dumps(
            {"model_dir": str(tiny_model_dir), "cycle": True, "latency_s": 0.3, "turns": [{"content": "Hi there."}]}
        )
    )

    async def main(path: Path, keepalive_s: float) -> tuple[FullReply | StreamReply, bytes]:
        gateway = Gateway(
            EnginePool([ScriptedEngine(str(path))]),
            TraceStore(str(tmp_path / f"shards-{keepalive_s}")),
            GatewayConfig(keepalive_s=keepalive_s),
        )
        reply = await gateway.handle(call(MESSAGES, anthropic(stream=True)))
        body = reply.body if isinstance(reply, FullReply) else b"".join([c async for c in reply.chunks])
        await gateway.close()
        return reply, body

    fast, fast_body = asyncio.run(main(script, 30.0))
    assert isinstance(fast, FullReply) and (fast.status, fast.content_type) == (200, "text/event-stream")
    assert fast_body.startswith(b"event: message_start\n") and fast_body.endswith(
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    kept, kept_body = asyncio.run(main(slow, 0.05))
    assert isinstance(kept, StreamReply) and (kept.status, kept.content_type) == (200, "text/event-stream")
    ping = b'event: ping\ndata: {"type": "ping"}\n\n'
    # Pings while the engine works, then the very events of the answer (message ids differ per call).
    assert kept_body.startswith(ping + ping) and kept_body.count(b"event: message_start") == 1
    fast_id, kept_id = (b.split(b'"id":"')[1].split(b'"')[0] for b in (fast_body, kept_body))
    assert kept_body.replace(ping, b"") == fast_body.replace(fast_id, kept_id)


def test_a_store_that_refuses_the_record(script: Path, tmp_path: Path, caplog) -> None:
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> list[tuple[int, Any]]:
        real_append = gateway.store.append
        failures = iter(
            [StorageUnavailable("disk full"), ValueError("column overflow"), StorageUnavailable("disk full")]
        )

        async def append(record: Any) -> None:
            if record.status == "ok":
                raise next(failures)
            await real_append(record)

        gateway.store.append = append  # type: ignore[method-assign]
        with caplog.at_level("ERROR", logger="polar"):
            replies = [await gateway.handle(call(MESSAGES, anthropic(), session=s)) for s in ("s1", "s2")]
        # OpenAI's error carries the kind as its code (Anthropic's type is api_error for both).
        replies.append(await gateway.handle(call(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]})))
        return [(r.status, orjson.loads(r.body)["error"]) for r in replies]

    assert run(script, out, steps) == [
        (503, {"type": "api_error", "message": "polar could not persist this call (disk full); retry later"}),
        (500, {"type": "api_error", "message": "polar could not record this call (ValueError)"}),
        (
            503,
            {
                "type": "server_error",
                "code": "storage_unavailable",
                "param": None,
                "message": "polar could not persist this call (disk full); retry later",
            },
        ),
    ]
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("polar: the store refused a record of session s2", True)
    ]
    [failed] = read_records(str(out))
    assert (failed.session_id, failed.api, failed.error) == (
        "s2",
        "anthropic_messages",
        "500 api_error: polar could not record this call (ValueError)",
    )


# ---------------------------------------------------------------- what the gateway remembers


def test_sampled_arguments_are_remembered_per_session_within_bounds(script: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gateway_module, "MAX_REMEMBERED_CALLS", 2)
    monkeypatch.setattr(gateway_module, "MAX_REMEMBERED_SESSIONS", 2)

    async def steps(gateway: Gateway) -> None:
        calls = [ToolCall(f"c{i}", "ls", f'{{"n": {i}}}') for i in range(3)]
        gateway._remember_sampled_arguments("a", completion(tool_calls=calls))
        assert list(gateway._sampled_arguments["a"].items()) == [
            (("ls", '{"n":1}'), '{"n": 1}'),
            (("ls", '{"n":2}'), '{"n": 2}'),
        ]
        gateway._remember_sampled_arguments("b", completion(tool_calls=calls[:1]))
        gateway._remember_sampled_arguments("none", completion())  # no calls: nothing to remember
        gateway._remember_sampled_arguments("a", completion(tool_calls=calls[:1]))  # "a" used again: "b" is older
        gateway._remember_sampled_arguments("c", completion(tool_calls=calls[:1]))
        assert list(gateway._sampled_arguments) == ["a", "c"]
        # The history's re-serialized arguments get the sampled text back; others are left alone.
        provider, route = gateway.match("POST", MESSAGES)
        history = anthropic(
            messages=[
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "ls", "input": {"n": 0}},
                        {"type": "tool_use", "id": "t2", "name": "ls", "input": {"n": 2}},
                        {"type": "tool_use", "id": "t3", "name": "cat", "input": {"n": 0}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": t, "content": "ok"} for t in ("t1", "t2", "t3")],
                },
            ]
        )
        request = gateway._parse(provider, route, call(MESSAGES, history, session="a"))
        assert [c["function"]["arguments"] for c in request.messages[1]["tool_calls"]] == [
            '{"n": 0}',
            '{"n": 2}',
            '{"n":0}',
        ]
        other = gateway._parse(provider, route, call(MESSAGES, history, session="zzz"))
        assert [c["function"]["arguments"] for c in other.messages[1]["tool_calls"]] == [
            '{"n":0}',
            '{"n":2}',
            '{"n":0}',
        ]

    run(script, tmp_path / "shards", steps)


def test_sessions_of_a_lost_engine_end_as_error(script: Path, tmp_path: Path, caplog) -> None:
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> None:
        await gateway._end_lost_sessions(["x", "y"], "vllm:a")
        real_update = gateway.store.session_update

        async def full(session: str, **fields: Any) -> None:
            if session == "z":
                raise StorageUnavailable("disk full")
            await real_update(session, **fields)

        gateway.store.session_update = full  # type: ignore[method-assign]
        with caplog.at_level("WARNING", logger="polar"):
            await gateway._end_lost_sessions(["z", "w"], "vllm:b")  # one refused: the others still end
        assert [r.getMessage() for r in caplog.records] == [
            "polar: could not end session 'z' of a lost engine: disk full"
        ]

    run(script, out, steps)
    rows = {r["session_id"]: r for r in read_table(str(out), "sessions").to_pylist()}
    assert sorted(rows) == ["w", "x", "y"]
    for session, engine in (("x", "vllm:a"), ("y", "vllm:a"), ("w", "vllm:b")):
        assert rows[session]["status"] == "error" and rows[session]["ended_at"] is not None
        assert orjson.loads(rows[session]["metadata_json"]) == {"error": f"engine {engine} taken out mid-session"}


def test_a_failed_engine_call_is_recorded_with_the_call_it_was(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    incoming = call(MESSAGES, anthropic(max_tokens=12), session="f1")

    async def steps(gateway: Gateway) -> FullReply:
        async def overloaded(request: Any) -> Any:
            raise PolarError(503, "overloaded", "engine busy")

        gateway.pool.engines[0].complete = overloaded  # type: ignore[method-assign]
        return await gateway.handle(incoming)

    reply = run(script, out, steps)
    assert (reply.status, orjson.loads(reply.body)) == (
        503,
        {"type": "error", "error": {"type": "overloaded_error", "message": "engine busy"}},
    )
    [record] = read_records(str(out))
    assert (record.status, record.seq, record.api, record.error) == (
        "failed",
        0,
        "anthropic_messages",
        "503 overloaded: engine busy",
    )
    assert (record.engine, record.harness, record.started_at) == (
        f"scripted:{script}",
        "claude-cli/2.1.197",
        incoming.started_at,
    )
    assert (record.requested_model, record.max_tokens, orjson.loads(record.messages_json)) == (
        "tiny",
        12,
        [{"role": "user", "content": "hi"}],
    )


def test_slow_streams_keep_alive_in_each_providers_words(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    slow = tmp_path / "slow.json"
    slow.write_text(
        json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "latency_s": 0.3, "turns": [{"content": "Hi."}]})
    )

    async def main(gateway: Gateway, incoming: IncomingCall) -> bytes:
        reply = await gateway.handle(incoming)
        assert isinstance(reply, StreamReply)
        return b"".join([c async for c in reply.chunks])

    async def both() -> tuple[bytes, bytes]:
        gateway = Gateway(
            EnginePool([ScriptedEngine(str(slow))]),
            TraceStore(str(tmp_path / "shards")),
            GatewayConfig(keepalive_s=0.05),
        )
        responses = await main(gateway, call("/v1/responses", {"model": "tiny", "input": "hi", "stream": True}))
        provider, _ = gateway.match("POST", MESSAGES)

        def broken(*args: Any) -> Any:
            raise ValueError("cannot render")

        monkeypatch.setattr(provider, "render_stream", broken)
        with caplog.at_level("ERROR", logger="polar"):
            failed = await main(gateway, call(MESSAGES, anthropic(stream=True)))
        await gateway.close()
        return responses, failed

    responses, failed = asyncio.run(both())
    # Responses: the keep-alives are the stream's own prelude, then in_progress; numbering runs on unbroken.
    events = [orjson.loads(line[6:]) for line in responses.split(b"\n") if line.startswith(b"data: ")]
    assert [e["type"] for e in events[:3]] == ["response.created", "response.in_progress", "response.in_progress"]
    assert [e["sequence_number"] for e in events] == list(range(len(events))) and events[-1][
        "type"
    ] == "response.completed"
    assert (
        events[0]["response"]["model"] == "tiny" and events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi."
    )
    # A rendering failure after the headers: the stream ends in the provider's own error event, and it is logged.
    ping = b'event: ping\ndata: {"type": "ping"}\n\n'
    assert failed.startswith(ping) and failed.replace(ping, b"") == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        b'"message":"polar internal error (ValueError)"}}\n\n'
    )
    assert [r.getMessage() for r in caplog.records] == ["polar: rendering a stream failed"]


def test_a_stream_that_fails_to_render_tells_its_status_in_geminis_words(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Gemini's error object carries the HTTP status (``code``): a rendering failure after the headers is a 500."""
    slow = tmp_path / "slow.json"
    slow.write_text(
        json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "latency_s": 0.2, "turns": [{"content": "Hi."}]})
    )
    path = "/v1beta/models/tiny:streamGenerateContent?alt=sse"

    async def main() -> bytes:
        gateway = Gateway(
            EnginePool([ScriptedEngine(str(slow))]),
            TraceStore(str(tmp_path / "shards")),
            GatewayConfig(keepalive_s=0.05),
        )
        provider, _ = gateway.match("POST", path)

        def broken(*args: Any) -> Any:
            raise ValueError("cannot render")

        monkeypatch.setattr(provider, "render_stream", broken)
        reply = await gateway.handle(call(path, {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}))
        assert isinstance(reply, StreamReply)
        body = b"".join([c async for c in reply.chunks])
        await gateway.close()
        return body

    body = asyncio.run(main())
    assert (
        body.lstrip(b"\n")
        == b'data: {"error":{"code":500,"message":"polar internal error (ValueError)","status":"INTERNAL"}}\n\n'
    )


# ---------------------------------------------------------------- engine failures, end to end in-process


PI_SYSTEM = "You are an expert coding assistant operating inside pi, a coding agent harness. Be brief."


def test_an_engine_taken_out_ends_its_sessions_and_refuses_their_next_calls(script: Path, tmp_path: Path) -> None:
    """Two engines, one strike takes one out: the sessions on it end as error, and a later call of one of them is
    refused in the caller's shape and recorded as the failed call it was (its request, its harness)."""
    out = tmp_path / "shards"
    second = tmp_path / "script2.json"
    second.write_bytes(script.read_bytes())

    async def steps(gateway: Gateway) -> list[tuple[int, Any]]:
        first = gateway.pool.engines[0]
        replies = [await gateway.handle(call(MESSAGES, anthropic(), session=s)) for s in ("a", "b")]  # e0, e1

        async def unreachable(request: Any) -> Any:
            raise EngineFault(502, "api_error", "engine unreachable", refused=True)

        first.complete = unreachable  # type: ignore[method-assign]
        replies.append(await gateway.handle(call(MESSAGES, anthropic(), session="c")))  # e0 (tie on load): it fails
        replies.append(await gateway.handle(call(MESSAGES, anthropic(max_tokens=9), session="a")))  # its engine is out
        return [(r.status, orjson.loads(r.body)) for r in replies]

    pool = EnginePool([ScriptedEngine(str(script)), ScriptedEngine(str(second))], max_strikes=1)

    async def main() -> list[tuple[int, Any]]:
        gateway = Gateway(pool, TraceStore(str(out)))
        try:
            return await steps(gateway)
        finally:
            await gateway.close()

    replies = asyncio.run(main())
    assert [status for status, _ in replies] == [200, 200, 502, 502]
    assert replies[2][1] == {"type": "error", "error": {"type": "api_error", "message": "engine unreachable"}}
    assert replies[3][1]["error"]["message"].startswith("the engine serving this session was taken out after failing")
    rows = {r["session_id"]: r for r in read_table(str(out), "sessions").to_pylist()}
    for session in ("a", "c"):  # both were on the engine taken out
        assert rows[session]["status"] == "error" and rows[session]["ended_at"] is not None
        assert orjson.loads(rows[session]["metadata_json"]) == {
            "error": f"engine scripted:{script} taken out mid-session"
        }
    assert rows["b"]["status"] == "running"
    failed = sorted((r for r in read_records(str(out)) if r.status == "failed"), key=lambda r: r.session_id)
    assert [(r.session_id, r.api, r.engine) for r in failed] == [
        ("a", "anthropic_messages", None),
        ("c", "anthropic_messages", f"scripted:{script}"),
    ]
    refused = failed[0]
    assert refused.error.startswith("502 api_error: the engine serving this session was taken out")
    assert (refused.seq, refused.requested_model, refused.max_tokens, refused.harness) == (
        1,
        "tiny",
        9,
        "claude-cli/2.1.197",
    )
    assert orjson.loads(refused.messages_json) == [{"role": "user", "content": "hi"}]


def test_an_engine_bug_or_an_unusable_logprob_is_recorded_with_the_engine_and_the_call(
    script: Path, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> list[tuple[int, Any]]:
        engine = gateway.pool.engines[0]
        real_complete = engine.complete

        async def broken(request: Any) -> Any:
            raise KeyError("choices")

        async def nan_logprob(request: Any) -> Any:
            done = await real_complete(request)
            return replace(done, logprobs=[float("nan"), *done.logprobs[1:]])

        replies = []
        for fault, session in ((broken, "bug"), (nan_logprob, "nan")):
            engine.complete = fault  # type: ignore[method-assign]
            with caplog.at_level("ERROR", logger="polar"):
                replies.append(await gateway.handle(call(MESSAGES, anthropic(max_tokens=7), session=session)))
        return [(r.status, orjson.loads(r.body)) for r in replies]

    replies = run(script, out, steps)
    engine = f"scripted:{script}"
    unusable = f"engine {engine} answered an unusable logprob: token 0 has logprob nan (not finite)"
    assert replies == [
        (
            502,
            {"type": "error", "error": {"type": "api_error", "message": "engine error (KeyError); see the proxy log"}},
        ),
        (502, {"type": "error", "error": {"type": "api_error", "message": unusable}}),
    ]
    # The engine's own words (they may name its URL) stay in the proxy log, with the engine named.
    assert [r.getMessage() for r in caplog.records] == [f"polar: engine {engine} failed"]
    records = sorted(read_records(str(out)), key=lambda r: r.session_id)
    assert [(r.session_id, r.status, r.error) for r in records] == [
        ("bug", "failed", "502 api_error: engine error (KeyError); see the proxy log"),
        ("nan", "failed", f"502 api_error: {unusable}"),
    ]  # sorted by session
    for record in records:
        assert (record.api, record.engine, record.requested_model, record.max_tokens) == (
            "anthropic_messages",
            engine,
            "tiny",
            7,
        )
        assert orjson.loads(record.messages_json) == [{"role": "user", "content": "hi"}]


def test_a_harness_named_by_its_system_prompt_is_recorded_on_the_session_and_on_a_failed_call(
    script: Path, tmp_path: Path
) -> None:
    """Pi speaks through the SDK's User-Agent; its system prompt names it, on the session row and on each record."""
    out = tmp_path / "shards"

    def pi_call(session: str) -> IncomingCall:
        incoming = call(MESSAGES, anthropic(system=PI_SYSTEM), session=session)
        return replace(incoming, headers={"user-agent": "Anthropic/JS 0.60.0"})

    async def steps(gateway: Gateway) -> list[int]:
        statuses = [(await gateway.handle(pi_call("ok"))).status]

        async def busy(request: Any) -> Any:
            raise PolarError(503, "overloaded", "engine busy")

        gateway.pool.engines[0].complete = busy  # type: ignore[method-assign]
        statuses.append((await gateway.handle(pi_call("busy"))).status)
        return statuses

    assert run(script, out, steps) == [200, 503]
    pi = "pi (Anthropic/JS 0.60.0)"
    assert {r["session_id"]: r["harness"] for r in read_table(str(out), "sessions").to_pylist()} == {
        "ok": pi,
        "busy": pi,
    }
    assert sorted((r.session_id, r.status, r.harness) for r in read_records(str(out))) == [
        ("busy", "failed", pi),
        ("ok", "ok", pi),
    ]


def test_a_failed_call_whose_record_cannot_be_stored_is_logged(script: Path, tmp_path: Path, caplog) -> None:
    """The failure is answered either way; losing its record is said in the log, with the session."""
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> list[int]:
        failures = iter([StorageUnavailable("disk full"), ValueError("column overflow")])

        async def append(record: Any) -> None:
            raise next(failures)

        gateway.store.append = append  # type: ignore[method-assign]
        with caplog.at_level("WARNING", logger="polar"):
            return [(await gateway.handle(call(MESSAGES, None, raw=b"{nope", session=s))).status for s in ("w1", "w2")]

    assert run(script, out, steps) == [400, 400]
    assert [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("WARNING", "polar: could not record failed call for session 'w1': disk full", False),
        ("ERROR", "polar: could not record failed call for session 'w2'", True),
    ]


def test_an_engine_error_after_the_keepalives_ends_a_responses_stream_in_its_failed_event(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Headers are out: the engine's own error (its kind, its message) is told as ``response.failed``, numbered
    on from the keep-alives and naming the response the prelude announced."""
    slow = tmp_path / "slow.json"
    slow.write_text(
        json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "latency_s": 0.2, "turns": [{"content": "Hi."}]})
    )

    async def main() -> bytes:
        gateway = Gateway(
            EnginePool([ScriptedEngine(str(slow))]),
            TraceStore(str(tmp_path / "shards")),
            GatewayConfig(keepalive_s=0.05),
        )
        engine = gateway.pool.engines[0]

        async def busy(request: Any) -> Any:
            await asyncio.sleep(0.2)  # past the first keep-alives
            raise PolarError(503, "overloaded", "engine busy")

        engine.complete = busy  # type: ignore[method-assign]
        reply = await gateway.handle(call("/v1/responses", {"model": "tiny", "input": "hi", "stream": True}))
        assert isinstance(reply, StreamReply)
        body = b"".join([c async for c in reply.chunks])
        await gateway.close()
        return body

    events = [orjson.loads(line[6:]) for line in asyncio.run(main()).split(b"\n") if line.startswith(b"data: ")]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed["type"] == "response.failed" and events[-2]["type"] == "response.in_progress"
    assert failed["response"]["id"] == events[0]["response"]["id"] and failed["response"]["model"] == "tiny"
    assert failed["response"]["error"] == {"code": "server_is_overloaded", "message": "engine busy"}


def test_a_continued_session_hands_the_engine_its_planned_token_prompt(script: Path, tmp_path: Path) -> None:
    """Token continuity: the second call of a session continues the first one's tokens, and the engine is given
    exactly that prompt (recorded as a continuity prompt); another session starts fresh."""
    out = tmp_path / "shards"
    given: list[list[int]] = []

    async def steps(gateway: Gateway) -> None:
        engine = gateway.pool.engines[0]
        real = engine.complete_tokens

        async def spy(request: Any, prompt_ids: list[int]) -> Any:
            given.append(list(prompt_ids))
            return await real(request, prompt_ids)

        engine.complete_tokens = spy  # type: ignore[method-assign]
        first = orjson.loads((await gateway.handle(call(MESSAGES, anthropic(), session="t"))).body)
        history = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": "and then?"},
        ]
        for session in ("t", "u"):
            assert (await gateway.handle(call(MESSAGES, anthropic(messages=history), session=session))).status == 200
        # The continued chain replaces the one it continued: one chain per session, holding the whole history.
        [chain] = gateway.tito.chains("t")
        assert len(chain.request.messages) == 3 and chain.engine == engine.name

    run(script, out, steps)
    first, continued, other = sorted(read_records(str(out)), key=lambda r: (r.session_id, r.seq))
    assert [(r.session_id, r.prompt_source, r.prompt_reason) for r in (first, continued, other)] == [
        ("t", "fresh", "first_call"),
        ("t", "continuity", "continues"),
        ("u", "fresh", "state_lost"),
    ]
    assert given == [continued.prompt_ids]
    for record in (first, continued, other):  # what every answered call records besides its tokens
        assert record.harness == "claude-cli/2.1.197" and record.started_at <= record.finished_at
        assert 0 <= record.engine_latency_s <= record.finished_at - record.started_at
    assert (
        continued.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids
    )


@pytest.mark.parametrize(
    ("tito", "token_input", "reason"), [("off", True, "tito_off"), ("auto", False, "no_token_input")]
)
def test_without_token_continuity_every_call_is_rendered_fresh_and_says_why(
    script: Path, tmp_path: Path, tito: str, token_input: bool, reason: str
) -> None:
    """``polar_tito=off``, or an engine that takes no token prompt: each call is rendered in full (never through
    ``complete_tokens``), recorded as fresh with the reason, and no chain is kept for the session."""
    out = tmp_path / "shards"
    given: list[list[int]] = []

    async def steps(gateway: Gateway) -> Any:
        engine = gateway.pool.engines[0]
        real = engine.complete_tokens

        async def spy(request: Any, prompt_ids: list[int]) -> Any:
            given.append(list(prompt_ids))
            return await real(request, prompt_ids)

        engine.complete_tokens = spy if token_input else None  # type: ignore[method-assign]
        first = orjson.loads((await gateway.handle(call(MESSAGES, anthropic(), session="t"))).body)
        history = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": "and then?"},
        ]
        assert (await gateway.handle(call(MESSAGES, anthropic(messages=history), session="t"))).status == 200
        return gateway.tito.chains("t")

    assert run(script, out, steps, GatewayConfig(tito=tito)) == []
    assert given == []
    assert [(r.prompt_source, r.prompt_reason) for r in read_records(str(out))] == [("fresh", reason)] * 2


# ---------------------------------------------------------------- routes and shapes the engine never sees


def test_claude_codes_account_calls_are_answered_locally(script: Path, tmp_path: Path) -> None:
    from polar_addon.providers.anthropic_messages import POLICY_LIMITS_BODY

    async def steps(gateway: Gateway) -> list[tuple[int, Any]]:
        replies = [
            await gateway.handle(IncomingCall("GET", path, {}, b"", Identity(session_id="s1", source="header")))
            for path in ("/api/claude_code/policy_limits?x=1", "/api/oauth/profile")
        ]
        return [(r.status, orjson.loads(r.body)) for r in replies]

    out = tmp_path / "shards"
    assert run(script, out, steps) == [
        (200, POLICY_LIMITS_BODY),
        (
            404,
            {
                "type": "error",
                "error": {"type": "not_found_error", "message": "/api/oauth/profile is not served by polar"},
            },
        ),
    ]
    assert read_records(str(out)) == []  # not a model call: nothing recorded


def test_count_tokens_asks_the_sessions_own_engine(script: Path, tmp_path: Path) -> None:
    """``/v1/messages/count_tokens``: the count of the engine the session is on, in Anthropic's shape; an engine
    error in the caller's shape; nothing recorded."""
    second = tmp_path / "script2.json"
    second.write_bytes(script.read_bytes())
    out = tmp_path / "shards"
    counting = "/v1/messages/count_tokens"

    async def main() -> list[tuple[int, Any]]:
        pool = EnginePool([ScriptedEngine(str(script)), ScriptedEngine(str(second))])
        gateway = Gateway(pool, TraceStore(str(out)))
        replies = [await gateway.handle(call(counting, anthropic(), session=s)) for s in ("a", "b")]  # e0, e1
        seen: list[Any] = []

        async def counted(request: Any) -> int:
            seen.append(request.messages)
            return 4242

        async def busy(request: Any) -> int:
            raise PolarError(503, "overloaded", "engine busy")

        pool.engines[1].count_tokens = counted  # type: ignore[method-assign]
        replies.append(await gateway.handle(call(counting, anthropic(), session="b")))
        pool.engines[0].count_tokens = busy  # type: ignore[method-assign]
        replies.append(await gateway.handle(call(counting, anthropic(), session="a")))
        await gateway.close()
        assert seen == [[{"role": "user", "content": "hi"}]]
        return [(r.status, orjson.loads(r.body)) for r in replies]

    replies = asyncio.run(main())
    (s0, first), (s1, second_count) = replies[:2]
    assert (
        s0 == s1 == 200
        and first == second_count
        and isinstance(first["input_tokens"], int)
        and first["input_tokens"] > 0
    )
    assert replies[2:] == [
        (200, {"input_tokens": 4242}),
        (503, {"type": "error", "error": {"type": "overloaded_error", "message": "engine busy"}}),
    ]
    assert read_records(str(out)) == []


def test_a_large_body_is_read_off_the_event_loop_with_the_same_result(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    # Large but few tokens (the tiny model's window is small): the bulk is in metadata.
    body = anthropic(metadata={"user_id": "x" * (gateway_module.PARSE_OFF_LOOP_BYTES + 10)})

    async def steps(gateway: Gateway) -> int:
        return (await gateway.handle(call(MESSAGES, body, session="big"))).status

    assert run(script, out, steps) == 200
    [record] = read_records(str(out))
    assert (record.session_id, record.status, orjson.loads(record.messages_json)) == (
        "big",
        "ok",
        [{"role": "user", "content": "hi"}],
    )


# Most of its bytes are metadata, which no history item holds: only the body's own size makes the cost reach it.
RESPONSES_BODY = {"model": "tiny", "input": "hi", "metadata": {"note": "m" * 400}}


def test_what_parse_checks_at_its_edges(script: Path, tmp_path: Path, caplog) -> None:
    """A body of exactly the size limit is read; a translator crash on odd input is a 400 naming the exception
    (logged); a cap of 1 token applies; the Responses history is kept under the call's session."""
    out = tmp_path / "shards"
    body = orjson.dumps(anthropic(metadata={"user_id": "u" * 500}))  # the size limit; larger than the Responses body

    async def steps(gateway: Gateway) -> list[Any]:
        provider, route = gateway.match("POST", MESSAGES)
        exact = gateway._parse(provider, route, call(MESSAGES, None, raw=body))

        def crash(body: Any, route: Any) -> Any:
            raise TypeError("unhashable type: 'dict'" + " x" * 150)  # the message is cut at 200 characters

        responses, responses_route = gateway.match("POST", "/v1/responses")
        original = provider.parse_request
        provider.parse_request = crash  # type: ignore[method-assign]
        with caplog.at_level("INFO", logger="polar"):
            crashed = await gateway.handle(call(MESSAGES, anthropic()))
        provider.parse_request = original  # type: ignore[method-assign]
        reply = await gateway.handle(call("/v1/responses", RESPONSES_BODY, session="r1"))
        response_id = orjson.loads(reply.body)["id"]
        return [
            exact.sampling.max_tokens,
            (crashed.status, orjson.loads(crashed.body)),
            response_id,
            dict(responses.history._by_session),
            responses.history._items[response_id].cost,
        ]

    cap, crashed, response_id, by_session, cost = run(
        script, out, steps, GatewayConfig(max_body_bytes=len(body), max_tokens_cap=1)
    )
    reason = "unhashable type: 'dict'" + " x" * 150
    assert cap == 1
    assert crashed == (
        400,
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": f"request could not be read (TypeError: {reason[:200]})",
            },
        },
    )
    assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [
        f"polar: anthropic_messages could not read a request: TypeError: {reason}"
    ]
    assert list(by_session) == ["r1"] and list(by_session["r1"]) == [response_id]
    assert cost >= len(orjson.dumps(RESPONSES_BODY))  # the history's byte bounds count the request body


def test_errors_before_the_first_keepalive_are_plain_replies_except_a_responses_overflow(
    script: Path, tmp_path: Path
) -> None:
    """A stream whose engine fails before any byte left is answered whole: a JSON error with its status, except
    a context overflow on Responses, which Codex only reads as a ``response.failed`` event."""
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> list[FullReply]:
        engine = gateway.pool.engines[0]
        failures = iter(
            [
                PolarError(503, "overloaded", "engine busy"),
                PolarError(503, "overloaded", "engine busy"),
                ContextLengthExceeded("too long", prompt_tokens=9000, window=8192),
                ContextLengthExceeded("too long", prompt_tokens=9000, window=8192),
            ]
        )

        async def failing(request: Any) -> Any:
            raise next(failures)

        engine.complete = failing  # type: ignore[method-assign]
        replies = []
        for path, body in (
            (MESSAGES, anthropic(stream=True)),
            ("/v1/responses", {"model": "tiny", "input": "hi", "stream": True}),
            (MESSAGES, anthropic(stream=True)),
            ("/v1/responses", {"model": "tiny", "input": "hi", "stream": True}),
        ):
            reply = await gateway.handle(call(path, body))
            assert isinstance(reply, FullReply)
            replies.append(reply)
        return replies

    busy_anthropic, busy_responses, long_anthropic, long_responses = run(
        script, out, steps, GatewayConfig(keepalive_s=30.0)
    )
    assert (busy_anthropic.status, busy_anthropic.content_type, orjson.loads(busy_anthropic.body)) == (
        503,
        "application/json",
        {"type": "error", "error": {"type": "overloaded_error", "message": "engine busy"}},
    )
    assert (busy_responses.status, busy_responses.content_type) == (503, "application/json")
    assert orjson.loads(busy_responses.body)["error"]["code"] == "server_is_overloaded"
    assert (long_anthropic.status, long_anthropic.content_type) == (400, "application/json")
    assert orjson.loads(long_anthropic.body)["error"]["type"] == "invalid_request_error"
    assert (long_responses.status, long_responses.content_type) == (200, "text/event-stream")
    assert all(block.startswith(b"event: ") for block in long_responses.body.split(b"\n\n")[:-1])  # whole SSE events
    events = [orjson.loads(line[6:]) for line in long_responses.body.split(b"\n") if line.startswith(b"data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"
    assert "9000 input tokens > 8192 maximum" in events[-1]["response"]["error"]["message"]


def test_replies_carry_the_request_and_the_call_time(script: Path, tmp_path: Path) -> None:
    """The rendered answer is of this request (Responses echoes its settings) and of this call's start time."""
    out = tmp_path / "shards"
    incoming = [
        call("/v1/responses", {"model": "tiny", "input": "hi", "temperature": 0.25, "stream": stream})
        for stream in (False, True)
    ]
    incoming.append(call(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}))

    async def steps(gateway: Gateway) -> list[FullReply]:
        return [await gateway.handle(c) for c in incoming]

    plain, streamed, chat = run(script, out, steps, GatewayConfig(keepalive_s=30.0))
    response = orjson.loads(plain.body)
    assert (response["temperature"], response["created_at"]) == (0.25, int(incoming[0].started_at))
    completed = [orjson.loads(line[6:]) for line in streamed.body.split(b"\n") if line.startswith(b"data: ")][-1]
    assert (completed["response"]["temperature"], completed["response"]["created_at"]) == (
        0.25,
        int(incoming[1].started_at),
    )
    assert orjson.loads(chat.body)["created"] == int(incoming[2].started_at)


def test_an_unexpected_error_is_logged_with_the_method_and_the_path_without_its_query(
    script: Path, tmp_path: Path, caplog
) -> None:
    async def steps(gateway: Gateway) -> int:
        async def broken(incoming: IncomingCall) -> Any:
            raise RuntimeError("bug")

        gateway._handle = broken  # type: ignore[method-assign]
        with caplog.at_level("ERROR", logger="polar"):
            return (await gateway.handle(call(MESSAGES + "?beta=true?x", anthropic()))).status

    assert run(script, tmp_path / "shards", steps) == 500
    assert [r.getMessage() for r in caplog.records][0] == "polar: unexpected error answering POST /v1/messages"


def test_header_values_are_made_printable_before_anything_reads_them(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    incoming = replace(call(MESSAGES, anthropic()), headers={"user-agent": "claude-cli/2.1.197 caf\udcc3\udca9"})

    async def steps(gateway: Gateway) -> int:
        return (await gateway.handle(incoming)).status

    assert run(script, out, steps) == 200
    [record] = read_records(str(out))
    assert record.harness == "claude-cli/2.1.197 café"


def test_a_sessions_row_holds_its_identity_and_its_first_calls_start(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    identity = Identity(session_id="g1", task_id="task-7", group_id="grp-2", sample_index=3, source="proxy_auth")
    first = replace(call(MESSAGES, anthropic()), identity=identity)

    async def steps(gateway: Gateway) -> list[int]:
        return [(await gateway.handle(c)).status for c in (first, replace(first, started_at=first.started_at + 5))]

    assert run(script, out, steps) == [200, 200]
    [row] = read_table(str(out), "sessions").to_pylist()
    assert (row["session_id"], row["task_id"], row["group_id"], row["sample_index"], row["status"]) == (
        "g1",
        "task-7",
        "grp-2",
        3,
        "running",
    )
    assert row["started_at"] == pytest.approx(first.started_at)


def test_a_gateway_answers_only_for_the_providers_it_was_given(script: Path, tmp_path: Path) -> None:
    from polar_addon.providers.anthropic_messages import PROVIDER as ANTHROPIC

    async def main() -> list[bool]:
        gateway = Gateway(
            EnginePool([ScriptedEngine(str(script))]), TraceStore(str(tmp_path / "shards")), providers=[ANTHROPIC]
        )
        owned = [gateway.owns("POST", MESSAGES), gateway.owns("POST", CHAT)]
        await gateway.close()
        return owned

    assert asyncio.run(main()) == [True, False]


def test_an_unwritable_store_is_refused_before_the_engine_in_openais_code(script: Path, tmp_path: Path) -> None:
    async def steps(gateway: Gateway) -> tuple[int, Any]:
        def full(**kwargs: Any) -> None:
            raise StorageUnavailable("disk full")

        gateway.store.check_writable = full  # type: ignore[method-assign]
        reply = await gateway.handle(call(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}))
        return reply.status, orjson.loads(reply.body)

    assert run(script, tmp_path / "shards", steps) == (
        503,
        {
            "error": {
                "type": "server_error",
                "code": "storage_unavailable",
                "param": None,
                "message": "polar cannot persist captured calls right now (disk full); retry later",
            }
        },
    )
