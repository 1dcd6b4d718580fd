"""Qwen3-Coder XML tool calls, as vLLM's and SGLang's ``qwen3_coder`` parsers read them::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Any number of blocks per turn, after an optional ``<think>`` block. A value loses one leading and one
trailing newline (the template's framing) and is typed against the tool's JSON schema the way vLLM's
``Qwen3CoderToolParser._convert_param_value`` does: ``null`` is None whatever the type; string-like
types stay text; integer/number types become numbers (integral floats become ints); booleans accept
``true``/``false``; object/array types are JSON, then a Python literal; a parameter the schema does
not name stays text. A parameter typed only through anyOf/oneOf/allOf takes its first non-null
branch's type, and a composite parameters schema merges its branches' properties (as SGLang reads
them). ``arguments`` is ``json.dumps(..., ensure_ascii=False)``, byte-equal to vLLM's.

Where vLLM guesses, this parser reads the block as not a call, so the turn is visibly a failed parse
(the block stays in ``content`` and in ``ParsedTurn.failed``): an unclosed ``<tool_call>`` or
``<parameter=`` (a block ends at its first ``</tool_call>``, so a value cannot hold that text), a
bare ``<function=`` without ``<tool_call>``, text between parameters, a repeated parameter name. A boolean other than true/false stays text (vLLM makes it false: an invented value),
and a non-finite number stays text (as in vLLM).
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from typing import Any

from polar_addon.canonical import AssistantMessage, ToolCall
from polar_addon.tool_parsers.calls import ParsedTurn, new_call_id
from polar_addon.tool_parsers.reasoning import split_reasoning

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_WHITESPACE = " \t\r\n"

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_BOOL_TYPES = {"boolean", "bool", "binary"}
_JSON_TYPES = {"object", "array", "arr"}


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def _tag_name(text: str, at: int) -> tuple[str, int] | None:
    """The NAME of ``<tag=NAME>`` starting after the ``=`` at ``at``; None unless it is one line, no brackets."""
    close = text.find(">", at)
    if close < 0:
        return None
    name = text[at:close]
    if not name.strip() or any(c in name for c in "<\n"):
        return None
    return name, close + 1


def _parse_function(text: str, at: int) -> tuple[str, dict[str, str], int] | None:
    """``<function=NAME>`` params ``</function>`` from ``at`` (just past ``<function=``)."""
    named = _tag_name(text, at)
    if named is None:
        return None
    name, at = named
    params: dict[str, str] = {}
    while True:
        at = _skip_space(text, at)
        if text.startswith(FUNC_CLOSE, at):
            return name, params, at + len(FUNC_CLOSE)
        if not text.startswith(PARAM_OPEN, at):
            return None
        param = _tag_name(text, at + len(PARAM_OPEN))
        if param is None:
            return None
        key, at = param
        end = text.find(PARAM_CLOSE, at)
        if end < 0 or key in params:
            return None
        value = text[at:end]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        params[key] = value
        at = end + len(PARAM_CLOSE)


def _parse_block(body: str) -> list[tuple[str, dict[str, str]]] | None:
    """The functions of one ``<tool_call>`` block's body; None unless it is nothing but functions."""
    functions: list[tuple[str, dict[str, str]]] = []
    at = 0
    while True:
        at = _skip_space(body, at)
        if at == len(body) and functions:
            return functions
        if not body.startswith(FUNC_OPEN, at):
            return None
        parsed = _parse_function(body, at + len(FUNC_OPEN))
        if parsed is None:
            return None
        name, params, at = parsed
        functions.append((name, params))


_COMPOSITE = ("anyOf", "oneOf", "allOf")


def _properties(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The tool's parameter schemas by name; a composite schema (anyOf/oneOf/allOf of objects) merges its branches'."""
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            if not isinstance(params, dict):
                return {}
            if isinstance(params.get("properties"), dict):
                return params["properties"]
            merged: dict[str, Any] = {}
            for keyword in _COMPOSITE:
                for branch in params.get(keyword) or []:
                    if isinstance(branch, dict) and isinstance(branch.get("properties"), dict):
                        merged = {**branch["properties"], **merged}
            return merged
    return {}


def _schema_type(spec: Any) -> str:
    """The type a parameter's value is read as: its ``type`` (the non-null one of a list), else the first
    non-null type among its anyOf/oneOf/allOf branches (``anyOf: [{type: array}, {type: null}]``), else string."""
    if not isinstance(spec, dict):
        return "string"
    kind = spec.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None:
        branches = [b for keyword in _COMPOSITE for b in spec.get(keyword) or [] if isinstance(b, dict)]
        kind = next((_schema_type(b) for b in branches if b.get("type") not in (None, "null")), None)
    return str(kind or "string").strip().lower()


def _json_representable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def typed_value(value: str, spec: Any, *, known: bool) -> Any:
    """One parameter's text typed against its schema ``spec`` (``known``: the schema names it)."""
    if value.lower() == "null":
        return None
    if not known:
        return value
    kind = _schema_type(spec)
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in _BOOL_TYPES:
        lowered = value.lower()
        return lowered == "true" if lowered in ("true", "false") else value
    if kind in _JSON_TYPES or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            pass
    try:
        # Models write Python literals (['a', 'b'], True) where JSON was meant; vLLM reads them the same way.
        literal = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
    return literal if _json_representable(literal) else value


def _call(name: str, params: dict[str, str], tools: Sequence[dict[str, Any]]) -> ToolCall:
    props = _properties(tools, name)
    arguments = {key: typed_value(value, props.get(key), known=key in props) for key, value in params.items()}
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _extract(text: str, tools: Sequence[dict[str, Any]]) -> tuple[str | None, list[ToolCall], list[str]]:
    calls: list[ToolCall] = []
    failed: list[str] = []
    kept: list[str] = []
    at = 0
    while (start := text.find(TOOL_OPEN, at)) >= 0:
        kept.append(text[at:start])
        # A block ends at the first </tool_call>, as in vLLM: an unclosed parameter cannot swallow the next call.
        end = text.find(TOOL_CLOSE, start)
        at = len(text) if end < 0 else end + len(TOOL_CLOSE)
        functions = None if end < 0 else _parse_block(text[start + len(TOOL_OPEN) : end])
        if functions is None:
            failed.append(text[start:at])
            kept.append(text[start:at])
            continue
        calls.extend(_call(name, params, tools) for name, params in functions)
    kept.append(text[at:])
    if not calls:
        return text, [], failed
    remaining = "".join(kept).strip()
    return (remaining or None), calls, failed


def parse(text: str, tools: Sequence[dict[str, Any]] = ()) -> ParsedTurn:
    """Split decoded model output into reasoning, content and calls typed against ``tools`` (canonical tools)."""
    reasoning, rest = split_reasoning(text)
    content, calls, failed = _extract(rest, tools)
    return ParsedTurn(AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls), failed)
