"""Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number.

The format the tiny model's chat template renders and vLLM's ``hermes`` / SGLang's ``qwen25`` parsers
read. Reasoning is a ``<think>`` block before the answer (:mod:`polar_addon.tool_parsers.reasoning`).

Malformed blocks (invalid JSON, no string ``name``, arguments neither object nor JSON text, a
``<tool_call>`` never closed) are not calls: they stay in ``content`` verbatim, so the trajectory filter can still
see a literal ``<tool_call>`` and score the turn as parser-invalid, while well-formed blocks in the same
message become calls. (vLLM's hermes parser instead drops every call of a message when one
fails; keeping the good ones loses nothing the text would not show.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

from polar_addon.canonical import AssistantMessage, ToolCall
from polar_addon.tool_parsers.calls import ParsedTurn, new_call_id
from polar_addon.tool_parsers.reasoning import split_reasoning

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_call_body(body: str) -> ToolCall | None:
    try:
        data = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments: Any = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models emit the arguments as JSON text; normalise it to compact JSON text.
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=data["name"], arguments=orjson.dumps(arguments).decode())


def _extract(text: str) -> tuple[str | None, list[ToolCall], list[str]]:
    calls: list[ToolCall] = []
    failed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        call = _parse_call_body(match.group(1))
        if call is None:
            failed.append(match.group(0))
            return match.group(0)
        calls.append(call)
        return ""

    remaining = _TOOL_CALL_RE.sub(replace, text)
    # An opening tag no </tool_call> closes (a block ends at the first one) is a call that did not parse too:
    # everything from it on, as the text holds it.
    closed = text.rfind("</tool_call>")
    unclosed = text.find("<tool_call>", closed + len("</tool_call>") if closed >= 0 else 0)
    if unclosed >= 0:
        failed.append(text[unclosed:])
    if not calls:
        return text, [], failed
    remaining = remaining.strip()
    return (remaining or None), calls, failed


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Extract well-formed ``<tool_call>`` blocks; return (remaining content, calls)."""
    content, calls, _ = _extract(text)
    return content, calls


def parse(text: str, tools: Sequence[dict[str, Any]] = ()) -> ParsedTurn:
    """Split decoded model output into reasoning, content and calls; ``tools`` is unused (JSON carries types)."""
    reasoning, rest = split_reasoning(text)
    content, calls, failed = _extract(rest)
    return ParsedTurn(AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls), failed)


def parse_assistant_text(text: str) -> AssistantMessage:
    """Split decoded model output into reasoning, content and tool calls."""
    return parse(text).message
