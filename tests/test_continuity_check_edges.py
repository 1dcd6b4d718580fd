"""The continuity check at its edges (issue 29's mutation run of polar_addon/continuity/check.py): every divergence
with its exact reason and detail, the shapes a replay may take (untyped text parts, flat tool calls, Anthropic tool
schemas, ``reasoning`` for ``reasoning_content``), and attacker-shaped input that must compare unequal, never raise."""

from __future__ import annotations

import copy
from typing import Any

from polar_addon.canonical import AssistantMessage, CanonicalRequest, SamplingParams, ToolCall
from polar_addon.continuity.check import (
    Continues,
    Diverged,
    DivergeReason,
    _same_arguments,
    check_continuity,
    same_message,
    schema_defaults,
)

R = DivergeReason
TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}, "login": {"type": "boolean", "default": False}}}}},
]  # fmt: skip
RETURNED = AssistantMessage(content="ok", tool_calls=[ToolCall(id="c1", name="bash", arguments='{"cmd": "ls"}')])


def _request(messages: Any, **fields: Any) -> CanonicalRequest:
    fields = {
        "api": "openai_chat",
        "model": "tiny",
        "tools": copy.deepcopy(TOOLS),
        "sampling": SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=100),
        "messages": messages,
        **fields,
    }
    return CanonicalRequest(**fields)


HISTORY = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is here?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "pwd"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "/work"},
]  # fmt: skip


def _check(new_messages: Any, old: Any = None, **fields: Any) -> Any:
    old = copy.deepcopy(HISTORY) if old is None else old
    return check_continuity(_request(old), RETURNED, _request(new_messages, **fields))


def _continued(*extra: dict) -> list:
    return [*copy.deepcopy(HISTORY), RETURNED.to_openai(), *extra]


TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "a.py"}


def test_every_divergence_says_exactly_why() -> None:
    assert _check(_continued(TOOL_RESULT)) == Continues([TOOL_RESULT])
    assert _check(_continued(TOOL_RESULT), enable_thinking=True) == Diverged(R.OTHER, "the thinking switch changed")
    assert _check(_continued(TOOL_RESULT), tools=[]) == Diverged(R.CHANGED_TOOLS, "the tools list changed")
    assert _check(_continued(TOOL_RESULT), tool_choice="none") == Diverged(R.CHANGED_TOOLS, "tool_choice changed")
    assert _check("junk") == Diverged(R.OTHER, "messages are not a list")
    assert _check([*_continued(TOOL_RESULT), "junk"]) == Diverged(R.OTHER, "a message is not an object")
    system = [{"role": "system", "content": "Another prompt."}, *_continued(TOOL_RESULT)[1:]]
    assert _check(system) == Diverged(R.NEW_SYSTEM_PROMPT, "the system prompt changed")
    assert _check(HISTORY[:2]) == Diverged(R.EDITED_HISTORY, "the history is shorter (2 messages, was 4)")
    assert _check(HISTORY[:4]) == Diverged(R.OTHER, "the previous request again (a retry or another sample)")
    assert _check(_continued()) == Diverged(
        R.OTHER, "no new messages after the returned turn (a retry or another sample)"
    )
    assert _check(_continued(TOOL_RESULT, {"role": "assistant", "content": "x"})) == Diverged(
        R.EDITED_HISTORY, "message 6 is a new 'assistant' message, not a tool result or user turn"
    )
    assert _check(_continued({"role": "system", "content": "x"})) == Diverged(
        R.EDITED_HISTORY, "message 5 is a new 'system' message, not a tool result or user turn"
    )


def test_the_same_tool_choice_and_an_empty_history_continue() -> None:
    old = _request(copy.deepcopy(HISTORY), tool_choice="auto")
    new = _request(_continued(TOOL_RESULT), tool_choice="auto")
    assert check_continuity(old, RETURNED, new) == Continues([TOOL_RESULT])
    # No earlier messages at all (a first call that sent none): the returned turn is message 0.
    assert _check([RETURNED.to_openai(), TOOL_RESULT], old=[]) == Continues([TOOL_RESULT])


