"""Prefix merging's parts on hand-made token records (polar_cli/build/prefix_merging.py).

test_build_prefix_merging.py builds whole sessions with the real tokenizer and template; here each
part (usability, end-of-turn detection, one join, the merged layout, how chains are tied together)
gets the smallest records that decide it, with exact outcomes. Toy ids: 6 is the end-of-turn
token, 9 a second stop token the template never writes, 1 2 and 3 spell "fish" "ing" "fishing".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from polar_addon.capture import CaptureRecord
from polar_cli.build.breaks import Break, BreakCause, sub_agent_break
from polar_cli.build.prefix_merging import (
    Join,
    RecordChain,
    Segment,
    detect_eot,
    join,
    reconstruct_session,
    unusable_reason,
)

EOT = 6
VOCAB = {0: "<sys>", 1: "fish", 2: "ing", 3: "fishing", 6: "<eot>", 7: "a", 8: "b", 9: "<eos>"}
SYS = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Fix the parser."}
OTHER_TASK = {"role": "user", "content": "Summarize README.md"}


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def assistant(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def tool(content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "c1", "content": content}


def rec(
    seq: int,
    prompt: Sequence[int],
    response: Sequence[int] = (7, EOT),
    *,
    finish: str = "stop",
    messages: list[dict[str, Any]] | None = None,
    sampled: dict[str, Any] | None = None,
    **fields: Any,
) -> CaptureRecord:
    return CaptureRecord(
        record_id=f"r{seq}",
        session_id="s",
        seq=seq,
        api="openai_chat",
        status=fields.pop("status", "ok"),
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=[-0.5] * len(response),
        finish_reason=finish,
        messages_json=orjson.dumps(messages if messages is not None else [SYS, TASK]).decode(),
        response_json=orjson.dumps(sampled or {"content": decode(response)}).decode(),
        **fields,
    )


# --- usability and the end-of-turn token -----------------------------------------------------------


def test_unusable_reason_names_each_problem() -> None:
    assert unusable_reason(rec(0, [0])) is None
    assert unusable_reason(rec(0, [0], status="failed")) == "failed call"
    assert unusable_reason(rec(0, [])) == "no prompt token ids"
    short = rec(0, [0])
    short.logprobs = [-0.5]
    assert unusable_reason(short) == "logprobs and response ids differ in length"


def test_detect_eot_prefers_a_stop_token_the_prompt_confirms() -> None:
    unconfirmed = rec(0, [0, 7], [7, 9])  # 9 ends the turn but never appears in a prompt
    other_unconfirmed = rec(1, [0, 8], [8, 7])
    confirmed = rec(2, [0, 7, 9, EOT], [8, EOT])
    assert detect_eot([unconfirmed, confirmed]) == EOT
    assert detect_eot([unconfirmed, other_unconfirmed]) == 9  # the first natural stop is the fallback
    assert detect_eot([unconfirmed], confirmed_only=True) is None
    # a length cap, a stop string, an empty turn and a failed call never name the token
    skipped = [
        rec(0, [0, 8], [8], finish="length"),
        rec(1, [0, 8], [8], matched_stop="END"),
        rec(2, [0, 8], []),
        rec(3, [0, 8], [8], status="failed"),
    ]
    assert detect_eot(skipped) is None and detect_eot([]) is None


def test_a_continuity_prompt_does_not_confirm_a_stop_token_it_holds_as_sampled() -> None:
    # Token continuity: call 1's prompt holds call 0's sampled 9 verbatim, closed by the template's EOT.
    first = rec(0, [0, EOT], [7, 9])
    stopped = rec(1, [0, EOT, 7, 9, EOT, 1], [8, 9], prompt_source="continuity")
    assert detect_eot([first, stopped], confirmed_only=True) is None
    # The session's fully rendered first prompt confirms the template's own end of turn.
    closed = rec(2, [0, EOT, 7, 9, EOT, 1, 8, 9, EOT, 2], [8, EOT], prompt_source="continuity")
    assert detect_eot([first, stopped, closed], confirmed_only=True) == EOT
    assert detect_eot([stopped]) == 9  # unconfirmed, still the fallback


# --- merge: the completion a chain becomes ----------------------------------------------------------


def test_merge_lays_out_sampled_and_interstitial_segments() -> None:
    chain = RecordChain(
        index=0, records=[rec(0, [0], [7, EOT]), rec(1, [0], [8, 9, EOT]), rec(2, [0], [])], interstitials=[[1, 2], []]
    )
    merged = chain.merge()
    assert merged.completion_ids == [7, EOT, 1, 2, 8, 9, EOT]
    assert merged.loss_mask == [1, 1, 0, 0, 1, 1, 1]
    assert merged.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert merged.segments == [
        Segment("sampled", 0, 0, 2),
        Segment("interstitial", 1, 2, 4),
        Segment("sampled", 1, 4, 7),
    ]


# --- join: one call after another ---------------------------------------------------------------------


def test_join_refuses_a_repeated_prompt_changed_sampling_or_no_end_of_turn() -> None:
    prev = rec(3, [0, 7])
    assert join(prev, rec(4, [0, 7]), EOT, decode) == Break(
        BreakCause.OTHER, "call 4 re-sent call 3's prompt unchanged (a retry or a parallel sample)"
    )
    assert join(rec(3, [0], temperature=1.0), rec(4, [0, 7, EOT], temperature=0.7), EOT, decode) == Break(
        BreakCause.OTHER, "sampling temperature changed from 1.0 to 0.7 at call 4"
    )
    assert join(rec(3, [0], top_k=0), rec(4, [0, 7, EOT], top_k=20), EOT, decode) == Break(
        BreakCause.OTHER, "sampling top_k changed from 0 to 20 at call 4"
    )
    assert join(prev, rec(4, [0, 7, 7, EOT]), None, decode) == Break(
        BreakCause.OTHER, "end-of-turn token unknown (no naturally stopped call); pass it explicitly"
    )
    assert join(prev, rec(4, [0, 7, 7, 8]), EOT, decode) == Break(
        BreakCause.OTHER, "no end-of-turn token in call 4's prompt after call 3's"
    )


def test_join_takes_what_follows_the_copied_turn_as_the_interstitial() -> None:
    assert join(rec(0, [0], [7, EOT]), rec(1, [0, 7, EOT, 1, 2]), EOT, decode) == Join([1, 2], retokenized=False)
    # a length-capped turn is closed by the template: the interstitial starts at its end-of-turn token
    capped = rec(0, [0], [7, 8], finish="length")
    assert join(capped, rec(1, [0, 7, 8, EOT, 1]), EOT, decode) == Join([EOT, 1], retokenized=False)


def test_join_merges_a_retokenized_turn_unless_told_not_to() -> None:
    prev = rec(0, [0], [1, 2, EOT])
    nxt = rec(1, [0, 3, EOT, 7], messages=[SYS, TASK, assistant("fishing<eot>")])
    assert join(prev, nxt, EOT, decode) == Join([7], retokenized=True)
    assert join(prev, nxt, EOT, decode, merge_retokenized=False) == Break(
        BreakCause.RETOKENIZED,
        "call 1's prompt re-tokenized call 0's sampled turn (same text, 2 tokens instead of 3); "
        "not merged, so call 1 keeps the context it was sampled in",
    )


def test_join_a_turn_ended_by_another_stop_token_is_a_template_rerender() -> None:
    prev = rec(0, [0], [7, 8, 9])
    assert join(prev, rec(1, [0, 7, 8, EOT, 1]), EOT, decode) == Break(
        BreakCause.TEMPLATE_RERENDER, "call 0 ended its turn with stop token 9; the template closed it with 6"
    )


def test_join_a_turn_the_proxy_closed_with_the_templates_end_of_turn_is_exact() -> None:
    """Token continuity closes a turn the engine ended without EOT (another stop token, a length cut) with the
    template's EOT after the sampled ids: the copy is the sampled turn, the EOT starts the interstitial."""
    stopped = rec(0, [0], [7, 8, 9])
    nxt = rec(1, [0, 7, 8, 9, EOT, 1], prompt_source="continuity")
    assert join(stopped, nxt, EOT, decode) == Join([EOT, 1], retokenized=False)
    chain = RecordChain(0, [stopped, nxt], [[EOT, 1]])
    assert chain.merge().loss_mask == [1, 1, 1, 0, 0, 1, 1]


