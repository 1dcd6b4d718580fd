"""A summary without its harness's marker, known by the compaction call's answer, and a compaction call that breaks its
chain on a token difference (issue 29 audit of polar_cli/build/breaks.py's newer code), on hand-made records."""

from __future__ import annotations

from typing import Any

import orjson

from polar_addon.capture import CaptureRecord
from polar_cli.build.breaks import (
    MIN_SUMMARY_CHARS,
    Break,
    BreakCause,
    Relation,
    _summary_answered_by,
    as_compaction,
    conversation,
    relate_new_chain,
)

SYS = {"role": "system", "content": "You are a counting agent."}
GEMINI_ASK = {
    "role": "system",
    "content": "You specialise in distilling chat history into a structured XML <state_snapshot>.",
}
CLAUDE_ASK = {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}
ANSWER = "counted to three, next is four"  # 30 characters, no harness marker in it


def rec(seq: int, messages: list[dict[str, Any]], answer: Any = "") -> CaptureRecord:
    return CaptureRecord(
        record_id=f"r{seq}",
        session_id="s",
        seq=seq,
        api="openai_chat",
        status="ok",
        prompt_ids=[1],
        response_ids=[],
        logprobs=[],
        messages_json=orjson.dumps(messages).decode(),
        tools_json="[]",
        response_json=orjson.dumps({"role": "assistant", "content": answer}).decode(),
    )


def answered(
    carrier: dict[str, Any], answer: Any = ANSWER, tips_before: list[CaptureRecord] | None = None
) -> str | None:
    """Which harness ``_summary_answered_by`` names for a history holding ``carrier``, after a Gemini compaction tip."""
    ask = rec(2, [GEMINI_ASK, {"role": "user", "content": "count"}, {"role": "user", "content": "Summarise."}], answer)
    tips = [*(tips_before or []), ask]
    new = conversation(rec(3, [SYS, carrier, {"role": "user", "content": "go on"}]))
    return _summary_answered_by(new, tips, [conversation(t) for t in tips])


def test_the_answer_is_found_in_a_user_system_or_developer_message_of_text_or_parts() -> None:
    assert answered({"role": "user", "content": f"Summary so far: {ANSWER}."}) == "gemini-cli"
    assert answered({"role": "system", "content": ANSWER}) == "gemini-cli"
    assert answered({"role": "developer", "content": ANSWER}) == "gemini-cli"
    parts = [{"type": "text", "text": "Summary: "}, {"type": "text", "text": ANSWER}]
    assert answered({"role": "user", "content": parts}) == "gemini-cli"


def test_the_answer_in_an_assistant_or_tool_message_marks_nothing() -> None:
    assert answered({"role": "assistant", "content": ANSWER}) is None
    assert answered({"role": "tool", "tool_call_id": "c", "content": ANSWER}) is None


def test_an_answer_of_exactly_the_minimum_length_counts_and_one_shorter_does_not() -> None:
    assert MIN_SUMMARY_CHARS == 16
    exact, short = "a" * 15 + "b", "a" * 14 + "b"
    assert answered({"role": "user", "content": exact}, exact) == "gemini-cli"
    assert answered({"role": "user", "content": short}, short) is None


def test_the_answer_is_stripped_before_it_is_looked_for() -> None:
    assert answered({"role": "user", "content": ANSWER}, f"\n  {ANSWER}  \n") == "gemini-cli"


def test_a_long_answer_the_history_does_not_carry_marks_nothing() -> None:
    assert answered({"role": "user", "content": "something else entirely, long enough"}) is None


def test_an_answer_that_is_not_text_marks_nothing() -> None:
    assert answered({"role": "user", "content": ANSWER}, [{"type": "text", "text": ANSWER}]) is None
    assert answered({"role": "user", "content": ANSWER}, None) is None


def test_only_a_compaction_calls_answer_marks_a_summary_even_when_a_later_tip_answered_the_same() -> None:
    # A later, ordinary call whose answer the history also carries is passed over for the compaction call before it.
    ordinary = rec(1, [SYS, {"role": "user", "content": "count"}], ANSWER)
    ask = rec(2, [GEMINI_ASK, {"role": "user", "content": "count"}], ANSWER)
    new = conversation(rec(3, [SYS, {"role": "user", "content": ANSWER}]))
    assert _summary_answered_by(new, [ask, ordinary], [conversation(ask), conversation(ordinary)]) == "gemini-cli"
    assert _summary_answered_by(new, [ordinary], [conversation(ordinary)]) is None


def test_a_history_carrying_a_compaction_answer_breaks_as_compaction_after_the_chain_it_summarised() -> None:
    main = rec(1, [SYS, {"role": "user", "content": "count"}], "1 2 3")
    ask = rec(2, [GEMINI_ASK, {"role": "user", "content": "count"}, {"role": "user", "content": "Summarise."}], ANSWER)
    new = rec(3, [SYS, {"role": "user", "content": ANSWER}, {"role": "assistant", "content": "ok"}])
    assert relate_new_chain(new, [main, ask], None) == Relation(
        Break(BreakCause.COMPACTION, "history replaced by a gemini-cli compaction summary after call 1"), 0
    )


def test_a_compaction_call_that_broke_on_tokens_is_a_compaction_break_with_the_first_cause_kept() -> None:
    asking = rec(4, [SYS, {"role": "user", "content": "go"}, {"role": "assistant", "content": "x"}, CLAUDE_ASK])
    rerender = Break(BreakCause.TEMPLATE_RERENDER, "turn 2 re-rendered")
    assert as_compaction(asking, rerender) == Break(
        BreakCause.COMPACTION,
        "claude-code compaction call (asks for a summary); template_rerender: turn 2 re-rendered",
    )
    already = Break(BreakCause.COMPACTION, "claude-code compaction call (asks for a summary)")
    assert as_compaction(asking, already) is already
    plain = rec(5, [SYS, {"role": "user", "content": "go"}])
    assert as_compaction(plain, rerender) is rerender