def test_only_a_system_or_developer_first_message_is_the_system_prompt() -> None:
    developer = [{"role": "developer", "content": "A."}, *HISTORY[1:]]
    changed = [{"role": "developer", "content": "B."}, *_continued(TOOL_RESULT)[1:]]
    assert _check(changed, old=developer) == Diverged(R.NEW_SYSTEM_PROMPT, "the system prompt changed")
    # A user first message that changed is edited history, not a new system prompt.
    old = HISTORY[1:]
    new = [{"role": "user", "content": "Something else?"}, *_continued(TOOL_RESULT)[2:]]
    assert _check(new, old=old) == Diverged(R.EDITED_HISTORY, "message 0 changed")


def test_a_schema_default_filled_into_earlier_history_is_the_same_message() -> None:
    new = _continued(TOOL_RESULT)
    new[2]["tool_calls"][0]["function"]["arguments"] = '{"cmd": "pwd", "login": false}'
    assert _check(new) == Continues([TOOL_RESULT])
    new[2]["tool_calls"][0]["function"]["arguments"] = '{"cmd": "pwd", "login": true}'
    assert _check(new) == Diverged(R.EDITED_HISTORY, "message 2 changed")


def test_schema_defaults_of_either_tool_shape_and_of_junk() -> None:
    anthropic = {"name": "edit", "input_schema": {"properties": {"replace_all": {"default": False}, "x": {}}}}
    other = {"type": "function", "function": {"name": "other", "parameters": {"properties": {"y": {"default": 1}}}}}
    assert schema_defaults([anthropic], "edit") == {"replace_all": False}
    # The first tool of another name is skipped, not taken nor the end of the search; junk tools are skipped.
    assert schema_defaults(["junk", other, *TOOLS], "bash") == {"login": False}
    assert schema_defaults([other, anthropic], "edit") == {"replace_all": False}
    assert schema_defaults(None, "bash") == {} and schema_defaults({"name": "bash"}, "bash") == {}  # type: ignore[arg-type]
    assert schema_defaults([{"name": "bash", "parameters": "junk"}], "bash") == {}


def _assistant(calls: Any = None, **fields: Any) -> dict:
    return {"role": "assistant", "content": "", **({"tool_calls": calls} if calls is not None else {}), **fields}


def _fn(arguments: Any, name: str = "f") -> list:
    return [{"function": {"name": name, "arguments": arguments}}]


def test_messages_compare_as_the_model_saw_them() -> None:
    # A text part without a type is text; roles must match; non-objects and junk compare unequal, never raise.
    assert same_message({"role": "user", "content": "hi"}, {"role": "user", "content": [{"text": "hi"}]})
    assert not same_message({"role": "user", "content": "hi"}, {"role": "tool", "content": "hi"})
    assert not same_message("hi", {"role": "user", "content": "hi"})
    assert not same_message({"role": "user", "content": "hi"}, "hi")
    assert not same_message(_assistant("junk"), _assistant())
    # Flat calls (no `function` wrapper) and a call without arguments (they are "", i.e. {}).
    flat = [{"name": "f", "arguments": '{"a": 1}'}]
    assert same_message(_assistant(flat), _assistant(flat))
    assert not same_message(_assistant(flat), _assistant([{"name": "f", "arguments": '{"a": 2}'}]))
    assert same_message(_assistant([{"function": {"name": "f"}}]), _assistant(_fn("{}")))
    # `reasoning` stands for `reasoning_content`; non-text reasoning is never the sampled one.
    assert not same_message(_assistant(reasoning="think"), _assistant(reasoning="other"))
    assert same_message(_assistant(reasoning="think"), _assistant(reasoning_content="think"))
    assert not same_message(_assistant(reasoning="think"), _assistant(reasoning=5))


def test_arguments_compare_as_json_values() -> None:
    def same(sampled: Any, sent: Any) -> bool:
        return same_message(_assistant(_fn(sampled)), _assistant(_fn(sent)))

    assert not same('{"n": 1}', '{"n": 2}')
    assert same('{"n": 1}', '{"n": 1.0}')
    assert not same('{"x": []}', '{"x": {}}') and not same('{"x": {}}', '{"x": []}')
    assert same("", " ")  # blank text is no arguments, both ways
    # Only a JSON object comes back from an object-typed API: a list, or a JSON string for broken text, is not it.
    assert not same("[1, 2]", [1, 2])
    assert not same("{bad", '"{bad"')
    assert same("{bad", {"raw": "{bad"})
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    assert not _same_arguments(deep, deep)  # deeper than any JSON reader takes: not what polar returned