def test_join_a_length_capped_turn_rendered_shorter_is_classified_not_blamed_on_a_stop_token() -> None:
    capped = rec(0, [0], [7, 8], finish="length")
    nxt = rec(1, [0, 7, EOT, 1], messages=[SYS, TASK, assistant("ab"), tool("out")])
    brk = join(capped, nxt, EOT, decode)
    assert brk == Break(
        BreakCause.TEMPLATE_RERENDER,
        "the template rendered the same message differently: call 1 re-rendered call 0's turn as 1 tokens "
        "(sampled 2; first difference at token 1)",
    )


# --- reconstruct_session: which chain a call joins, and how chains relate ----------------------------


def test_a_retokenized_turn_is_merged_by_default() -> None:
    records = [rec(0, [0], [1, 2, EOT]), rec(1, [0, 3, EOT, 7], messages=[SYS, TASK, assistant("fishing<eot>")])]
    [chain] = reconstruct_session(records, eot=EOT, decode=decode)
    assert chain.retokenized == 1 and [r.seq for r in chain.records] == [0, 1]
    split = reconstruct_session(records, eot=EOT, decode=decode, merge_retokenized=False)
    assert [c.start.cause if c.start else None for c in split] == [None, BreakCause.RETOKENIZED]


def test_a_call_extending_two_identical_chains_joins_the_latest() -> None:
    """Two parallel samples with the same answer: the follow-up continues the later one."""
    records = [rec(0, [0]), rec(1, [0]), rec(2, [0, 7, EOT, 1])]
    first, second = reconstruct_session(records, eot=EOT, decode=decode)
    assert [r.seq for r in first.records] == [0] and [r.seq for r in second.records] == [1, 2]
    assert second.start is not None and second.start.cause == BreakCause.OTHER and second.related == 0


