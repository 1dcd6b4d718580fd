"""Tool calls small models write as JSON instead of their template's markup: an opt-in fallback.

Qwen2.5-Coder-0.5B-Instruct, shown a tool-using prompt, answers with a Markdown block holding
``{"name": "bash", "arguments": {"command": "ls"}}`` after a ```` ```json ```` fence rather than a ``<tool_call>``
block, so neither its engine's parser nor polar's sees a call. This module reads those variants:

- a fenced block (```` ```json ```` or a bare ```` ``` ````) whose whole body is a call object, or a JSON list of them;
- the whole message being one such object or list, unfenced;
- a call object is ``{"name": N, "arguments": {...}}``; ``parameters`` is read as ``arguments``, arguments given as
  JSON text are decoded, missing ones are ``{}``, and the OpenAI wire form ``{"type": "function", "function":
  {...}}`` is unwrapped.

Only names among the request's tools become calls: a block naming anything else (or any block that is not such JSON:
code, a config file, malformed JSON) stays in the content verbatim, and is no parse failure either, because a fenced
JSON block is ordinary text far more often than it is a call. A block is all or nothing: a list with one entry that
is not a known call stays text whole. The text around converted blocks stays as content.

Never a parser on its own: ``polar_tool_parser=hermes+fenced_json`` tries it on the content of a turn in which the
engine's parser (or polar's ``hermes``) found no call (:class:`polar_addon.tool_parsers.ParserChain`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

from polar_addon.canonical import ToolCall
from polar_addon.tool_parsers.calls import new_call_id

NAME = "fenced_json"

# An opening fence with no info string or ``json`` (any case), its body, and the next closing fence. A ```python
# block does not match: the newline must follow the info string.
_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def tool_names(tools: Sequence[dict[str, Any]]) -> set[str]:
    """The function names a request offers (canonical tools are OpenAI's ``{"type": "function", "function": ...}``)."""
    names = set()
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
        if isinstance(name, str) and name:
            names.add(name)
    return names


def _call(data: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("function"), dict) and "name" not in data:
        data = data["function"]
    name = data.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments: Any = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=orjson.dumps(arguments).decode())


def _calls(body: str, names: set[str]) -> list[ToolCall] | None:
    """The calls ``body`` holds as a whole, or None when it is anything but known calls."""
    try:
        data = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = [_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def extract(text: str | None, tools: Sequence[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """(The content left, the calls) from ``text``; ``(text, [])`` unchanged when it holds no call to a known tool."""
    names = tool_names(tools)
    if not text or not names:
        return text, []
    calls: list[ToolCall] = []

    def replace(match: re.Match[str]) -> str:
        found = _calls(match.group(1), names)
        if found is None:
            return match.group(0)
        calls.extend(found)
        return ""

    remaining = _FENCE_RE.sub(replace, text)
    if not calls:
        stripped = text.strip()
        if stripped[:1] in ("{", "[") and (whole := _calls(stripped, names)) is not None:
            return None, whole
        return text, []
    # Converted blocks leave the blank lines that stood around them.
    remaining = re.sub(r"\n{3,}", "\n\n", remaining).strip()
    return (remaining or None), calls
