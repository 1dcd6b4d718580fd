"""Break causes, one at a time, from the smallest record pairs that show them (polar_cli/build/breaks.py).

The session-level behaviour (which chain a call joins, what a break cuts) is tested with the real
tokenizer in test_build_prefix_merging.py; here each classifier is fed hand-made records so every
cause, every branch that picks the related chain, and every detail the build report prints is pinned.
Token ids are a toy vocabulary: 1 2 spell "fish"+"ing", 3 spells "fishing" (a re-tokenization).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from polar_addon.capture import CaptureRecord
from polar_cli.build.breaks import (
    Break,
    BreakCause,
    Conversation,
    Relation,
    _first_difference,
    _history_calls,
    _text,
    classify_rerendered_turn,
    conversation,
    relate_new_chain,
    sub_agent_break,
    turn_rewrites,
)

VOCAB = {1: "fish", 2: "ing", 3: "fishing", 4: " ", 5: "<think></think>", 6: "<eot>", 7: "a", 8: "b"}

SYS = {"role": "system", "content": "You are a coding agent."}
SUB_SYS = {"role": "system", "content": "You are a search sub-agent."}
TASK = {"role": "user", "content": "Fix the parser."}
OTHER_TASK = {"role": "user", "content": "Summarize README.md"}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
ASK = {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}
SUMMARY = {
    "role": "user",
    "content": "This session is being continued from a previous conversation that ran out "
    "of context. Summary: the parser is fixed.",
}
SUMMARY_2 = {
    "role": "user",
    "content": "This session is being continued from a previous conversation that ran out "
    "of context. Summary: the parser and the lexer are fixed.",
}


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def assistant(content: str = "", **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def tool(content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "c1", "content": content}


def rec(
    seq: int,
    messages: list[dict[str, Any]],
    *,
    prompt: Sequence[int] = (7,),
    response: Sequence[int] = (),
    sampled: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> CaptureRecord:
    return CaptureRecord(
        record_id=f"r{seq}",
        session_id="s",
        seq=seq,
        api="openai_chat",
        status="ok",
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=[0.0] * len(response),
        messages_json=orjson.dumps(messages).decode(),
        tools_json=orjson.dumps(tools or []).decode(),
        response_json=orjson.dumps(sampled).decode(),
    )


# --- text and history helpers -------------------------------------------------------------------------


def test_text_of_missing_string_part_list_and_other_content() -> None:
    assert _text(None) == ""
    assert _text("plain") == "plain"
    # text parts joined without a separator; parts without text add nothing; non-dict parts are skipped
    assert _text([{"type": "text", "text": "fish"}, {"type": "image"}, "junk", {"text": "ing"}]) == "fishing"
    assert _text(42) == "42"


def test_history_calls_read_nested_and_flat_tool_calls_with_empty_defaults() -> None:
    message = assistant(
        tool_calls=[
            {"id": "x", "type": "function", "function": {"name": "bash", "arguments": '{"cmd":"ls"}'}},
            {"name": "read_file", "arguments": '{"path":"a"}'},
            {"function": {}},
        ]
    )
    assert _history_calls(message) == [("bash", '{"cmd":"ls"}'), ("read_file", '{"path":"a"}'), ("", "")]
    assert _history_calls(assistant()) == [] and _history_calls(assistant(tool_calls=None)) == []


def test_first_difference_is_the_first_unequal_position_or_the_shorter_length() -> None:
    assert _first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert _first_difference([5, 2], [6, 2]) == 0
    assert _first_difference([1, 2], [1, 2, 3]) == 2
    assert _first_difference([1, 2, 3], [1]) == 1
    assert _first_difference([], [1]) == 0


# --- turn_rewrites: how the harness changed the sampled assistant turn -----------------------------


def test_a_turn_sent_back_unchanged_has_no_rewrites() -> None:
    sampled = {"content": "done", "reasoning": "think", "tool_calls": [{"id": "a", "name": "bash", "arguments": "{}"}]}
    history = assistant(
        "done",
        reasoning_content="think",
        tool_calls=[{"id": "other-id", "function": {"name": "bash", "arguments": "{}"}}],
    )
    assert turn_rewrites(sampled, history) == []  # tool-call ids are re-keyed legitimately


def test_no_sampled_turn_has_no_rewrites_and_a_missing_or_foreign_turn_is_one() -> None:
    assert turn_rewrites(None, None) == []
    missing = "the sampled assistant turn is missing from the next call's messages"
    assert turn_rewrites({"content": "x"}, None) == [missing]
    assert turn_rewrites({"content": "x"}, {"role": "user", "content": "x"}) == [
        "the next call has a 'user' message where the sampled assistant turn belongs"
    ]


def test_reasoning_sent_back_under_either_key_or_dropped_or_changed() -> None:
    sampled = {"content": "ok", "reasoning": "r"}
    assert turn_rewrites(sampled, assistant("ok", reasoning_content="r")) == []
    assert turn_rewrites(sampled, assistant("ok", reasoning="r")) == []
    assert turn_rewrites(sampled, assistant("ok")) == ["the harness did not send the sampled reasoning back"]
    assert turn_rewrites(sampled, assistant("ok", reasoning="r2")) == ["reasoning text changed"]
    assert turn_rewrites({"content": "ok"}, assistant("ok", reasoning_content="invented")) == ["reasoning text changed"]


def test_content_compared_as_text_whatever_its_shape() -> None:
    assert turn_rewrites({"content": None}, assistant("")) == []
    assert turn_rewrites({"content": "fishing"}, assistant([{"type": "text", "text": "fish"}, {"text": "ing"}])) == []
    assert turn_rewrites({"content": "fishing"}, assistant("fish")) == ["content text changed"]


def test_tool_calls_renamed_dropped_or_reserialized() -> None:
    sampled = {"content": "", "tool_calls": [{"name": "bash", "arguments": '{"cmd": "ls"}'}]}
    same = [{"function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]
    assert turn_rewrites(sampled, assistant("", tool_calls=same)) == []
    renamed = [{"function": {"name": "sh", "arguments": '{"cmd": "ls"}'}}]
    assert turn_rewrites(sampled, assistant("", tool_calls=renamed)) == ["tool calls changed"]
    assert turn_rewrites(sampled, assistant("")) == ["tool calls changed"]
    compact = [{"function": {"name": "bash", "arguments": '{"cmd":"ls"}'}}]
    assert turn_rewrites(sampled, assistant("", tool_calls=compact)) == ["tool-call arguments re-serialized"]
    # a call without name or arguments on either side is the empty string, not a difference
    assert turn_rewrites({"tool_calls": [{}]}, assistant(None, tool_calls=[{"function": {}}])) == []
    flat = [{"name": "bash", "arguments": ""}]
    assert turn_rewrites({"tool_calls": [{"name": "bash"}]}, assistant(None, tool_calls=flat)) == []


def test_every_rewrite_is_listed_in_order() -> None:
    sampled = {"content": "a", "reasoning": "r", "tool_calls": [{"name": "bash", "arguments": "{}"}]}
    assert turn_rewrites(sampled, assistant("b")) == [
        "the harness did not send the sampled reasoning back",
        "content text changed",
        "tool calls changed",
    ]


# --- classify_rerendered_turn: the next prompt's copy of the sampled turn differs -------------------


def _pair(
    history: dict[str, Any] | None, *, sampled: dict[str, Any] | None = None
) -> tuple[CaptureRecord, CaptureRecord]:
    prev = rec(4, [SYS, TASK], response=[1, 2, 6], sampled=sampled or {"content": "fishing"})
    after = [SYS, TASK] + ([history, tool("out")] if history is not None else [])
    return prev, rec(5, after)


def test_same_text_in_other_token_ids_merges() -> None:
    prev, nxt = _pair(assistant("fishing"))
    assert classify_rerendered_turn(prev, nxt, [3, 6], decode) is None


def test_other_text_for_an_unchanged_message_is_a_template_rerender() -> None:
    prev, nxt = _pair(assistant("fishing"))
    assert classify_rerendered_turn(prev, nxt, [5, 1, 2, 6], decode) == Break(
        BreakCause.TEMPLATE_RERENDER,
        "the template rendered the same message differently: call 5 re-rendered call 4's turn as 4 tokens "
        "(sampled 3; first difference at token 0)",
    )


def test_without_a_tokenizer_a_changed_copy_is_other() -> None:
    prev, nxt = _pair(assistant("fishing"))
    assert classify_rerendered_turn(prev, nxt, [3, 6], None) == Break(
        BreakCause.OTHER,
        "call 5 re-rendered call 4's turn as 2 tokens (sampled 3; first difference at token 0); "
        "without a tokenizer a re-tokenization cannot be told from a template re-render",
    )


def test_a_rewritten_message_is_rewritten_history_even_with_the_same_text() -> None:
    prev, nxt = _pair(assistant("fish"), sampled={"content": "fishing", "reasoning": "r"})
    assert classify_rerendered_turn(prev, nxt, [1, 2, 7, 6], decode) == Break(
        BreakCause.REWRITTEN_HISTORY,
        "the harness did not send the sampled reasoning back; content text changed: call 5 re-rendered call 4's "
        "turn as 4 tokens (sampled 3; first difference at token 2)",
    )


def test_a_next_call_with_no_message_after_the_previous_ones_misses_the_turn() -> None:
    prev, nxt = _pair(None)  # same message count: the sampled turn is not there
    brk = classify_rerendered_turn(prev, nxt, [3, 6], decode)
    assert brk is not None and brk.cause == BreakCause.REWRITTEN_HISTORY
    assert brk.detail.startswith("the sampled assistant turn is missing from the next call's messages: call 5")


# --- conversation: parsed once per record ----------------------------------------------------------


def test_conversation_system_and_first_user_message() -> None:
    conv = Conversation([{"role": "developer", "content": [{"text": "dev"}]}, assistant("hi"), TASK, OTHER_TASK], "[]")
    assert (conv.system, conv.first_user) == ("dev", TASK["content"])
    assert (Conversation([TASK], "[]").system, Conversation([SYS], "[]").first_user) == (None, None)
    assert Conversation([], "[]").system is None


def test_conversation_is_parsed_once_per_record_with_a_cache() -> None:
    record = rec(0, [SYS, TASK], tools=TOOLS)
    plain = conversation(record)
    assert plain.messages == [SYS, TASK] and plain.tools_json == record.tools_json
    cache: dict[str, Conversation] = {}
    first = conversation(record, cache)
    assert first == plain and conversation(record, cache) is first and cache == {"r0": first}


def test_relate_new_chain_fills_the_callers_cache_for_the_record_and_every_tip() -> None:
    cache: dict[str, Conversation] = {}
    tips = [rec(0, [SYS, TASK]), rec(1, [SUB_SYS, OTHER_TASK])]
    relate_new_chain(rec(2, [SYS, TASK, assistant("x")], tools=TOOLS), tips, decode, cache)
    assert sorted(cache) == ["r0", "r1", "r2"]


# --- relate_new_chain: why a call extends no chain ---------------------------------------------------


def test_a_call_without_messages_is_other_and_unrelated() -> None:
    assert relate_new_chain(rec(3, []), [rec(0, [SYS, TASK])], decode) == Relation(
        Break(BreakCause.OTHER, "call 3 has no captured messages"), None
    )


def test_same_messages_with_a_retokenized_prompt() -> None:
    tip = rec(1, [SYS, TASK], prompt=[7, 1, 2, 4])
    record = rec(2, [SYS, TASK, assistant("done"), tool("ok")], prompt=[7, 3, 4, 8])
    assert relate_new_chain(record, [tip], decode) == Relation(
        Break(BreakCause.RETOKENIZED, "same text, new token ids: call 2 changes call 1's prompt at token 1 of 4"), 0
    )


def test_same_messages_with_other_prompt_text_is_a_template_rerender() -> None:
    tip = rec(1, [SYS, TASK], prompt=[7, 1, 2])
    record = rec(2, [SYS, TASK, assistant("done")], prompt=[7, 5, 1, 2, 8])
    detail = "same messages rendered into different tokens: call 2 changes call 1's prompt at token 1 of 3"
    expected = Relation(Break(BreakCause.TEMPLATE_RERENDER, detail), 0)
    assert relate_new_chain(record, [tip], decode) == expected
    # without a tokenizer even a re-tokenization is reported as a re-render
    retok = rec(2, [SYS, TASK, assistant("done")], prompt=[7, 3, 8])
    assert relate_new_chain(retok, [tip], None).brk.cause == BreakCause.TEMPLATE_RERENDER


def test_the_continued_chain_is_the_one_with_the_most_matching_messages_then_the_latest() -> None:
    longer = rec(0, [SYS, TASK, assistant("a"), tool("1")], prompt=[7, 7])
    shorter = rec(1, [SYS, TASK], prompt=[7, 8])
    record = rec(2, [SYS, TASK, assistant("a"), tool("1"), assistant("b")], prompt=[8])
    relation = relate_new_chain(record, [longer, shorter], decode)
    assert relation.related == 0 and relation.brk.detail.endswith("call 2 changes call 0's prompt at token 0 of 2")
    twins = [rec(0, [SYS, TASK]), rec(1, [SYS, TASK])]
    assert relate_new_chain(rec(2, [SYS, TASK, assistant("b")], prompt=[8]), twins, decode).related == 1


def test_a_compaction_call_relates_to_the_latest_chain_with_its_system_prompt() -> None:
    tips = [
        rec(0, [SYS, TASK, assistant("a")]),
        rec(1, [SUB_SYS, OTHER_TASK]),
        rec(2, [SYS, TASK, assistant("b")]),
        rec(3, [SUB_SYS, TASK]),
    ]
    record = rec(4, [SYS, TASK, assistant("c"), ASK])
    assert relate_new_chain(record, tips, decode) == Relation(
        Break(BreakCause.COMPACTION, "claude-code compaction call (asks for a summary) after call 2"), 2
    )


def test_a_compaction_call_with_an_unseen_system_prompt_relates_to_the_latest_chain() -> None:
    tips = [rec(0, [SYS, TASK]), rec(1, [SUB_SYS, OTHER_TASK]), rec(2, [SYS, OTHER_TASK])]
    record = rec(3, [{"role": "system", "content": "Summarizer."}, TASK, ASK])
    assert relate_new_chain(record, tips, decode) == Relation(
        Break(BreakCause.COMPACTION, "claude-code compaction call (asks for a summary) after call 2"), 2
    )


def test_a_compaction_call_with_no_chain_before_it_relates_to_none() -> None:
    assert relate_new_chain(rec(0, [SYS, TASK, ASK]), [], decode) == Relation(
        Break(BreakCause.COMPACTION, "claude-code compaction call (asks for a summary)"), None
    )


def test_a_summarised_history_continues_the_conversation_not_the_call_that_wrote_the_summary() -> None:
    conv = rec(0, [SYS, TASK, assistant("a"), tool("1")])
    asking = rec(1, [SYS, TASK, assistant("a"), tool("1"), ASK])
    record = rec(2, [SYS, SUMMARY])
    assert relate_new_chain(record, [conv, asking], decode) == Relation(
        Break(BreakCause.COMPACTION, "history replaced by a claude-code compaction summary after call 0"), 0
    )
    # when every candidate is a compaction call, the latest one is still the relation
    assert relate_new_chain(record, [asking, asking], decode).related == 1


def test_a_second_compaction_call_on_a_summarised_history_relates_to_the_latest_chain() -> None:
    conv = rec(0, [SYS, SUMMARY, assistant("z")])
    earlier_ask = rec(1, [SYS, TASK, assistant("x"), ASK])
    record = rec(2, [SYS, SUMMARY, assistant("a"), tool("1"), ASK])
    assert relate_new_chain(record, [conv, earlier_ask], decode) == Relation(
        Break(BreakCause.COMPACTION, "claude-code compaction call (asks for a summary) after call 1"), 1
    )


def test_a_second_summary_is_a_new_compaction() -> None:
    first = rec(0, [SYS, SUMMARY, assistant("a"), tool("1")])
    record = rec(1, [SYS, SUMMARY_2])
    assert relate_new_chain(record, [first], decode).brk == Break(
        BreakCause.COMPACTION, "history replaced by a claude-code compaction summary after call 0"
    )


def test_a_chain_already_starting_from_the_summary_is_continued_not_compacted() -> None:
    """Tools changed on a summarised history: the summary is old news, the break is the tools."""
    tip = rec(0, [SYS, SUMMARY, assistant("a")])
    extended = rec(1, [SYS, SUMMARY, assistant("a"), tool("1")], tools=TOOLS)
    assert relate_new_chain(extended, [tip], decode) == Relation(
        Break(BreakCause.REWRITTEN_HISTORY, "tool definitions changed"), 0
    )
    resent = rec(1, [SYS, SUMMARY, assistant("a")], tools=TOOLS)
    assert relate_new_chain(resent, [tip], decode) == Relation(
        Break(BreakCause.REWRITTEN_HISTORY, "tool definitions changed"), 0
    )


def test_an_edited_history_relates_to_the_chain_sharing_the_most_messages() -> None:
    most = rec(0, [SYS, TASK, assistant("a"), tool("1"), assistant("b")])
    fewer = rec(1, [SYS, TASK, assistant("x")])
    record = rec(2, [SYS, TASK, assistant("a"), tool("edited"), assistant("b")])
    assert relate_new_chain(record, [most, fewer], decode) == Relation(
        Break(BreakCause.REWRITTEN_HISTORY, "messages differ from call 0's at message 3 (5 messages before, 5 now)"), 0
    )
    # a tie goes to the latest chain
    assert relate_new_chain(record, [most, most, fewer], decode).related == 1


def test_changed_tools_with_an_edited_history_is_a_history_edit() -> None:
    tip = rec(0, [SYS, TASK, assistant("a"), tool("1")])
    record = rec(1, [SYS, TASK, assistant("a"), tool("edited")], tools=TOOLS)
    assert relate_new_chain(record, [tip], decode).brk == Break(
        BreakCause.REWRITTEN_HISTORY, "messages differ from call 0's at message 3 (4 messages before, 4 now)"
    )


def test_a_same_root_chain_wins_over_a_chain_with_only_the_system_prompt() -> None:
    other_task = rec(0, [SYS, OTHER_TASK, assistant("a"), tool("1"), assistant("b"), tool("2")])
    same_task = rec(1, [SYS, TASK, assistant("x")])
    record = rec(2, [SYS, TASK, assistant("y")])
    assert relate_new_chain(record, [same_task, other_task], decode).related == 0


def test_another_first_user_message_is_decided_by_whether_the_conversation_carries_on() -> None:
    tips = [rec(0, [SYS, TASK, assistant("a")]), rec(1, [SUB_SYS, TASK]), rec(2, [SYS, TASK, assistant("b")])]
    assert relate_new_chain(rec(3, [SYS, OTHER_TASK]), tips, decode) == Relation(
        Break(BreakCause.REWRITTEN_HISTORY, "first user message replaced (compaction) after call 2"),
        2,
        decide_by_continuation=True,
    )


def test_another_system_prompt_is_a_sub_agent_related_to_nothing() -> None:
    tips = [rec(0, [SYS, TASK])]
    assert relate_new_chain(rec(1, [SUB_SYS, TASK]), tips, decode) == Relation(
        Break(BreakCause.SUB_AGENT, "a different system prompt"), None
    )
    assert sub_agent_break(7) == Break(
        BreakCause.SUB_AGENT,
        "same system prompt, another first user message; the parent conversation continues at call 7",
    )
