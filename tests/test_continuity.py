"""check_continuity: one table of what harnesses do to replayed history (tolerated, each row named after the
harness that does it) and of real changes (never accepted), plus hostile shapes that must not raise."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from polar_addon.canonical import AssistantMessage, CanonicalRequest, SamplingParams, ToolCall
from polar_addon.context_compaction import PROMPT_MARKERS, SUMMARY_MARKERS
from polar_addon.continuity.check import Continues, Diverged, DivergeReason, check_continuity, same_message

# "login" has a schema default, as Claude Code's Edit has {"replace_all": {"type": "boolean", "default": false}}.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "login": {"type": "boolean", "default": False}},
            },
        },
    }
]
ARGS = '{"cmd": "ls -la", "timeout": 10, "opts": {"ratio": 1.0, "all": true, "name": "caf\\u00e9"}}'
RETURNED = AssistantMessage(
    content="Let me look.\n",
    reasoning="I should list files.",
    tool_calls=[
        ToolCall(id="call_abc", name="bash", arguments=ARGS),
        ToolCall(id="call_def", name="bash", arguments="{}"),
    ],
)


def previous() -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat",
        model="tiny",
        tools=copy.deepcopy(TOOLS),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=100),
        messages=[
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "What is here?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "pwd"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "/work"},
        ],
    )


def replayed() -> dict[str, Any]:
    return RETURNED.to_openai()


def new_request() -> CanonicalRequest:
    request = previous()
    request.messages += [
        replayed(),
        {"role": "tool", "tool_call_id": "call_abc", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "call_def", "content": ""},
    ]
    return request


def turn(request: CanonicalRequest) -> dict[str, Any]:
    return request.messages[4]


def set_args(request: CanonicalRequest, arguments: Any, index: int = 0) -> None:
    turn(request)["tool_calls"][index]["function"]["arguments"] = arguments


Edit = Callable[[CanonicalRequest], None]

# (row, edit of the new request, None: continues | the reason it diverges)
TOLERATED: list[tuple[str, Edit]] = [
    ("exact replay (openai chat clients that keep everything)", lambda r: None),
    (
        "claude-code: tool input sent back as an object, re-serialized compact",
        lambda r: set_args(r, orjson.dumps(orjson.loads(ARGS)).decode()),
    ),
    (
        "gemini-cli: args object with keys in another order",
        lambda r: set_args(
            r,
            orjson.dumps(
                {"opts": {"name": "café", "all": True, "ratio": 1.0}, "timeout": 10, "cmd": "ls -la"}
            ).decode(),
        ),
    ),
    (
        "pi: JSON.stringify writes 1.0 as 1 and unescapes unicode",
        lambda r: set_args(r, '{"cmd":"ls -la","timeout":10,"opts":{"ratio":1,"all":true,"name":"café"}}'),
    ),
    ("anthropic/gemini clients: arguments as an object, not text", lambda r: set_args(r, orjson.loads(ARGS))),
    (
        "claude-code: empty tool input {} for a call sampled with no arguments text",
        lambda r: set_args(r, "", 1) or set_args(r, "{}", 1),
    ),
    ("qwen-code: reasoning_content not sent back", lambda r: turn(r).pop("reasoning_content")),
    ("gemini-cli: thought parts dropped, reasoning empty", lambda r: turn(r).update(reasoning_content="")),
    (
        "codex: reasoning sent back under 'reasoning'",
        lambda r: turn(r).update(reasoning=turn(r).pop("reasoning_content")),
    ),
    ("claude-code: trailing newline of the text block trimmed", lambda r: turn(r).update(content="Let me look.")),
    (
        "claude-code: text as content blocks with cache_control markers",
        lambda r: turn(r).update(
            content=[
                {"type": "text", "text": "Let me "},
                {"type": "text", "text": "look.", "cache_control": {"type": "ephemeral"}},
            ]
        ),
    ),
    (
        "claude-code: cache_control moved onto an earlier user message's block",
        lambda r: r.messages[1].update(
            content=[{"type": "text", "text": "What is here?", "cache_control": {"type": "ephemeral"}}]
        ),
    ),
    (
        "claude-code: tool ids re-keyed as toolu_ (anthropic provider)",
        lambda r: [c.update(id=c["id"].replace("call_", "toolu_")) for c in turn(r)["tool_calls"]],
    ),
    ("gemini-cli: function calls without ids", lambda r: [c.pop("id") for c in turn(r)["tool_calls"]]),
    ("codex: tool results for re-keyed call ids", lambda r: r.messages[5].update(tool_call_id="fc_1")),
    (
        "anthropic tools with cache_control on the last tool",
        lambda r: r.tools[0].update(cache_control={"type": "ephemeral"}),
    ),
    (
        "any harness: max_tokens, stop and seed change per call",
        lambda r: setattr(
            r,
            "sampling",
            SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=7, stop=["x"], seed=3),
        ),
    ),
    (
        "claude-code: Edit's schema default filled in (replace_all: false, not sampled)",
        lambda r: set_args(r, '{"login": false, ' + ARGS[1:]),
    ),
    (
        "claude-code: user turn after the tool results (tool_result + text in one message)",
        lambda r: r.messages.append({"role": "user", "content": "thanks"}),
    ),
]

DIVERGED: list[tuple[str, Edit, DivergeReason]] = [
    ("argument value changed", lambda r: set_args(r, ARGS.replace("ls -la", "ls")), DivergeReason.EDITED_HISTORY),
    ("boolean became a number", lambda r: set_args(r, ARGS.replace("true", "1")), DivergeReason.EDITED_HISTORY),
    ("number became a string", lambda r: set_args(r, ARGS.replace("10", '"10"')), DivergeReason.EDITED_HISTORY),
    ("extra argument key", lambda r: set_args(r, ARGS[:-1] + ', "x": null}'), DivergeReason.EDITED_HISTORY),
    (
        "schema-default key added with another value",
        lambda r: set_args(r, ARGS[:-1] + ', "login": true}'),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "gemini-cli --resume: an earlier tool result sent twice",
        lambda r: r.messages.insert(4, dict(r.messages[3])),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "gemini-cli/qwen-code resume: the directory tree in the first user message listed anew",
        lambda r: r.messages[1].update(content="What is here?\n├───.gemini/chats/"),
        DivergeReason.EDITED_HISTORY,
    ),
    ("tool renamed", lambda r: turn(r)["tool_calls"][0]["function"].update(name="sh"), DivergeReason.EDITED_HISTORY),
    ("a call dropped", lambda r: turn(r)["tool_calls"].pop(), DivergeReason.EDITED_HISTORY),
    ("calls reordered", lambda r: turn(r)["tool_calls"].reverse(), DivergeReason.EDITED_HISTORY),
    ("content edited", lambda r: turn(r).update(content="Let me look!"), DivergeReason.EDITED_HISTORY),
    (
        "inner whitespace of content changed",
        lambda r: turn(r).update(content="Let  me look."),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "reasoning edited",
        lambda r: turn(r).update(reasoning_content="I should delete files."),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "reasoning added to a turn sampled without",
        lambda r: r.messages[2].update(reasoning_content="pwd first."),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "image part in place of text",
        lambda r: turn(r).update(content=[{"type": "image_url", "text": "Let me look."}]),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "earlier user message edited",
        lambda r: r.messages[1].update(content="What is there?"),
        DivergeReason.EDITED_HISTORY,
    ),
    ("earlier tool result edited", lambda r: r.messages[3].update(content="/tmp"), DivergeReason.EDITED_HISTORY),
    ("earlier turn dropped", lambda r: r.messages.pop(2), DivergeReason.EDITED_HISTORY),
    ("returned turn missing", lambda r: r.messages.pop(4), DivergeReason.EDITED_HISTORY),
    (
        "returned turn replaced by a user message",
        lambda r: r.messages.__setitem__(4, {"role": "user", "content": "Let me look."}),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "harness appends its own assistant message",
        lambda r: r.messages.append({"role": "assistant", "content": "prefill"}),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "a mid-conversation system message",
        lambda r: r.messages.append({"role": "system", "content": "be brief"}),
        DivergeReason.EDITED_HISTORY,
    ),
    (
        "new user message with a non-text part",
        lambda r: r.messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
        DivergeReason.OTHER,
    ),
    (
        "sub-agent: new system prompt",
        lambda r: r.messages[0].update(content="You are a reviewer."),
        DivergeReason.NEW_SYSTEM_PROMPT,
    ),
    ("system prompt removed", lambda r: r.messages.pop(0), DivergeReason.NEW_SYSTEM_PROMPT),
    ("tools list changed", lambda r: r.tools.pop(), DivergeReason.CHANGED_TOOLS),
    (
        "tool description changed",
        lambda r: r.tools[0]["function"].update(description="Run"),
        DivergeReason.CHANGED_TOOLS,
    ),
    ("tool_choice changed", lambda r: setattr(r, "tool_choice", "required"), DivergeReason.CHANGED_TOOLS),
    ("temperature changed", lambda r: setattr(r.sampling, "temperature", 0.7), DivergeReason.CHANGED_SAMPLING),
    ("top_p changed", lambda r: setattr(r.sampling, "top_p", 0.9), DivergeReason.CHANGED_SAMPLING),
    ("top_k changed", lambda r: setattr(r.sampling, "top_k", 20), DivergeReason.CHANGED_SAMPLING),
    ("model changed", lambda r: setattr(r, "model", "other"), DivergeReason.OTHER),
    ("thinking switched off", lambda r: setattr(r, "enable_thinking", False), DivergeReason.OTHER),
    ("retry: the same request again", lambda r: r.messages.__delitem__(slice(4, None)), DivergeReason.OTHER),
    ("nothing new after the returned turn", lambda r: r.messages.__delitem__(slice(5, None)), DivergeReason.OTHER),
    (
        "claude-code compaction call",
        lambda r: r.messages.append({"role": "user", "content": PROMPT_MARKERS["claude-code"][0]}),
        DivergeReason.COMPACTION,
    ),
    (
        "codex history replaced by its summary",
        lambda r: r.messages.__setitem__(
            slice(1, None),
            [{"role": "user", "content": SUMMARY_MARKERS["codex"][0] + ": ..."}, {"role": "user", "content": "go on"}],
        ),
        DivergeReason.COMPACTION,
    ),
]


@pytest.mark.parametrize("edit", [e for _, e in TOLERATED], ids=[n for n, _ in TOLERATED])
def test_harness_replays_continue(edit: Edit) -> None:
    request = new_request()
    edit(request)
    result = check_continuity(previous(), RETURNED, request)
    assert isinstance(result, Continues), result
    assert result.new_messages == request.messages[5:]


@pytest.mark.parametrize(("edit", "reason"), [(e, r) for _, e, r in DIVERGED], ids=[n for n, _, _ in DIVERGED])
def test_real_changes_diverge(edit: Edit, reason: DivergeReason) -> None:
    request = new_request()
    edit(request)
    result = check_continuity(previous(), RETURNED, request)
    assert isinstance(result, Diverged), result
    assert result.reason == reason, result.detail
    assert result.detail


def test_broken_arguments_come_back_as_raw_object() -> None:
    # The model wrote broken JSON; object-typed APIs send {"raw": text} out and the harness replays it.
    returned = AssistantMessage(content=None, tool_calls=[ToolCall(id="c", name="bash", arguments='{"cmd": ')])
    prev = previous()
    request = previous()
    request.messages += [returned.to_openai(), {"role": "tool", "tool_call_id": "c", "content": "error"}]
    request.messages[4]["tool_calls"][0]["function"]["arguments"] = '{"raw":"{\\"cmd\\": "}'
    assert isinstance(check_continuity(prev, returned, request), Continues)
    request.messages[4]["tool_calls"][0]["function"]["arguments"] = '{"raw":"{\\"cmd\\":"}'
    assert isinstance(check_continuity(prev, returned, request), Diverged)
    request.messages[4]["tool_calls"][0]["function"]["arguments"] = '{"cmd": null}'
    assert isinstance(check_continuity(prev, returned, request), Diverged)


@pytest.mark.parametrize("sampled", ["[1, 2]", '"ls"', "42", "null"])
def test_json_that_is_not_an_object_comes_back_as_raw_object(sampled: str) -> None:
    # arguments_object sends any non-object JSON out as {"raw": text} too; an object-typed client echoes it.
    returned = AssistantMessage(content=None, tool_calls=[ToolCall(id="c", name="bash", arguments=sampled)])
    prev = previous()
    request = previous()
    request.messages += [returned.to_openai(), {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    request.messages[4]["tool_calls"][0]["function"]["arguments"] = {"raw": sampled}
    assert isinstance(check_continuity(prev, returned, request), Continues)
    request.messages[4]["tool_calls"][0]["function"]["arguments"] = {"raw": sampled + " "}
    assert isinstance(check_continuity(prev, returned, request), Diverged)


def test_the_check_is_not_fooled_by_python_equalities() -> None:
    # True == 1 == 1.0 in Python; as JSON they differ (except 1 and 1.0), and NaN never equals itself.
    assert not same_message(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": true}'}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
    )
    assert same_message(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1.0}'}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
    )
    assert not same_message(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[0]"}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[false]"}}]},
    )
    assert not same_message(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": float("nan")}}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": float("nan")}}}]},
    )


HOSTILE: list[Any] = [
    None,
    3,
    "text",
    [],
    [None],
    {"role": None},
    {"role": "assistant", "tool_calls": "x"},
    {"role": "assistant", "tool_calls": [None]},
    {"role": "assistant", "tool_calls": [{"function": 5}]},
    {"role": "assistant", "content": {"text": "Let me look."}},
    {"role": "assistant", "content": [5]},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": 7, "tool_calls": []},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"function": {"name": "bash", "arguments": "[" * 5000}}] * 2,
    },
]


@pytest.mark.parametrize("message", HOSTILE, ids=[repr(m)[:40] for m in HOSTILE])
def test_hostile_replayed_turn_diverges_without_raising(message: Any) -> None:
    request = new_request()
    request.messages[4] = message
    assert isinstance(check_continuity(previous(), RETURNED, request), Diverged)
    request = new_request()
    request.messages.append(message)
    result = check_continuity(previous(), RETURNED, request)
    assert isinstance(result, Diverged)


def test_hostile_messages_container() -> None:
    request = new_request()
    request.messages = "not a list"  # type: ignore[assignment]
    assert isinstance(check_continuity(previous(), RETURNED, request), Diverged)
    deep: Any = "x"
    for _ in range(2000):
        deep = [deep]
    request = new_request()
    set_args(request, deep)
    assert isinstance(check_continuity(previous(), RETURNED, request), Diverged)
    # Sampled arguments nested as deep as a JSON reader allows, replayed re-serialized: no RecursionError.
    nested = '{"a": ' * 1000 + "1" + "}" * 1000
    returned = AssistantMessage(content=None, tool_calls=[ToolCall(id="c", name="bash", arguments=nested)])
    request = previous()
    request.messages += [returned.to_openai(), {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    request.messages[4]["tool_calls"][0]["function"]["arguments"] = nested.replace(" ", "")
    assert isinstance(check_continuity(previous(), returned, request), (Continues, Diverged))
