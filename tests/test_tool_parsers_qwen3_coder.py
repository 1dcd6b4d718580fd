"""Qwen3-Coder XML tool calls: vLLM's own expected outputs (tests/tool_use/test_qwen3coder_tool_parser.py),
typing against the schema, several calls, think blocks, and malformed calls kept visible."""

from __future__ import annotations

import json

import pytest

from polar_addon.tool_parsers import PARSERS, get_parser, hermes
from polar_addon.tool_parsers.qwen3_coder import parse, typed_value


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


# vLLM's sample_tools fixture.
TOOLS = [
    _tool(
        "get_current_weather",
        {
            "city": {"type": "string"},
            "state": {"type": "string"},
            "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]},
        },
    ),
    _tool(
        "calculate_area",
        {"shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}},
    ),
]

DALLAS = (
    "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
    "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>"
)
ORLANDO = DALLAS.replace("Dallas", "Orlando").replace("TX", "FL")
WEATHER = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}

# (id, model output, expected [(name, arguments)], expected content): vLLM's test_extract_tool_calls cases.
VLLM_CASES = [
    ("single_tool", DALLAS, [("get_current_weather", WEATHER)], None),
    (
        "single_tool_with_content",
        "Sure! Let me check the weather for you." + DALLAS,
        [("get_current_weather", WEATHER)],
        "Sure! Let me check the weather for you.",
    ),
    (
        "single_tool_multiline_param",
        "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n"
        '<parameter=dimensions>\n{"width": 10, \n "height": 20}\n</parameter>\n'
        "<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>",
        [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})],
        None,
    ),
    (
        "parallel_tools",
        DALLAS + "\n" + ORLANDO,
        [
            ("get_current_weather", WEATHER),
            ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"}),
        ],
        None,
    ),
    (
        "tool_with_typed_params",
        "Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n"
        '<parameter=shape>\ncircle\n</parameter>\n<parameter=dimensions>\n{"radius": 15.5}\n</parameter>\n'
        "<parameter=precision>\n3\n</parameter>\n</function>\n</tool_call>",
        [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})],
        "Let me calculate that area for you.",
    ),
]


@pytest.mark.parametrize(("text", "expected", "content"), [c[1:] for c in VLLM_CASES], ids=[c[0] for c in VLLM_CASES])
def test_vllm_expected_outputs(text, expected, content):
    turn = parse(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in turn.message.tool_calls] == expected
    assert turn.message.content == content
    assert turn.failed == []
    # vLLM's arguments text is json.dumps(params, ensure_ascii=False): byte-equal, key order as written.
    assert [c.arguments for c in turn.message.tool_calls] == [json.dumps(a, ensure_ascii=False) for _, a in expected]
    assert len({c.id for c in turn.message.tool_calls}) == len(expected)


def test_vllm_no_tools_output_is_content():
    turn = parse("This is a test response without any tool calls", TOOLS)
    assert turn.message.content == "This is a test response without any tool calls"
    assert turn.message.tool_calls == [] and turn.failed == []


def test_vllm_type_conversion():
    tools = [
        _tool(
            "test_types",
            {
                "int_param": {"type": "integer"},
                "float_param": {"type": "float"},
                "bool_param": {"type": "boolean"},
                "str_param": {"type": "string"},
                "obj_param": {"type": "object"},
            },
        )
    ]
    text = (
        "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n3.14\n"
        "</parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\nhello world\n</parameter>\n"
        '<parameter=obj_param>\n{"key": "value"}\n</parameter>\n</function>\n</tool_call>'
    )
    [call] = parse(text, tools).message.tool_calls
    assert json.loads(call.arguments) == {
        "int_param": 42,
        "float_param": 3.14,
        "bool_param": True,
        "str_param": "hello world",
        "obj_param": {"key": "value"},
    }


# The installed vLLM's qwen3_coder parser gives the same values for these (checked side by side once).
@pytest.mark.parametrize(
    ("value", "spec", "known", "expected"),
    [
        ("null", {"type": "string"}, True, "null"),  # a string parameter keeps the text "null"
        ("null", {"type": ["string", "null"]}, True, None),
        ("null", {"type": "integer"}, True, None),  # not an int: read as JSON
        ("NULL", None, False, "NULL"),  # not in the schema: text
        ("42", None, False, "42"),
        ("42", {"type": "string"}, True, "42"),
        ("42", {}, True, "42"),  # no type: string
        ("-7", {"type": "integer"}, True, -7),
        ("4.0", {"type": "integer"}, True, 4.0),  # not an int: read as JSON
        ("4.0", {"type": "number"}, True, 4),  # integral floats become ints
        ("2.5", {"type": ["number", "null"]}, True, 2.5),
        ("2.5", {"type": "float64"}, True, 2.5),  # vLLM's type aliases
        ("2", {"enum": [1, 2]}, True, 2),  # enum values say the type
        ("nan", {"type": "number"}, True, "nan"),
        ("1e999", {"type": "number"}, True, "1e999"),  # inf has no JSON form
        ("[1e999]", {"type": "array"}, True, "[1e999]"),
        ("True", {"type": "boolean"}, True, True),
        ("0", {"type": "bool"}, True, False),
        ("yes", {"type": "boolean"}, True, "yes"),
        ("[1, 2]", {"type": "array"}, True, [1, 2]),
        ("['a', 'b']", {"type": "array"}, True, "['a', 'b']"),  # a Python literal is not JSON: text
        ('{"a": 1}', {"anyOf": [{"type": "object"}, {"type": "null"}]}, True, {"a": 1}),
        ("not json", {"type": "object"}, True, "not json"),
        ("[" * 100_000, {"type": "array"}, True, "[" * 100_000),  # too deep for any reader: text, no crash
    ],
)
def test_typed_value(value, spec, known, expected):
    assert typed_value(value, spec, known=known) == expected


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf", "allOf"])
@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [("integer", "42", 42), ("boolean", "true", True), ("object", '{"x": 1}', {"x": 1}), ("array", "[1, 2]", [1, 2])],
)
def test_sglang_composite_parameter_schemas(keyword, kind, value, expected):
    # SGLang's cases: the parameters schema is a composite of object schemas; their properties type the values.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "example_function",
                "parameters": {keyword: [{"type": "object", "properties": {"value": {"type": kind}}}]},
            },
        }
    ]
    text = f"<tool_call><function=example_function><parameter=value>{value}</parameter></function></tool_call>"
    [call] = parse(text, tools).message.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("example_function", {"value": expected})


