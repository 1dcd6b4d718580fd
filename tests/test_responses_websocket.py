"""Codex's Responses WebSocket answered by the proxy: frame splitting, and the whole path through a
real mitmdump (regular mode, mitmproxy's CA, session in the proxy credentials) with an aiohttp
WebSocket client sending what Codex 0.171 sends: a prewarm, a turn, then only the new items with
``previous_response_id``."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
import orjson
import pytest

from polar_addon.responses_websocket import error_event, is_responses_upgrade, sse_events
from polar_addon.store import read_records
from tests.support.proxy import run_mitmdump

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
DEVELOPER = {
    "type": "message",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are a coding agent."}],
}
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}


def test_sse_events_split_frames_and_skip_keepalives() -> None:
    buffer = b': keep-alive\n\n\nevent: a\ndata: {"x":1}\n\ndata: {"y":\ndata: 2}\n\nevent: b\ndata: {"z"'
    events, rest = sse_events(buffer)
    assert events == [b'{"x":1}', b'{"y":\n2}'] and rest == b'event: b\ndata: {"z"'
    events, rest = sse_events(rest + b":3}\n\n")
    assert events == [b'{"z":3}'] and rest == b""


def test_upgrade_detection_and_error_event() -> None:
    assert is_responses_upgrade("GET", "/v1/responses", {"upgrade": "websocket"})
    assert is_responses_upgrade("GET", "/backend-api/codex/responses?x=1", {"upgrade": "WebSocket"})
    assert not is_responses_upgrade("POST", "/v1/responses", {"upgrade": "websocket"})
    assert not is_responses_upgrade("GET", "/v1/responses", {})
    assert not is_responses_upgrade("GET", "/v1/realtime", {"upgrade": "websocket"})
    body = {"error": {"type": "invalid_request_error", "code": "context_length_exceeded", "message": "too long"}}
    assert orjson.loads(error_event(400, body)) == {"type": "error", "status": 400, "error": body["error"]}


def write_script(path, model_dir) -> str:
    # 0.3 s a call: with polar_keepalive=0.01 keep-alives surely go out before the answer.
    script = {
        "model_dir": str(model_dir),
        "cycle": True,
        "latency_s": 0.3,
        "turns": [
            {
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "exec_command", "arguments": {"cmd": "echo hi"}}}
                ],
            },
            {"content": "All done."},
        ],
    }
    path.write_bytes(orjson.dumps(script))
    return f"scripted:{path}"


async def exchange(ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one request; collect events up to the one that ends the response."""
    await ws.send_str(orjson.dumps(message).decode())
    events = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), timeout=120)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        event = orjson.loads(msg.data)
        events.append(event)
        if event["type"] in ("response.completed", "response.failed", "error"):
            return events


@pytest.mark.parametrize("keepalive", ["5", "0.01"])
def test_codex_websocket_session_through_mitmdump(tiny_model_dir, tmp_path, keepalive: str) -> None:
    engine = write_script(tmp_path / "script.json", tiny_model_dir)
    out = tmp_path / "shards"
    with run_mitmdump(engine, out, options={"polar_shard_seconds": "0.2", "polar_keepalive": keepalive}) as proxy:

        async def session() -> list[list[dict[str, Any]]]:
            ssl_ctx = ssl.create_default_context(cafile=str(proxy.ca))
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(
                    "wss://api.openai.com/v1/responses",
                    proxy=proxy.proxy_url("ws-1"),
                    ssl=ssl_ctx,
                    headers={"openai-beta": "responses_websockets=2026-02-06"},
                ) as ws:
                    base = {
                        "type": "response.create",
                        "model": "tiny",
                        "stream": True,
                        "store": False,
                        "tools": [EXEC],
                        "tool_choice": "auto",
                        "parallel_tool_calls": True,
                        "instructions": "",
                    }
                    prewarm = await exchange(ws, {**base, "input": [DEVELOPER], "generate": False})
                    first = await exchange(ws, {**base, "input": [DEVELOPER, USER]})
                    call = next(e["item"] for e in first if e["type"] == "response.output_item.done")
                    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "hi\n"}
                    second = await exchange(
                        ws, {**base, "input": [output], "previous_response_id": first[-1]["response"]["id"]}
                    )
                    unknown = await exchange(ws, {**base, "input": [output], "previous_response_id": "resp_nope"})
                    wrong = await exchange(ws, {"type": "session.update"})
                    return [prewarm, first, second, unknown, wrong]

        prewarm, first, second, unknown, wrong = asyncio.run(session())

    assert [e["type"] for e in prewarm] == ["response.created", "response.completed"]
    assert prewarm[-1]["response"]["output"] == [] and prewarm[-1]["response"]["usage"]["total_tokens"] == 0
    for events in (first, second):
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert len({e["response"]["id"] for e in events if "response" in e}) == 1
        if keepalive == "0.01":  # the engine is slower than that: keep-alives went out as in_progress events
            assert kinds.count("response.in_progress") >= 2
    done = [e["item"] for e in first if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"], i["arguments"]) for i in done] == [
        ("function_call", "exec_command", '{"cmd":"echo hi"}')
    ]
    assert second[-1]["response"]["output"][0]["content"][0]["text"] == "All done."
    assert unknown[-1]["type"] == "error" and unknown[-1]["status"] == 400
    assert unknown[-1]["error"]["code"] == "previous_response_not_found"
    assert wrong == [{"type": "error", "status": 400, "error": wrong[0]["error"]}]

    ok = [r for r in read_records(str(out)) if r.status == "ok"]
    assert [r.session_id for r in ok] == ["ws-1", "ws-1"] and {r.api for r in ok} == {"openai_responses"}
    # The second call's prompt is the whole conversation: the remembered history plus the new item.
    assert [m["role"] for m in ok[1].messages] == ["system", "user", "assistant", "tool"]
    assert ok[1].messages[2]["tool_calls"][0]["id"] == done[0]["call_id"]
    assert ok[1].prompt_ids[: len(ok[0].prompt_ids)] == ok[0].prompt_ids
    failed = [r for r in read_records(str(out)) if r.status == "failed"]
    assert len(failed) == 1 and "previous_response_not_found" in failed[0].error