def test_a_sub_agent_is_told_by_the_parent_carrying_on_at_its_next_call() -> None:
    sub = [SYS, OTHER_TASK]
    records = [
        rec(0, [0, 7], [8, EOT]),
        rec(1, [0, 8], [7, EOT], messages=sub),  # another first user message, same system prompt
        rec(2, [0, 7, 8, EOT, 1], [7, EOT]),  # the parent carries on...
        rec(3, [0, 8, 7, EOT, 2], messages=sub),  # ...interleaved with the sub-agent
        rec(4, [0, 7, 8, EOT, 1, 7, EOT, 2]),
    ]
    parent, child = reconstruct_session(records, eot=EOT, decode=decode)
    assert [r.seq for r in parent.records] == [0, 2, 4] and [r.seq for r in child.records] == [1, 3]
    assert child.start == sub_agent_break(2) and child.related == 0
    assert parent.end is None and parent.continued_by is None  # a sub-agent cuts nothing


def test_a_replaced_first_user_message_without_the_parent_carrying_on_cuts_it() -> None:
    records = [rec(0, [0, 7], [8, EOT]), rec(1, [0, 8], messages=[SYS, OTHER_TASK])]
    parent, later = reconstruct_session(records, eot=EOT, decode=decode)
    assert later.start == Break(BreakCause.REWRITTEN_HISTORY, "first user message replaced (compaction) after call 0")
    assert parent.end == later.start and parent.continued_by == 1


def test_a_call_without_messages_starts_an_unrelated_chain() -> None:
    records = [rec(0, [0, 7]), rec(1, [0, 8], messages=[])]
    parent, orphan = reconstruct_session(records, eot=EOT, decode=decode)
    assert orphan.start == Break(BreakCause.OTHER, "call 1 has no captured messages") and orphan.related is None
    assert parent.end is None and parent.continued_by is None


def test_a_chain_is_continued_by_the_first_chain_that_broke_from_it() -> None:
    history = [SYS, TASK, assistant("a"), tool("1"), assistant("b")]
    edited = [SYS, TASK, assistant("a"), tool("edited"), assistant("b")]
    records = [
        rec(0, [0, 1], messages=history),
        rec(1, [0, 2], messages=edited),
        rec(2, [0, 3], messages=history[:4] + [assistant("c")]),
    ]
    parent, first, second = reconstruct_session(records, eot=EOT, decode=decode)
    assert first.related == 0 and second.related == 0  # both share most messages with call 0
    assert parent.end == first.start and parent.continued_by == 1
