"""The continuity check over real provider round trips: polar's response as each API renders it, replayed by
the client the way each harness does, parsed back into canonical form, continues the session."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from polar_addon.canonical import ToolCall
from polar_addon.continuity.check import Continues, Diverged, check_continuity
from polar_addon.providers import ResponseContext, all_providers
from tests.support.providers import completion

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}
# Non-compact arguments (as a model writes them) and a broken call: both must survive every API's replay.
CALLS = [
    ToolCall(id="call_abc", name="bash", arguments='{"cmd": "ls",  "n": 1.0, "deep": {"b": [true, null], "a": "é"}}'),
    ToolCall(id="call_d", name="bash", arguments='{"cmd": '),
]
ANSWER = completion(content="Let me look.\n", reasoning="think hard", tool_calls=CALLS, finish_reason="tool_calls")
PROVIDERS = {p.name: p for p in all_providers()}


def chat_replay(body: dict, response: dict, drop_reasoning: bool) -> dict:
    message = dict(response["choices"][0]["message"])
    if drop_reasoning:  # OpenAI-compatible clients (Qwen Code, Pi) do not send reasoning_content back
        message.pop("reasoning_content")
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "out"} for c in message["tool_calls"]]
    return {**body, "messages": [*body["messages"], message, *results]}


def anthropic_replay(body: dict, response: dict, drop_reasoning: bool) -> dict:
    blocks = [b for b in copy.deepcopy(response["content"]) if not (drop_reasoning and b["type"] == "thinking")]
    blocks[-1]["cache_control"] = {"type": "ephemeral"}  # Claude Code moves its cache breakpoint onto the last turn
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": "out"} for b in blocks if b["type"] == "tool_use"
    ]
    return {
        **body,
        "messages": [*body["messages"], {"role": "assistant", "content": blocks}, {"role": "user", "content": results}],
    }


def responses_replay(body: dict, response: dict, drop_reasoning: bool) -> dict:
    items = [i for i in response["output"] if not (drop_reasoning and i["type"] == "reasoning")]
    results = [
        {"type": "function_call_output", "call_id": i["call_id"], "output": "out"}
        for i in items
        if i["type"] == "function_call"
    ]
    return {**body, "input": [*body["input"], *items, *results]}


def gemini_replay(body: dict, response: dict, drop_reasoning: bool) -> dict:
    content = copy.deepcopy(response["candidates"][0]["content"])
    if drop_reasoning:  # Gemini CLI keeps thought parts out of its history
        content["parts"] = [p for p in content["parts"] if not p.get("thought")]
    calls = [p["functionCall"] for p in content["parts"] if "functionCall" in p]
    results = {
        "role": "user",
        "parts": [
            {"functionResponse": {"id": c["id"], "name": c["name"], "response": {"output": "out"}}} for c in calls
        ],
    }
    return {**body, "contents": [*body["contents"], content, results]}


CASES: dict[str, tuple[str, dict, Callable[[dict, dict, bool], dict]]] = {
    "openai_chat": (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}],
        },
        chat_replay,
    ),
    "anthropic_messages": (
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 100,
            "system": "sys",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "bash", "input_schema": SCHEMA}],
        },
        anthropic_replay,
    ),
    "openai_responses": (
        "/v1/responses",
        {
            "model": "tiny",
            "instructions": "sys",
            "input": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "name": "bash", "parameters": SCHEMA}],
        },
        responses_replay,
    ),
    "gemini": (
        "/v1beta/models/tiny:generateContent",
        {
            "systemInstruction": {"parts": [{"text": "sys"}]},
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "tools": [{"functionDeclarations": [{"name": "bash", "parameters": SCHEMA}]}],
        },
        gemini_replay,
    ),
}


@pytest.mark.parametrize("drop_reasoning", [False, True], ids=["reasoning_kept", "reasoning_dropped"])
@pytest.mark.parametrize("api", list(CASES))
def test_a_replayed_answer_continues(api: str, drop_reasoning: bool) -> None:
    provider = PROVIDERS[api]
    path, body, replay = CASES[api]
    route = provider.route("POST", path)
    first = provider.parse_request(copy.deepcopy(body), route)
    response = provider.render_response(first, ANSWER, ResponseContext("resp1", 0, "tiny"))
    second = provider.parse_request(replay(copy.deepcopy(body), response, drop_reasoning), provider.route("POST", path))
    result = check_continuity(first, ANSWER.message, second)
    assert isinstance(result, Continues), result
    assert [m["role"] for m in result.new_messages] == ["tool", "tool"]
    assert all("out" in m["content"] for m in result.new_messages)  # Gemini sends its response object as JSON text


@pytest.mark.parametrize("api", list(CASES))
def test_an_edited_replay_diverges(api: str) -> None:
    provider = PROVIDERS[api]
    path, body, replay = CASES[api]
    first = provider.parse_request(copy.deepcopy(body), provider.route("POST", path))
    edited = copy.deepcopy(ANSWER)
    edited.message.tool_calls[0].arguments = '{"cmd": "rm -rf /"}'
    response = provider.render_response(first, edited, ResponseContext("resp1", 0, "tiny"))
    second = provider.parse_request(replay(copy.deepcopy(body), response, False), provider.route("POST", path))
    assert isinstance(check_continuity(first, ANSWER.message, second), Diverged)
