"""The continuity check's shortcuts for harness-sized requests (issue 26's proxy profile: a Claude Code-shaped call
spent most of its proxy time walking its 17 tool schemas and 40-odd messages in Python, once per chain): each gives
the answer the full comparison gives, and is taken where it applies."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from polar_addon.canonical import AssistantMessage, CanonicalRequest, SamplingParams, ToolCall
from polar_addon.continuity import check
from polar_addon.continuity.chains import ChainTip, judge
from polar_addon.continuity.check import Continues, Diverged, _Defaults, _same_tools, check_continuity, plain_history

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}, "login": {"type": "boolean", "default": False}}}
TOOLS = [
    {"name": "bash", "description": "Run a command.", "input_schema": SCHEMA},
    {"name": "read", "input_schema": {}},
]
RETURNED = AssistantMessage(content="ok", tool_calls=[ToolCall(id="c1", name="bash", arguments='{"cmd": "ls"}')])
HISTORY = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "here?"}]},
    {"role": "assistant", "content": "Looking.", "reasoning_content": "ls first", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "pwd"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "/work"},
]  # fmt: skip


def _request(messages: Any, tools: Any = None) -> CanonicalRequest:
    return CanonicalRequest(
        api="anthropic_messages",
        model="tiny",
        messages=messages,
        tools=copy.deepcopy(TOOLS) if tools is None else tools,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=100),
    )


def _both_ways(old: list, new: list, tools: Any = None) -> Any:
    """The verdict without the shortcut, checked equal to the one with it (the history's plain_history kept)."""
    previous, request = _request(old, tools), _request(new, tools)
    verdict = check_continuity(previous, RETURNED, request)
    assert check_continuity(previous, RETURNED, request, previous_plain=plain_history(old)) == verdict
    return verdict


def _continued(old: list) -> list:
    return [*copy.deepcopy(old), RETURNED.to_openai(), {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda m: None, None),  # repeated exactly: continues
        (lambda m: m[1]["content"][1].update(text="there?"), "message 1 changed"),
        (lambda m: m[2].update(content="  Looking.\n"), None),  # whitespace at the ends: the same message
        (lambda m: m[2]["tool_calls"][0]["function"].update(arguments='{"cmd":"pwd"}'), None),  # re-serialized
        (lambda m: m[2]["tool_calls"][0]["function"].update(arguments='{"cmd": "pwd", "login": false}'), None),
        (lambda m: m[2]["tool_calls"][0]["function"].update(arguments='{"cmd": "pwd", "login": true}'), "message 2"),
        (lambda m: m[2].pop("reasoning_content"), None),  # reasoning not sent back
        (lambda m: m[2].update(reasoning_content="other"), "message 2 changed"),
        (lambda m: m[3].update(extra=True), None),  # a key the model never saw
        (lambda m: m.pop(4), "the assistant turn polar returned"),
        (lambda m: m.pop(3), "message 3 changed"),
    ],
)
def test_the_shortcut_gives_the_full_comparisons_verdict(edit: Any, reason: str | None) -> None:
    new = _continued(HISTORY)
    edit(new)
    verdict = _both_ways(copy.deepcopy(HISTORY), new)
    if reason is None:
        assert isinstance(verdict, Continues), verdict
    else:
        assert isinstance(verdict, Diverged) and reason in verdict.detail, verdict


def test_a_repeated_plain_history_is_not_walked_message_by_message(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[Any] = []
    real = check._same_message
    monkeypatch.setattr(check, "_same_message", lambda a, b, d: compared.append(a) or real(a, b, d))
    previous, new = _request(copy.deepcopy(HISTORY)), _request(_continued(HISTORY))
    assert isinstance(check_continuity(previous, RETURNED, new, previous_plain=True), Continues)
    assert compared == [RETURNED.to_openai()]  # only the returned turn
    compared.clear()
    assert isinstance(check_continuity(previous, RETURNED, new), Continues)
    assert len(compared) == len(HISTORY) + 1
    # A chain keeps its history's verdict and hands it to every check against it.
    chain = ChainTip(previous, RETURNED, [1, 2], [3], "stop", "e")
    compared.clear()
    assert isinstance(judge([chain], new, "e")[0], Continues) and chain.history_plain
    assert compared == [RETURNED.to_openai()]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},  # not text
        {"role": "user", "content": 7},
        "not a message",
        {"role": "assistant", "content": "x", "reasoning_content": [{"type": "image"}]},
        {"role": "assistant", "content": "x", "tool_calls": "junk"},
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "bash", "arguments": {"cmd": 1}}}]},
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": ["bash"], "arguments": "{}"}}]},
    ],
)
def test_a_history_with_anything_but_text_is_not_plain(message: Any) -> None:
    assert plain_history(HISTORY)
    assert not plain_history([*HISTORY, message])
    assert plain_history([{"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool"}])


