"""Does a call continue the previous call of its session, token for token?

A call continues when its request is the previous request, plus the assistant message polar returned
for it (as the harness sent it back), plus new messages (tool results, user turns), with the same
tools, sampling distribution, model and thinking switch. Then the engine prompt can be the previous
prompt ids + the sampled ids + only the new messages rendered (:mod:`polar_addon.continuity.delta`),
and the whole session stays one exactly on-policy trace.

What harnesses do to replayed history is tolerated, because none of it changes what the model was
shown or what it sampled:

- tool-call arguments re-serialized: whitespace, key order, JSON text vs an object (Anthropic's
  ``input``, Gemini's ``args``), numbers re-written (``1.0`` as ``1``), unicode escapes; arguments the
  model wrote as broken JSON come back as ``{"raw": text}`` (what ``arguments_object`` sends out);
- reasoning not sent back (Chat Completions clients drop ``reasoning_content``; Gemini CLI drops thought
  parts); reasoning sent back must be the sampled reasoning;
- whitespace at either end of a message's text, text split into several parts, markers on parts
  (``cache_control``), ``None`` vs empty content;
- a tool's JSON-schema defaults filled in: an argument the model left out comes back with the value the
  tool's schema declares as its ``default`` (Claude Code's ``Edit`` adds ``"replace_all": false``), which is
  what the tool does without it; any other added key, or a default key with another value, is a change;
- tool-call ids and ``tool_call_id`` re-keyed (polar's ids go out as ``toolu_…`` to Anthropic clients;
  Gemini calls may carry none): ids are not part of the prompt in the templates served here.

Anything else is a real change and the call diverges with a reason (compaction, edited history, a new
system prompt, changed tools, changed sampling, other). Input is attacker-controlled: anything not of
the expected shape compares unequal, nothing raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from polar_addon.canonical import AssistantMessage, CanonicalRequest
from polar_addon.context_compaction import summarised_history
from polar_addon.providers.common import arguments_object

# Roles that may follow the replayed turn: what the harness adds between two model calls.
NEW_MESSAGE_ROLES = ("tool", "user")


class DivergeReason(StrEnum):
    COMPACTION = "compaction"
    EDITED_HISTORY = "edited_history"
    NEW_SYSTEM_PROMPT = "new_system_prompt"
    CHANGED_TOOLS = "changed_tools"
    CHANGED_SAMPLING = "changed_sampling"
    OTHER = "other"


@dataclass(frozen=True)
class Continues:
    """The call continues; ``new_messages`` are the messages after the replayed assistant turn."""

    new_messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Diverged:
    reason: DivergeReason
    detail: str


Continuity = Continues | Diverged

# Parameters that shape the sampled distribution; max_tokens, stop and seed do not.
_DISTRIBUTION = ("temperature", "top_p", "top_k", "min_p")


def _text(content: Any) -> str | None:
    """Message text with its parts joined; None when the content is not text (never equal to anything)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                return None
            if part.get("type", "text") != "text":
                return None
            texts.append(part["text"])
        return "".join(texts)
    return None


def _same_text(a: Any, b: Any) -> bool:
    left, right = _text(a), _text(b)
    return left is not None and right is not None and left.strip() == right.strip()


def _json_equal(a: Any, b: Any) -> bool:
    """JSON values equal as JSON: bool is not a number, 1 == 1.0, object key order does not matter."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b and not (isinstance(a, float) and math.isnan(a))
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return False


def _arguments_value(arguments: Any) -> tuple[bool, Any]:
    """(is JSON, value) of a call's arguments: text parsed, an object as it is."""
    if isinstance(arguments, dict):
        return True, arguments
    if not isinstance(arguments, str):
        return False, arguments
    if not arguments.strip():
        return True, {}
    try:
        return True, orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return False, arguments


def _tool_function(tool: Any) -> dict[str, Any] | None:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else None