def test_sglang_nullable_array_parameter():
    # SGLang's "cities" case: anyOf [array of strings, null] reads the value as JSON.
    tools = [
        _tool(
            "get_weather",
            {"cities": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}], "default": None}},
        )
    ]
    text = (
        '<tool_call>\n<function=get_weather>\n<parameter=cities>\n["Paris", "Rome"]\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    [call] = parse(text, tools).message.tool_calls
    assert json.loads(call.arguments) == {"cities": ["Paris", "Rome"]}


def test_think_block_and_calls():
    turn = parse("<think>\nneed weather\n</think>\n\nChecking." + DALLAS, TOOLS)
    assert turn.message.reasoning == "need weather"
    assert turn.message.content == "Checking."
    assert [c.name for c in turn.message.tool_calls] == ["get_current_weather"]
    # A call written inside the reasoning is reasoning, not a call.
    inside = parse("<think>" + DALLAS + "</think>done", TOOLS)
    assert inside.message.tool_calls == [] and inside.message.content == "done"


def test_several_functions_in_one_block_and_values_with_markup():
    text = (
        "<tool_call>\n<function=write>\n<parameter=content>\n<b>x</b>\n</function> <tool_call>\n"
        "</parameter>\n</function>\n"
        "<function=ls>\n</function>\n</tool_call>"
    )
    turn = parse(text, [])
    # A value may hold tags, even </function>; only </parameter> ends it (and </tool_call> ends the block).
    assert [(c.name, json.loads(c.arguments)) for c in turn.message.tool_calls] == [
        ("write", {"content": "<b>x</b>\n</function> <tool_call>"}),
        ("ls", {}),
    ]
    assert turn.failed == []


def test_values_keep_inner_newlines_and_unicode():
    text = "<tool_call>\n<function=write>\n<parameter=content>\n\nline1\n  ü\n\n</parameter>\n</function>\n</tool_call>"
    [call] = parse(text, []).message.tool_calls
    assert json.loads(call.arguments) == {"content": "\nline1\n  ü\n"}
    assert "ü" in call.arguments  # ensure_ascii=False, as vLLM


MALFORMED = [
    ("unclosed_tool_call", "<tool_call>\n<function=f>\n</function>\n"),
    ("unclosed_parameter", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"),
    ("no_function", "<tool_call>\n</tool_call>"),
    ("hermes_json_in_xml_format", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    ("empty_name", "<tool_call>\n<function=>\n</function>\n</tool_call>"),
    ("name_without_close", "<tool_call>\n<function=f\n</function>\n</tool_call>"),
    (
        "text_between_parameters",
        "<tool_call>\n<function=f>\nhello\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    ),
    (
        "repeated_parameter",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",
    ),
    ("unclosed_function", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),
]


@pytest.mark.parametrize("block", [m[1] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_call_is_a_visible_failed_parse(block):
    alone = parse(block, TOOLS)
    assert alone.message.tool_calls == [] and alone.message.content == block and alone.failed == [block]
    # Next to a good call: the good one parses, the bad one stays in content and in failed.
    mixed = parse(block + "\n" + DALLAS if block.endswith("</tool_call>") else DALLAS + "\n" + block, TOOLS)
    assert [c.name for c in mixed.message.tool_calls] == ["get_current_weather"]
    assert mixed.message.content == block.strip() and mixed.failed == [block]


def test_bare_function_without_tool_call_is_text():
    # vLLM falls back to reading a bare <function=...>; polar keeps it visible as text (no call, no guess).
    text = "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>"
    assert parse(text, TOOLS).message.tool_calls == []
    assert parse(text, TOOLS).message.content == text
    # ... and reports it as a failed parse, from the tag to the next block, also next to a good call.
    assert parse(text, TOOLS).failed == [text]
    mixed = parse(DALLAS + "\nand " + text, TOOLS)
    assert [c.name for c in mixed.message.tool_calls] == ["get_current_weather"] and mixed.failed == [text]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" * 1000,
        "<tool_call><function=" * 500,
        "<parameter=" * 1000,
        "\x00<tool_call>\n<function=\x00>\n</function>\n</tool_call>",
    ],
)
def test_hostile_text_never_raises(text):
    turn = parse(text, TOOLS)
    assert turn.message.content is not None or turn.message.tool_calls


def test_registry():
    assert get_parser("qwen3_coder") is parse
    assert get_parser("hermes") is hermes.parse and get_parser("qwen25") is hermes.parse
    with pytest.raises(ValueError, match="known: hermes, qwen25, qwen3_coder"):
        get_parser("nope")
    # One format's output is not another's call.
    assert get_parser("hermes")(DALLAS, TOOLS).message.tool_calls == []
    assert set(PARSERS) == {"hermes", "qwen25", "qwen3_coder"}
