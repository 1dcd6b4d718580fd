"""Hermes tool-call and <think> parsing used by the local and scripted engines."""

from __future__ import annotations

import orjson

from polar_addon.tool_parsers.hermes import parse, parse_assistant_text, parse_tool_calls
from polar_addon.tool_parsers.reasoning import split_reasoning


def test_plain_text_is_content_untouched():
    msg = parse_assistant_text("  Hello, world.\n")
    assert msg.content == "  Hello, world.\n"
    assert msg.reasoning is None and msg.tool_calls == []


def test_single_call_with_leading_text():
    msg = parse_assistant_text(
        'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    )
    assert msg.content == "Let me look."
    [call] = msg.tool_calls
    assert call.name == "read_file"
    assert call.arguments == '{"path":"a.py"}'
    assert call.id.startswith("call_") and len(call.id) > 10


def test_parallel_calls_keep_order_and_get_distinct_ids():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"y": [1, 2], "z": "ü"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c.name for c in calls] == ["a", "b"]
    assert orjson.loads(calls[1].arguments) == {"y": [1, 2], "z": "ü"}
    assert calls[0].id != calls[1].id


def test_arguments_given_as_json_text_are_normalised():
    _, [call] = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>')
    assert call.arguments == '{"k":2}'


def test_malformed_block_stays_in_content_while_good_ones_parse():
    bad = '<tool_call>{"name": "f", "arguments": {oops}</tool_call>'
    good = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(f"{bad}\n{good}")
    assert [c.name for c in calls] == ["g"]
    assert calls[0].arguments == "{}"
    assert content == bad
    # No name, or arguments that are not an object: not a call either.
    for text in ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])


def test_unclosed_tool_call_is_text():
    text = '<tool_call>{"name": "f", "arguments": {}}'
    assert parse_tool_calls(text) == (text, [])


def test_think_block_becomes_reasoning():
    msg = parse_assistant_text("<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4.")
    assert msg.reasoning == "step 1\nstep 2"
    assert msg.content == "The answer is 4."


def test_think_without_opening_tag_and_with_calls():
    msg = parse_assistant_text('plan it\n</think>\n\n<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    assert msg.reasoning == "plan it"
    assert msg.content is None
    assert [c.name for c in msg.tool_calls] == ["ls"]


def test_unclosed_think_is_all_reasoning():
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")
    # A <think> that is not at the start is ordinary text.
    assert split_reasoning("x <think> y") == (None, "x <think> y")


def test_tool_call_inside_reasoning_is_not_a_call():
    msg = parse_assistant_text('<think><tool_call>{"name": "f", "arguments": {}}</tool_call></think>done')
    assert msg.tool_calls == []
    assert msg.content == "done"


def test_failed_blocks_are_reported_and_stay_in_content():
    bad = '<tool_call>{"name": "f", "arguments": {oops}</tool_call>'
    turn = parse(f'<think>x</think>{bad}<tool_call>{{"name": "g", "arguments": {{}}}}</tool_call>')
    assert turn.failed == [bad] and turn.parse_failed
    assert turn.message.content == bad and turn.message.reasoning == "x"
    assert parse("plain").failed == [] and not parse("plain").parse_failed


def test_an_unclosed_call_is_a_failed_parse():
    good = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    cut = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    turn = parse(f"{good} then {cut}")
    assert [c.name for c in turn.message.tool_calls] == ["g"]
    assert turn.failed == [cut] and turn.message.content == f"then {cut}"
    alone = parse(f"text {cut}")
    assert alone.failed == [cut] and alone.message.content == f"text {cut}" and alone.message.tool_calls == []
    # Another format's tag in prose is no hermes markup: nothing failed.
    assert parse("Qwen3-Coder writes <function=f> instead.").failed == []


def test_parameters_stand_in_for_arguments_and_no_arguments_is_an_empty_object():
    # Qwen2.5's template documents `arguments`; some models write `parameters` (vLLM's hermes parser reads both).
    [call] = parse('<tool_call>{"name": "ls", "parameters": {"dir": "src"}}</tool_call>').message.tool_calls
    assert (call.name, call.arguments) == ("ls", '{"dir":"src"}')
    [call] = parse(
        '<tool_call>{"name": "ls", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>'
    ).message.tool_calls
    assert call.arguments == '{"a":1}'  # arguments win
    [call] = parse('<tool_call>{"name": "now"}</tool_call>').message.tool_calls
    assert call.arguments == "{}"


def test_every_unparsed_block_is_reported_once_as_the_text_holds_it():
    # A block with a one-character (or empty) body: the unclosed-tag search starts after its close tag, not inside it.
    for text in ("<tool_call>x</tool_call>", "<tool_call></tool_call>"):
        turn = parse(text)
        assert (turn.message.content, turn.message.tool_calls, turn.failed) == (text, [], [text])
    # An unclosed tag at the very start, and two unclosed tags: everything from the first one on, once.
    text = '<tool_call>{"name": "a"'
    assert parse(text).failed == [text]
    text = 'go <tool_call>{"name": "a" <tool_call>{"name": "b"'
    assert parse(text).failed == ['<tool_call>{"name": "a" <tool_call>{"name": "b"']
    text = '<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"'
    turn = parse(text)
    assert [c.name for c in turn.message.tool_calls] == ["a"]
    assert turn.failed == ['<tool_call>{"name": "b"'] and turn.message.content == 'then <tool_call>{"name": "b"'