def _declared_defaults(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters", fn.get("input_schema"))
    properties = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {key: prop["default"] for key, prop in properties.items() if isinstance(prop, dict) and "default" in prop}


def schema_defaults(tools: Sequence[Any], name: Any) -> dict[str, Any]:
    """The top-level ``default`` values that tool ``name``'s parameter schema declares (none: {}); the first tool of
    that name counts. Tools are named by text: any other name has none."""
    return _Defaults(tools).of(name) if isinstance(name, str) else {}


def _without_filled_defaults(sampled: Any, sent: Any, defaults: dict[str, Any]) -> Any:
    """``sent`` less the keys the model did not write whose value is the schema's default for them."""
    if not defaults or not isinstance(sampled, dict) or not isinstance(sent, dict):
        return sent
    return {k: v for k, v in sent.items() if k in sampled or k not in defaults or not _json_equal(v, defaults[k])}


def _same_arguments(sampled: Any, sent: Any, defaults: dict[str, Any] | None = None) -> bool:
    try:
        return _arguments_match(sampled, sent, defaults or {})
    except RecursionError:  # an object nested deeper than any JSON reader accepts: not what polar returned
        return False


def _arguments_match(sampled: Any, sent: Any, defaults: dict[str, Any]) -> bool:
    if isinstance(sampled, str) and sampled == sent:
        return True
    ok_a, value_a = _arguments_value(sampled)
    ok_b, value_b = _arguments_value(sent)
    if ok_a and ok_b and _json_equal(value_a, _without_filled_defaults(value_a, value_b, defaults)):
        return True
    # Object-typed APIs (Anthropic input, Gemini args) get what arguments_object makes of the sampled text,
    # {"raw": text} for anything not a JSON object, and echo that back.
    return isinstance(sampled, str) and ok_b and _json_equal(value_b, arguments_object(sampled))


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict):
            return None
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            return None
        out.append((fn.get("name"), fn.get("arguments", "")))
    return out


def _same_reasoning(sampled: Any, sent: Any) -> bool:
    """Equal, or not sent back (harnesses drop reasoning; the prompt keeps what was sampled). Reasoning sent where
    none was sampled is not tolerated: the record's history would show the model a thought it never had."""
    left, right = _text(sampled), _text(sent)
    if left is None or right is None:
        return False
    return not right.strip() or left.strip() == right.strip()


def _reasoning(message: dict[str, Any]) -> Any:
    value = message.get("reasoning_content")
    return message.get("reasoning") if value is None else value


def same_message(a: Any, b: Any, tools: Sequence[Any] = ()) -> bool:
    """Two canonical messages say the same thing to the model, up to what harnesses do to a replay: ``a`` as polar
    holds it (the earlier request, the turn it returned), ``b`` as the client sends it back; ``tools`` (the
    request's) give the schema defaults a harness may fill into ``b``'s tool calls."""
    return _same_message(a, b, _Defaults(tools))


class _Defaults:
    """schema_defaults by tool name for one tools list, read in one pass when first asked (a long history calls
    the same tools many times)."""

    def __init__(self, tools: Sequence[Any]) -> None:
        self.tools = tools
        self.by_name: dict[str, dict[str, Any]] | None = None

    def of(self, name: str) -> dict[str, Any]:
        if self.by_name is None:
            self.by_name = {}
            for tool in self.tools if isinstance(self.tools, (list, tuple)) else ():
                fn = _tool_function(tool)
                found = None if fn is None else fn.get("name")
                if fn is not None and isinstance(found, str) and found not in self.by_name:  # the first of a name
                    self.by_name[found] = _declared_defaults(fn)
        return self.by_name.get(name, {})


def _same_message(a: Any, b: Any, defaults: _Defaults) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict) or a.get("role") != b.get("role"):
        return False
    if not _same_text(a.get("content"), b.get("content")):
        return False
    if a.get("role") != "assistant":
        return True
    if not _same_reasoning(_reasoning(a), _reasoning(b)):
        return False
    calls_a, calls_b = _calls(a), _calls(b)
    if calls_a is None or calls_b is None or len(calls_a) != len(calls_b):
        return False
    return all(
        isinstance(na, str) and na == nb and _same_arguments(aa, ab, defaults.of(na))
        for (na, aa), (nb, ab) in zip(calls_a, calls_b)
    )


def _system(messages: Sequence[Any]) -> Any:
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        return _text(first.get("content"))
    return None


def _tool_key(tool: Any) -> Any:
    """A tool without per-request markers (Anthropic's cache_control) that do not reach the template."""
    if not isinstance(tool, dict):
        return tool
    return {k: v for k, v in tool.items() if k != "cache_control"}


