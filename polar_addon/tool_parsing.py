"""Turn raw generated text into an AssistantMessage (Hermes / Qwen conventions).

Engines that decode text themselves (local, scripted) use this; SGLang and vLLM run their own
parsers server-side. The conventions are the ones the tiny model's chat template renders and
vLLM's ``hermes`` / SGLang's ``qwen25`` parsers read:

- reasoning: ``<think>...</think>`` before the answer. The opening tag may be missing (Qwen3
  templates put it in the generation prompt), so everything before ``</think>`` is reasoning.
  An unclosed ``<think>`` (generation cut off while thinking) makes the whole rest reasoning.
- tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number.

Malformed blocks (invalid JSON, no string ``name``, arguments neither object nor JSON text) are
not calls: they stay in ``content`` verbatim, so the trajectory filter can still see a literal
``<tool_call>`` and score the turn as parser-invalid, while well-formed blocks in the same
message become calls. (vLLM's hermes parser instead drops every call of a message when one
fails; keeping the good ones loses nothing the text would not show.)
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import orjson

from polar_addon.canonical import AssistantMessage, ToolCall

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Return (reasoning or None, the text after the reasoning block)."""
    close = text.find(THINK_CLOSE)
    if close >= 0:
        head = text[:close]
        open_at = head.find(THINK_OPEN)
        if open_at >= 0:
            head = head[open_at + len(THINK_OPEN) :]
        return head.strip() or None, text[close + len(THINK_CLOSE) :].lstrip()
    open_at = text.find(THINK_OPEN)
    if open_at >= 0 and not text[:open_at].strip():
        return text[open_at + len(THINK_OPEN) :].strip() or None, ""
    return None, text


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


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Extract well-formed ``<tool_call>`` blocks; return (remaining content, calls)."""
    calls: list[ToolCall] = []

    def replace(match: re.Match[str]) -> str:
        call = _parse_call_body(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    remaining = _TOOL_CALL_RE.sub(replace, text)
    if not calls:
        return text, []
    remaining = remaining.strip()
    return (remaining or None), calls


def parse_assistant_text(text: str) -> AssistantMessage:
    """Split decoded model output into reasoning, content and tool calls."""
    reasoning, rest = split_reasoning(text)
    content, calls = parse_tool_calls(rest)
    return AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls)
