"""The opt-in fenced-JSON fallback (polar_tool_parser NAME+fenced_json): the variants small models write, what stays
text, and the chain that records which parser found a turn's calls."""

from __future__ import annotations

import re

import orjson
import pytest

from polar_addon.canonical import AssistantMessage, ToolCall
from polar_addon.tool_parsers import ENGINE, ParserChain, ParserChoice
from polar_addon.tool_parsers.fenced_json import extract, tool_names

TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
]
FENCE = "```"


def calls_of(text: str, tools=TOOLS) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = extract(text, tools)
    return content, [(c.name, orjson.loads(c.arguments)) for c in calls]


def fenced(body: str, lang: str = "json") -> str:
    return f"{FENCE}{lang}\n{body}\n{FENCE}"


def test_the_block_qwen_coder_writes_becomes_a_call() -> None:
    # Qwen2.5-Coder-0.5B-Instruct's answer to a tool-using prompt, verbatim in shape.
    text = fenced('{"name": "bash", "arguments": {"command": "ls"}}')
    assert calls_of(text) == (None, [("bash", {"command": "ls"})])


@pytest.mark.parametrize(
    "body,expected",
    [
        ('{"name": "bash", "parameters": {"command": "ls"}}', [("bash", {"command": "ls"})]),
        ('{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}', [("bash", {"command": "ls"})]),
        ('{"name": "read_file"}', [("read_file", {})]),
        ('{"type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}',
         [("bash", {"command": "pwd"})]),
        ('[{"name": "bash", "arguments": {"command": "ls"}}, {"name": "read_file", "arguments": {"path": "a"}}]',
         [("bash", {"command": "ls"}), ("read_file", {"path": "a"})]),
    ],
)  # fmt: skip
def test_variants(body: str, expected: list) -> None:
    assert calls_of(fenced(body)) == (None, expected)
    assert calls_of(fenced(body, lang=""))[1] == expected  # a bare fence
    assert calls_of(fenced(body, lang="JSON"))[1] == expected


def test_a_whole_message_that_is_a_call_object_or_list() -> None:
    assert calls_of('  {"name": "bash", "arguments": {"command": "ls"}}\n') == (None, [("bash", {"command": "ls"})])
    assert calls_of('[{"name": "read_file", "arguments": {"path": "x"}}]') == (None, [("read_file", {"path": "x"})])
    # Unfenced JSON inside prose is prose: only a whole message, or a fenced block, is read.
    text = 'Run {"name": "bash", "arguments": {"command": "ls"}} now'
    assert calls_of(text) == (text, [])


def test_text_around_the_blocks_stays_content_and_several_blocks_keep_their_order() -> None:
    text = (
        "First I look around.\n\n"
        + fenced('{"name": "bash", "arguments": {"command": "ls"}}')
        + "\n\nThen I read it:\n\n"
        + fenced('{"name": "read_file", "arguments": {"path": "setup.py"}}')
        + "\n\nThat is all."
    )
    content, calls = calls_of(text)
    assert calls == [("bash", {"command": "ls"}), ("read_file", {"path": "setup.py"})]
    assert content == "First I look around.\n\nThen I read it:\n\nThat is all."


def test_unknown_names_malformed_json_and_other_code_stay_text() -> None:
    for text in (
        fenced('{"name": "rm_rf", "arguments": {}}'),  # not among the request's tools
        fenced('{"name": "bash", "arguments": {"command": "ls"'),  # malformed JSON
        fenced('{"name": "bash", "arguments": "not json"}'),  # arguments neither object nor JSON text of one
        fenced('{"name": "bash", "arguments": [1, 2]}'),
        fenced('{"command": "ls"}'),  # no name
        fenced('{"name": "bash", "arguments": {"command": "ls"}}', lang="python"),  # another language's block
        fenced("print('hello')", lang=""),
        fenced("[]"),
        "{not json at all",
        "Just prose, no call.",
    ):
        assert calls_of(text) == (text, []), text
    # A block is all or nothing: one unknown entry keeps the whole list as text.
    mixed = fenced('[{"name": "bash", "arguments": {}}, {"name": "nope", "arguments": {}}]')
    assert calls_of(mixed) == (mixed, [])
    # Beside a block that does convert, the one that does not stays in the content verbatim.
    bad = fenced('{"name": "nope", "arguments": {}}')
    content, calls = calls_of(bad + "\n\n" + fenced('{"name": "bash", "arguments": {"command": "ls"}}'))
    assert (content, calls) == (bad, [("bash", {"command": "ls"})])


def test_no_tools_no_calls() -> None:
    text = fenced('{"name": "bash", "arguments": {"command": "ls"}}')
    assert calls_of(text, tools=[]) == (text, [])
    assert extract(None, TOOLS) == (None, [])


QWEN_ANSWER = "I'll list the files.\n\n" + fenced('{"name": "bash", "arguments": {"command": "ls"}}')
HERMES_ANSWER = '<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}</tool_call>'


def test_the_chain_records_which_parser_found_the_calls() -> None:
    chain = ParserChain.from_spec("hermes+fenced_json")
    hermes_turn = chain.parse(HERMES_ANSWER + "\n" + fenced('{"name": "bash", "arguments": {"command": "ls"}}'), TOOLS)
    # The primary parser found a call: the fallback does not run (the fenced block stays text).
    assert hermes_turn.parser == "hermes" and [c.name for c in hermes_turn.message.tool_calls] == ["bash"]
    assert "```json" in (hermes_turn.message.content or "")
    fallback_turn = chain.parse("<think>plan</think>" + QWEN_ANSWER, TOOLS)
    assert fallback_turn.parser == "fenced_json" and fallback_turn.message.reasoning == "plan"
    assert fallback_turn.message.content == "I'll list the files."
    assert [(c.name, c.arguments) for c in fallback_turn.message.tool_calls] == [("bash", '{"command":"ls"}')]
    prose = chain.parse("No tools needed.", TOOLS)
    assert (prose.parser, prose.message.content, prose.message.tool_calls) == (None, "No tools needed.", [])
    # A hermes block that did not parse is still a failure, and the fallback still reads the rest.
    broken = chain.parse('<tool_call>{"name": </tool_call>\n' + QWEN_ANSWER, TOOLS)
    assert broken.parse_failed and broken.parser == "fenced_json"