def _json_text(value: Any) -> bytes | None:
    """``value`` as JSON text with sorted keys; None where orjson cannot write it."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return None


def _same_tools(a: Sequence[Any], b: Sequence[Any]) -> bool:
    if len(a) != len(b):
        return False
    left, right = [_tool_key(x) for x in a], [_tool_key(y) for y in b]
    # A harness sends the same tools on every call: tens of KiB of schemas, which _json_equal walks in Python (most
    # of a continuation check). The same JSON text with sorted keys is the same JSON value, but for a NaN or an
    # infinity, which orjson writes as null: == on the values tells those apart (a NaN equals only itself, the very
    # same object, which two parsed requests never share).
    text = _json_text(left)
    if text is not None and text == _json_text(right) and left == right:
        return True
    return all(_json_equal(x, y) for x, y in zip(left, right))


def _sampling_change(previous: CanonicalRequest, new: CanonicalRequest) -> str | None:
    for name in _DISTRIBUTION:
        before, after = getattr(previous.sampling, name), getattr(new.sampling, name)
        if before != after:
            return f"{name} changed from {before!r} to {after!r}"
    return None


def plain_history(messages: Sequence[Any]) -> bool:
    """Whether same_message reads each of ``messages`` as text alone (text content and reasoning, calls by name and
    argument text). A later history ``==`` to such a one is then the same to the model, message by message: the
    shortcut check_continuity takes for a session's repeated history (tens of messages walked in Python per call)."""
    for message in messages:
        if not isinstance(message, dict) or _text(message.get("content")) is None:
            return False
        if message.get("role") == "assistant":
            calls = _calls(message)
            if _text(_reasoning(message)) is None or calls is None:
                return False
            if not all(isinstance(name, str) and isinstance(arguments, str) for name, arguments in calls):
                return False
    return True


def check_continuity(
    previous: CanonicalRequest, returned: AssistantMessage, new: CanonicalRequest, *, previous_plain: bool = False
) -> Continuity:
    """Whether ``new`` continues ``previous`` after polar answered it with ``returned``.

    Pass both requests as the gateway sends them on (sampling defaults filled), so that a parameter the
    client leaves out compares as the value the engine used. ``previous_plain``: :func:`plain_history` of
    ``previous.messages``, where the caller keeps it (a chain is checked against every later call of its session).
    """
    if new.model != previous.model:
        return Diverged(DivergeReason.OTHER, f"model changed from {previous.model!r} to {new.model!r}")
    if new.enable_thinking != previous.enable_thinking:
        return Diverged(DivergeReason.OTHER, "the thinking switch changed")
    if not _same_tools(previous.tools, new.tools):
        return Diverged(DivergeReason.CHANGED_TOOLS, "the tools list changed")
    if not _json_equal(previous.tool_choice, new.tool_choice):
        return Diverged(DivergeReason.CHANGED_TOOLS, "tool_choice changed")
    changed = _sampling_change(previous, new)
    if changed:
        return Diverged(DivergeReason.CHANGED_SAMPLING, changed)

    old, messages = previous.messages, new.messages
    if not isinstance(messages, list) or not isinstance(old, list):
        return Diverged(DivergeReason.OTHER, "messages are not a list")
    if not all(isinstance(m, dict) for m in messages):
        return Diverged(DivergeReason.OTHER, "a message is not an object")
    if _system(old) != _system(messages):
        return Diverged(DivergeReason.NEW_SYSTEM_PROMPT, "the system prompt changed")
    harness = new.compaction_prompt
    if harness is not None and previous.compaction_prompt is None:
        return Diverged(DivergeReason.COMPACTION, f"{harness} asks for a summary of the conversation")
    defaults = _Defaults(new.tools)
    repeated = previous_plain and messages[: len(old)] == old  # == compares in C what the loop would in Python
    for index, message in enumerate(() if repeated else old):
        if index >= len(messages) or not _same_message(message, messages[index], defaults):
            summarised = summarised_history(messages)
            if summarised is not None and summarised_history(old) is None:
                return Diverged(DivergeReason.COMPACTION, f"the history is a {summarised} summary")
            if index >= len(messages):
                return Diverged(
                    DivergeReason.EDITED_HISTORY, f"the history is shorter ({len(messages)} messages, was {len(old)})"
                )
            return Diverged(DivergeReason.EDITED_HISTORY, f"message {index} changed")
    at = len(old)
    if at >= len(messages):
        return Diverged(DivergeReason.OTHER, "the previous request again (a retry or another sample)")
    if not _same_message(returned.to_openai(), messages[at], defaults):
        return Diverged(DivergeReason.EDITED_HISTORY, f"message {at} is not the assistant turn polar returned")
    new_messages = messages[at + 1 :]
    if not new_messages:
        return Diverged(DivergeReason.OTHER, "no new messages after the returned turn (a retry or another sample)")
    for offset, message in enumerate(new_messages, start=at + 1):
        if message.get("role") not in NEW_MESSAGE_ROLES:
            role = message.get("role")
            return Diverged(
                DivergeReason.EDITED_HISTORY,
                f"message {offset} is a new {role!r} message, not a tool result or user turn",
            )
        if _text(message.get("content")) is None:
            return Diverged(DivergeReason.OTHER, f"message {offset} has content that is not text")
    return Continues(list(new_messages))