def test_an_image_repeated_exactly_still_diverges_as_without_the_shortcut() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}
    verdict = _both_ways([image], [copy.deepcopy(image), RETURNED.to_openai(), {"role": "user", "content": "go"}])
    assert isinstance(verdict, Diverged) and verdict.detail == "message 0 changed"


def test_tools_compare_as_json_values_on_the_fast_path_and_off_it() -> None:
    same = copy.deepcopy(TOOLS)
    assert _same_tools(TOOLS, same)
    reordered = [{k: same[0][k] for k in reversed(list(same[0]))}, same[1]]
    assert _same_tools(TOOLS, reordered)  # key order
    marked = copy.deepcopy(TOOLS)
    marked[1]["cache_control"] = {"type": "ephemeral"}
    assert _same_tools(TOOLS, marked)
    assert not _same_tools(TOOLS, TOOLS[:1])

    def with_default(value: Any) -> list:
        tools = copy.deepcopy(TOOLS)
        tools[0]["input_schema"]["properties"]["login"]["default"] = value
        return tools

    assert _same_tools(with_default(1), with_default(1.0))  # the same number, other text: the slow path agrees
    assert not _same_tools(with_default(False), with_default(0))  # == in Python, not as JSON
    assert not _same_tools(with_default(True), with_default(1))
    assert not _same_tools(with_default(float("nan")), with_default(float("nan")))  # both written as null
    assert not _same_tools(with_default(math.nan), with_default(None))
    assert not _same_tools(with_default(math.inf), with_default(None))
    assert _same_tools(with_default(math.inf), with_default(math.inf))
    assert not _same_tools(with_default({1, 2}), with_default({1, 2}))  # nothing orjson writes: the slow path
    assert isinstance(_both_ways(HISTORY, _continued(HISTORY), tools=with_default(True)), Continues)


def test_the_same_tools_in_any_key_order_are_never_walked_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[Any] = []
    real = check._json_equal
    monkeypatch.setattr(check, "_json_equal", lambda a, b: walked.append(a) or real(a, b))
    reordered = copy.deepcopy(TOOLS)
    reordered[0] = {k: reordered[0][k] for k in reversed(list(reordered[0]))}
    reordered[0]["input_schema"] = dict(reversed(list(reordered[0]["input_schema"].items())))
    assert _same_tools(TOOLS, copy.deepcopy(TOOLS)) and _same_tools(TOOLS, reordered)
    assert walked == []
    other = copy.deepcopy(TOOLS)
    other[1]["name"] = "write"
    assert not _same_tools(TOOLS, other) and walked  # a real difference is walked, and found


def test_schema_defaults_of_a_tools_list_are_read_once_first_tool_of_a_name_first() -> None:
    twice = [
        {"name": 5, "input_schema": SCHEMA},
        "junk",
        {"function": "junk"},
        {"type": "function", "function": {"name": "bash", "parameters": {"properties": {"a": {"default": 1}}}}},
        {"name": "bash", "input_schema": SCHEMA},
        {"name": "bare"},
    ]
    defaults = _Defaults(twice)
    assert defaults.of("bash") == {"a": 1} == check.schema_defaults(twice, "bash")
    assert defaults.of("bare") == {} and defaults.of("missing") == {} and defaults.by_name is not None
    assert set(defaults.by_name) == {"bash", "bare"}  # a name that is not text is nobody's
    assert check.schema_defaults(twice, "junk") == {}
    assert check.schema_defaults(twice, 5) == {} and check.schema_defaults(twice, ["bash"]) == {}  # names are text
    assert _Defaults("junk").of("bash") == {} and _Defaults(tuple(TOOLS)).of("bash") == {"login": False}
    assert _Defaults(5).of("bash") == {} and check.schema_defaults(5, "bash") == {}  # not a list: no tools