def test_without_the_opt_in_nothing_changes() -> None:
    default = ParserChoice("hermes").for_model("any")
    turn = default(QWEN_ANSWER, TOOLS)
    assert (turn.message.content, turn.message.tool_calls, turn.parser) == (QWEN_ANSWER, [], None)
    assert default(HERMES_ANSWER, TOOLS).parser == "hermes"


def test_after_engine_keeps_the_engines_calls_and_falls_back_on_its_content() -> None:
    chain = ParserChain.from_spec("hermes+fenced_json")
    engine_call = AssistantMessage(content="x", tool_calls=[ToolCall(id="call_1", name="bash", arguments="{}")])
    assert chain.after_engine(engine_call, TOOLS) == (engine_call, ENGINE)
    message, parser = chain.after_engine(AssistantMessage(content=QWEN_ANSWER, reasoning="r"), TOOLS)
    assert parser == "fenced_json" and message.reasoning == "r" and message.content == "I'll list the files."
    assert [c.name for c in message.tool_calls] == ["bash"]
    plain = AssistantMessage(content=QWEN_ANSWER)
    assert ParserChain.from_spec("hermes").after_engine(plain, TOOLS) == (plain, None)


def test_the_option_spelling() -> None:
    choice = ParserChoice("qwen3_coder, small-model=hermes+fenced_json")
    assert choice.chain_for("small-model") == ParserChain("hermes", ("fenced_json",))
    assert choice.chain_for("other") == ParserChain("qwen3_coder")
    assert choice.name_for("small-model") == "hermes"  # the primary: what the engine's server must run
    assert str(choice.chain_for("small-model")) == "hermes+fenced_json"
    assert ParserChoice(" hermes + fenced_json ").default.fallbacks == ("fenced_json",)
    with pytest.raises(ValueError, match="is a fallback, not a parser"):
        ParserChoice("fenced_json")
    with pytest.raises(ValueError, match="unknown tool-call fallback"):
        ParserChoice("hermes+yaml")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ParserChoice("nope+fenced_json")


def test_the_names_a_request_offers() -> None:
    tools = [
        "junk",  # not an object: skipped, the tools after it still read
        {"function": {"name": ""}},  # an empty name offers nothing
        {"function": {"name": 5}},  # nor a name that is not text
        {"name": "flat"},  # a flat tool (no ``function`` object) names itself
        {"type": "function", "function": {"name": "bash"}},
    ]
    assert tool_names(tools) == {"flat", "bash"}
    # A call to a flat tool converts; a call named "" never does, even when a tool says so.
    assert calls_of(fenced('{"name": "flat", "arguments": {"a": 1}}'), tools) == (None, [("flat", {"a": 1})])
    empty = fenced('{"name": "", "arguments": {}}')
    assert calls_of(empty, [{"function": {"name": ""}}, *TOOLS]) == (empty, [])


def test_a_call_object_with_its_own_name_is_not_unwrapped_and_blank_argument_text_is_no_arguments() -> None:
    body = '{"name": "bash", "arguments": {"command": "ls"}, "function": {"name": "read_file", "arguments": {}}}'
    assert calls_of(fenced(body)) == (None, [("bash", {"command": "ls"})])
    assert calls_of(fenced('{"name": "read_file", "arguments": "  "}')) == (None, [("read_file", {})])


def test_each_converted_call_gets_its_own_minted_id() -> None:
    _, calls = extract(fenced('[{"name": "bash", "arguments": {}}, {"name": "bash", "arguments": {}}]'), TOOLS)
    ids = [c.id for c in calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2


def test_the_primary_parser_is_given_the_requests_tools() -> None:
    # qwen3_coder types a parameter by the tool's schema: "2" is the integer 2 only when the tools reach it.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    text = "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
    turn = ParserChain("qwen3_coder").parse(text, tools)
    assert [(c.name, orjson.loads(c.arguments)) for c in turn.message.tool_calls] == [("f", {"n": 2})]
    by_model = ParserChoice("m=qwen3_coder").for_model("m")(text, tools)
    assert [orjson.loads(c.arguments) for c in by_model.message.tool_calls] == [{"n": 2}]


def test_the_default_choice_and_empty_parts() -> None:
    assert ParserChoice().default == ParserChain("hermes") == ParserChoice("m=qwen3_coder").chain_for("other")
    choice = ParserChoice(" , m=qwen3_coder,,n=hermes+fenced_json, ")
    assert choice.by_model == {"m": ParserChain("qwen3_coder"), "n": ParserChain("hermes", ("fenced_json",))}


def test_the_refusals_list_the_known_names() -> None:
    with pytest.raises(ValueError) as parser:
        ParserChoice("nope")
    assert str(parser.value) == "unknown tool-call parser 'nope'; known: hermes, qwen25, qwen3_coder"
    with pytest.raises(ValueError) as fallback:
        ParserChain.from_spec("hermes+yaml")
    assert str(fallback.value) == "unknown tool-call fallback 'yaml'; known: fenced_json"
