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
trailing newline (the template's framing) and is typed against the tool's JSON schema the way the vLLM
polar serves does (``coerce_to_schema_type``, see :func:`typed_value`); a parameter the schema does not
name stays text. A composite parameters schema (anyOf/oneOf/allOf of objects) merges its branches'
properties, as SGLang reads it. ``arguments`` is ``json.dumps(..., ensure_ascii=False)``, byte-equal to
vLLM's for the same call.

Where vLLM guesses, this parser reads the block as not a call, so the turn is visibly a failed parse
(the block stays in ``content`` and in ``ParsedTurn.failed``): an unclosed ``<tool_call>`` or
``<parameter=`` (a block ends at its first ``</tool_call>``, so a value cannot hold that text), a
bare ``<function=`` without ``<tool_call>`` (failed from the tag to the next block), text between parameters,
a repeated parameter name (vLLM keeps the last).
"""

from __future__ import annotations

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

# vLLM's spellings of JSON Schema types (vllm/tool_parsers/utils.py _TYPE_ALIASES).
_TYPE_ALIASES = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "int": "integer",
    "int32": "integer",
    "int64": "integer",
    "uint": "integer",
    "uint32": "integer",
    "uint64": "integer",
    "long": "integer",
    "short": "integer",
    "unsigned": "integer",
    "float": "number",
    "float32": "number",
    "float64": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "arr": "array",
    "list": "array",
    "sequence": "array",
}
# The order vLLM tries a value's possible types in.
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


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


def schema_types(spec: Any) -> set[str]:
    """Every type a parameter's schema allows: ``type`` (a name or a list), the types of its ``enum`` values,
    and those of its anyOf/oneOf/allOf branches; ``{"string"}`` when it says none (vLLM's reading)."""
    if not isinstance(spec, dict):
        return {"string"}
    types: set[str] = set()
    kind = spec.get("type")
    for name in kind if isinstance(kind, list) else [kind]:
        if isinstance(name, str):
            types.add(_TYPE_ALIASES.get(name.strip().lower(), name.strip().lower()))
    enum = spec.get("enum")
    for value in enum if isinstance(enum, list) else []:
        types.add("null" if value is None else next((t for cls, t in _ENUM_TYPES if isinstance(value, cls)), "string"))
    for keyword in _COMPOSITE:
        branches = spec.get(keyword)
        for branch in branches if isinstance(branches, list) else []:
            types |= schema_types(branch)
    return types or {"string"}


def _finite_json(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)  # 1e999 reads as inf, which has no JSON form
    except (ValueError, RecursionError):
        return False, None
    return True, value


def typed_value(value: str, spec: Any, *, known: bool) -> Any:
    """One parameter's text typed against its schema ``spec`` (``known``: the schema names it), as vLLM's
    ``coerce_to_schema_type`` does: each allowed type in the order null, integer, number (finite only;
    integral values become ints), boolean (true/false/1/0), object, array, string; the first that reads the
    text wins; if none does, the text as JSON when it is finite JSON, else the text."""
    if not known:
        return value
    types = schema_types(spec)
    for kind in _PRIORITY:
        if kind not in types:
            continue
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "string":
            return value
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            ok, parsed = _finite_json(value)
            if ok:
                return parsed
    ok, parsed = _finite_json(value)
    return parsed if ok else value


def _call(name: str, params: dict[str, str], tools: Sequence[dict[str, Any]]) -> ToolCall:
    props = _properties(tools, name)
    arguments = {key: typed_value(value, props.get(key), known=key in props) for key, value in params.items()}
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _extract(text: str, tools: Sequence[dict[str, Any]]) -> tuple[str | None, list[ToolCall], list[str]]:
    calls: list[ToolCall] = []
    failed: list[str] = []
    kept: list[str] = []
    between: list[str] = []  # the text outside blocks
    at = 0
    while (start := text.find(TOOL_OPEN, at)) >= 0:
        between.append(text[at:start])
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
    between.append(text[at:])
    kept.append(text[at:])
    # Between blocks, a bare <function= is a call written without its <tool_call> (vLLM reads it as one): a
    # failed parse, from the tag to the next block.
    failed.extend(segment[segment.index(FUNC_OPEN) :] for segment in between if FUNC_OPEN in segment)
    if not calls:
        return text, [], failed
    remaining = "".join(kept).strip()
    return (remaining or None), calls, failed


def parse(text: str, tools: Sequence[dict[str, Any]] = ()) -> ParsedTurn:
    """Split decoded model output into reasoning, content and calls typed against ``tools`` (canonical tools)."""
    reasoning, rest = split_reasoning(text)
    content, calls, failed = _extract(rest, tools)
    return ParsedTurn(AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls), failed)
