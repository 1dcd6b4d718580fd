"""Qwen3-Coder edges the main tests leave open (issue 29's survivors): which types a parameter schema allows
(vLLM's ``extract_types_from_schema`` and type aliases), how a value is typed when a schema allows several
types (vLLM's ``coerce_to_schema_type`` priority, exact Python types: ``True`` is not ``1``), odd tool lists,
and where a bare ``<function=`` failure starts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from polar_addon.tool_parsers.qwen3_coder import parse, schema_types, typed_value


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # A schema that is not an object (JSON Schema's `true`, a bare type name) says nothing: text.
        (None, {"string"}),
        (True, {"string"}),
        ("integer", {"string"}),
        # vLLM's aliases, looked up after trimming and lower-casing the name.
        ({"type": "Int"}, {"integer"}),
        ({"type": " STR "}, {"string"}),
        ({"type": ["Double", "null"]}, {"number", "null"}),
        ({"type": "uuid"}, {"uuid"}),  # an unknown name is kept as written (lower-cased): it types nothing
        # Enum values say their types; None is null.
        ({"enum": ["a", "b"]}, {"string"}),
        ({"enum": [1, None]}, {"integer", "null"}),
        ({"enum": [True, 1.5, [1], {"a": 1}]}, {"boolean", "number", "array", "object"}),
        # A value of no JSON type (only a Python caller can build one) reads as text, and never raises.
        ({"enum": [("a",)]}, {"string"}),
        # Every branch adds to what the schema's own type and the earlier branches allow.
        ({"type": "integer", "anyOf": [{"type": "string"}, {"type": "null"}]}, {"integer", "string", "null"}),
        ({"oneOf": [{"type": "boolean"}], "allOf": [{"enum": [2]}]}, {"boolean", "integer"}),
    ],
)
def test_schema_types(spec: Any, expected: set[str]) -> None:
    assert schema_types(spec) == expected


@pytest.mark.parametrize(
    ("value", "spec", "expected"),
    [
        ("5", True, "5"),  # a named parameter whose schema is not an object: text, not the JSON 5
        ("5", {"type": "str"}, "5"),  # the alias str is string: not read as JSON
        ("7", {"type": "INT"}, 7),
        ("1", {"enum": ["1", "2"]}, "1"),  # a string enum keeps its text
        ("null", {"enum": [1, None]}, None),
        ("null", {"enum": ["a", None]}, None),
        # Several types: the first in vLLM's order that reads the text wins.
        ("5", {"type": ["integer", "string"]}, 5),
        ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
        ("05", {"type": "integer"}, 5),  # int() reads it; JSON would not
        ("1.5", {"type": ["integer", "string"]}, "1.5"),  # not an int: on to string
        ("2.5", {"type": ["number", "string"]}, 2.5),
        ("1e2", {"type": "number"}, 100),  # integral numbers become ints, as in vLLM
        ("5", {"type": "number"}, 5),
        ("[1]", {"type": ["number", "string"]}, "[1]"),  # not a number: on to string, not JSON
        ("[1]", {"type": ["null", "string"]}, "[1]"),
        ("[1]", {"type": ["boolean", "string"]}, "[1]"),
        ('{"a": 1}', {"type": ["object", "string"]}, {"a": 1}),
        ("[1]", {"type": ["array", "string"]}, [1]),
        ('{"a": 1}', {"type": ["array", "string"]}, {"a": 1}),  # as in vLLM, the array type takes any JSON
        # Booleans: true/1 and false/0, any case, trimmed; exactly True/False, never 1/0.
        ("1", {"type": "boolean"}, True),
        ("0", {"type": "boolean"}, False),
        ("false", {"type": "boolean"}, False),
        ("False", {"type": "boolean"}, False),
        (" TRUE ", {"type": "boolean"}, True),
        ("2", {"type": "boolean"}, 2),  # not a boolean word: read as JSON
    ],
)
def test_typed_value_exact_type(value: str, spec: Any, expected: Any) -> None:
    got = typed_value(value, spec, known=True)
    # Exact types: 5 vs 5.0 and True vs 1 compare equal in Python but are different arguments on the wire.
    assert (type(got), got) == (type(expected), expected)
    assert json.dumps(got) == json.dumps(expected)


def test_number_arguments_text_as_vllm_writes_it() -> None:
    tools = [_tool("t", {"type": "object", "properties": {"n": {"type": "number"}, "b": {"type": "boolean"}}})]
    text = (
        "<tool_call>\n<function=t>\n<parameter=n>\n3\n</parameter>\n<parameter=b>\n0\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    [call] = parse(text, tools).message.tool_calls
    assert call.arguments == '{"n": 3, "b": false}'


def test_names_may_hold_any_letter() -> None:
    # Only '<' and a newline make a tag's name malformed; capital letters (X included) are names.
    tools = [_tool("get_XML", {"type": "object", "properties": {"maxX": {"type": "integer"}}})]
    text = "<tool_call>\n<function=get_XML>\n<parameter=maxX>\n3\n</parameter>\n</function>\n</tool_call>"
    turn = parse(text, tools)
    assert [(c.name, c.arguments) for c in turn.message.tool_calls] == [("get_XML", '{"maxX": 3}')]
    assert turn.failed == [] and turn.message.content is None


def test_tool_list_entries_that_are_not_tools_are_skipped() -> None:
    tools: list[Any] = ["junk", None, 7, _tool("t", {"type": "object", "properties": {"n": {"type": "integer"}}})]
    text = "<tool_call><function=t><parameter=n>4</parameter></function></tool_call>"
    [call] = parse(text, tools).message.tool_calls
    assert call.arguments == '{"n": 4}'


def test_composite_parameters_skip_branches_without_properties() -> None:
    # An anyOf branch with no properties (or not an object at all) adds none; the others still type the values.
    parameters = {
        "anyOf": [
            {"type": "object"},
            "junk",
            {"type": "object", "properties": "not a dict"},
            {"type": "object", "properties": {"n": {"type": "integer"}}},
        ]
    }
    text = "<tool_call><function=t><parameter=n>4</parameter><parameter=m>4</parameter></function></tool_call>"
    [call] = parse(text, [_tool("t", parameters)]).message.tool_calls
    assert call.arguments == '{"n": 4, "m": "4"}'  # m is named by no branch: text


def test_bare_functions_fail_from_the_first_tag() -> None:
    first = "<function=a>\n</function>\n"
    second = "<function=b>\n</function>"
    turn = parse("text " + first + second, [])
    assert turn.message.tool_calls == []
    assert turn.failed == [first + second]