def test_websocket_messages_are_bounded_and_budgeted_like_bodies(tiny_model_dir, tmp_path) -> None:
    """A message over polar_max_body_mb is refused in the Responses protocol (an error event, 413) and the socket
    goes on; one that does not fit its client's in-flight budget (polar_client_inflight_mb, shared by every
    connection of the client) while another message is answered is refused with 429; what the session wrote
    before and after is recorded."""
    script = tmp_path / "script.json"
    script.write_bytes(
        orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "latency_s": 2.0, "turns": [{"content": "ok"}]})
    )
    out = tmp_path / "shards"
    options = {"polar_shard_seconds": "0.2", "polar_max_body_mb": "1", "polar_client_inflight_mb": "1"}
    base = {"type": "response.create", "model": "tiny", "stream": True, "store": False, "instructions": ""}
    pad = "x" * (600 * 1024)  # two of these do not fit a 1 MiB budget; one is within the 1 MiB body limit
    with run_mitmdump(f"scripted:{script}", out, options=options) as proxy:

        async def session() -> tuple[list[dict[str, Any]], ...]:
            ssl_ctx = ssl.create_default_context(cafile=str(proxy.ca))
            async with aiohttp.ClientSession() as http:

                def connect(session_id: str) -> Any:
                    return http.ws_connect(
                        "wss://api.openai.com/v1/responses",
                        proxy=proxy.proxy_url(session_id),
                        ssl=ssl_ctx,
                        max_msg_size=0,
                    )

                async with connect("ws-big") as ws, connect("ws-other") as other:
                    first = await exchange(ws, {**base, "input": [USER]})
                    too_large = await exchange(ws, {**base, "input": [USER], "user": "x" * (1024 * 1024 + 1)})
                    held = asyncio.ensure_future(exchange(ws, {**base, "input": [USER], "user": pad}))
                    await asyncio.sleep(1.0)  # the first padded message is in the engine's 2 s
                    over_budget = await exchange(other, {**base, "input": [USER], "user": pad})
                    padded = await held
                    after = await exchange(other, {**base, "input": [USER], "user": pad})
                    return first, too_large, over_budget, padded, after

        first, too_large, over_budget, padded, after = asyncio.run(session())

    for answered in (first, padded, after):
        assert answered[-1]["type"] == "response.completed", answered
    ((refused,),) = [too_large]
    assert (refused["type"], refused["status"]) == ("error", 413), refused
    assert "polar_max_body_mb" in refused["error"]["message"]
    ((refused,),) = [over_budget]
    assert (refused["type"], refused["status"]) == ("error", 429), refused
    assert "polar_client_inflight_mb" in refused["error"]["message"]
    ok = [r for r in read_records(str(out)) if r.status == "ok"]
    assert sorted(r.session_id for r in ok) == ["ws-big", "ws-big", "ws-other"]
