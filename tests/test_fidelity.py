"""bench/fidelity.py on hand-written bodies of each API: multi-turn histories with tool calls come back
whole, documented drops carry their reason, and an unknown field is caught as UNEXPLAINED."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.fidelity import KEPT, UNEXPLAINED, Captured, Comparison, compare, round_trip
from polar_addon.providers import Route
from polar_addon.providers.openai_responses import OpenAIResponsesProvider

ARGS = '{"path": "a.txt"}'
SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "minLength": 1}}, "required": ["path"]}

BODIES: dict[str, tuple[Route, dict[str, Any]]] = {
    "openai_chat": (
        Route(kind="generate"),
        {
            "model": "m",
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.2,
            "max_completion_tokens": 64,
            "messages": [
                {"role": "system", "content": "You are a careful coding agent."},
                {"role": "user", "content": [{"type": "text", "text": "Read a.txt please."}]},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "I should read the file first.",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": ARGS}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "hello from a.txt"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": SCHEMA}}
            ],
            "tool_choice": "auto",
        },
    ),
    "anthropic_messages": (
        Route(kind="generate"),
        {
            "model": "m",
            "max_tokens": 64,
            "stream": True,
            "top_k": 20,
            "system": [
                {"type": "text", "text": "You are a careful coding agent.", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [
                {"role": "user", "content": "Read a.txt please."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "I should read the file first.", "signature": "sig-abc"},
                        {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello from a.txt"}],
                },
            ],
            "tools": [{"name": "read", "description": "Read a file.", "input_schema": SCHEMA}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    ),
    "openai_responses": (
        Route(kind="generate"),
        {
            "model": "m",
            "stream": True,
            "store": False,
            "instructions": "You are a careful coding agent.",
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k-123",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read a.txt please."}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "I should read the file first."}],
                },
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "read", "arguments": ARGS},
                {"type": "function_call_output", "call_id": "call_1", "output": "hello from a.txt"},
                {
                    "type": "custom_tool_call",
                    "call_id": "call_2",
                    "name": "apply_patch",
                    "input": "*** Begin Patch\n*** End Patch",
                },
                {"type": "custom_tool_call_output", "call_id": "call_2", "output": "patched"},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "read",
                    "description": "Read a file.",
                    "strict": False,
                    "parameters": SCHEMA,
                },
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "description": "Patch files.",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: PATCH"},
                },
                {"type": "web_search"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"effort": "low", "summary": "auto"},
        },
    ),
    "gemini": (
        Route(kind="generate", stream_hint=True, model="m", params={"sse": True}),
        {
            "systemInstruction": {"role": "user", "parts": [{"text": "You are a careful coding agent."}]},
            "contents": [
                {"role": "user", "parts": [{"text": "Read a.txt please."}]},
                {
                    "role": "model",
                    "parts": [
                        {"text": "I should read the file first.", "thought": True},
                        {
                            "functionCall": {"id": "call_1", "name": "read", "args": {"path": "a.txt"}},
                            "thoughtSignature": "c2ln",
                        },
                    ],
                },
                {
                    "role": "user",
                    "parts": [
                        {
                            "functionResponse": {
                                "id": "call_1",
                                "name": "read",
                                "response": {"output": "hello from a.txt"},
                            }
                        }
                    ],
                },
            ],
            "tools": [
                {
                    "functionDeclarations": [
                        {
                            "name": "read",
                            "description": "Read a file.",
                            "parameters": {"type": "OBJECT", "properties": {"path": {"type": "STRING"}}},
                        }
                    ]
                }
            ],
            "generationConfig": {
                "temperature": 1,
                "maxOutputTokens": 64,
                "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 512},
            },
        },
    ),
}


def run(
    api: str,
    body: dict[str, Any],
    responses: OpenAIResponsesProvider | None = None,
    response: dict[str, Any] | None = None,
) -> Comparison:
    route, _ = BODIES[api]
    result = Comparison()
    back = round_trip(Captured(api, route, body, "test", response), responses or OpenAIResponsesProvider())
    compare(api, "test", body, back, result)
    return result


@pytest.mark.parametrize("api", sorted(BODIES))
def test_every_leaf_is_kept_or_explained(api: str) -> None:
    result = run(api, BODIES[api][1])
    assert not result.unexplained(), [(r.field, r.example) for r in result.unexplained()]
    # The conversation itself always survives: system text, user text, reasoning, the call, its result.
    kept = [value for _, status, value in result.leaves if status == KEPT]
    call_id = "toolu_1" if api == "anthropic_messages" else "call_1"
    for text in (
        "You are a careful coding agent.",
        "Read a.txt please.",
        "I should read the file first.",
        "read",
        call_id,
    ):
        assert text in kept, (api, text)
    assert any(isinstance(v, str) and "hello from a.txt" in v for v in kept)
    assert ARGS in kept or "a.txt" in kept  # arguments as JSON text, or the path inside an args object


def test_documented_drops_carry_their_reason() -> None:
    rows = {(r.field, r.status): r.why for r in run("openai_responses", BODIES["openai_responses"][1]).rows.values()}
    assert "encrypted reasoning" in rows[("include[*]", "dropped")]
    assert "hosted tools" in rows[("tools[*].type", "dropped")]
    assert "grammar" in rows[("tools[*].format.type", "changed")]
    gemini = {(r.field, r.status) for r in run("gemini", BODIES["gemini"][1]).rows.values()}
    assert ("tools[*].functionDeclarations[*].parameters.*", "changed") in gemini  # OBJECT -> object
    assert ("generationConfig.thinkingConfig.thinkingBudget", "changed") in gemini
    assert ("generationConfig.temperature", "kept") in gemini  # 1 == 1.0


@pytest.mark.parametrize("api", sorted(BODIES))
def test_an_unknown_field_is_unexplained(api: str) -> None:
    body = {**BODIES[api][1], "frobnicate": {"level": 3}}
    unexplained = run(api, body).unexplained()
    assert [(r.field, r.status) for r in unexplained] == [("frobnicate.level", UNEXPLAINED)]


def test_a_lost_message_would_be_caught() -> None:
    """If the translation lost text, the comparison says so (here: a user message the round trip lacks)."""
    route, body = BODIES["openai_chat"]
    back = round_trip(Captured("openai_chat", route, body, "test"), OpenAIResponsesProvider())
    back["messages"] = [m for m in back["messages"] if m["role"] != "user"]
    result = Comparison()
    compare("openai_chat", "test", body, back, result)
    assert ("messages[*].content[*].text", UNEXPLAINED) in {(r.field, r.status) for r in result.rows.values()}


def test_previous_response_id_replays_against_the_earlier_response() -> None:
    responses = OpenAIResponsesProvider()
    first = {
        "model": "m",
        "input": [{"type": "message", "role": "user", "content": "Read a.txt please."}],
        "tools": BODIES["openai_responses"][1]["tools"][:1],
    }
    answer = {
        "id": "resp_real1",
        "output": [{"type": "function_call", "id": "fc_9", "call_id": "call_9", "name": "read", "arguments": ARGS}],
    }
    run("openai_responses", first, responses, answer)
    second = {
        "model": "m",
        "previous_response_id": "resp_real1",
        "input": [{"type": "function_call_output", "call_id": "call_9", "output": "hello from a.txt"}],
    }
    result = run("openai_responses", second, responses)
    assert not result.unexplained()
    assert ("previous_response_id", "changed") in {(r.field, r.status) for r in result.rows.values()}


def test_the_script_explains_itself_and_names_a_missing_flow_file(tmp_path) -> None:
    import subprocess
    import sys

    script = [sys.executable, "bench/fidelity.py"]
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run([*script, "--help"], cwd=root, capture_output=True, text=True)
    assert shown.returncode == 0 and "save_stream_file" in shown.stdout
    missing = subprocess.run([*script, str(tmp_path / "flows")], cwd=root, capture_output=True, text=True)
    assert missing.returncode == 2 and "no such flow file" in missing.stderr and "Traceback" not in missing.stderr
