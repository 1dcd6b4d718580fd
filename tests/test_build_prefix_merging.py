"""Prefix merging on sessions made with the real tiny-model tokenizer and chat template."""

from __future__ import annotations

import random

import pytest
from build_helpers import (
    DROP_THINK_TEMPLATE,
    EMPTY_THINK_PROMPT_TEMPLATE,
    QWEN3_STYLE_TEMPLATE,
    AgentSim,
    Turn,
    check_trace,
    coding_turns,
    decode,
    eot_id,
    ok_call,
    tool_loop,
    tool_result,
)

from polar_cli.build import BuildResult, SessionInfo, build_traces, detect_eot
from polar_cli.build.breaks import BreakCause
from polar_cli.build.prefix_merging import reconstruct_session

SYSTEM = {"role": "system", "content": "You are a careful coding agent working in /repo."}
TASK = {"role": "user", "content": "The test test_parse fails. Fix it."}


def build(records, *, reward: float = 1.0, use_decode: bool = True, **kw) -> BuildResult:
    sessions = {sid: SessionInfo(sid, reward=reward) for sid in {r.session_id for r in records}}
    return build_traces(records, sessions, decode=decode if use_decode else None, **kw)


def checked(result: BuildResult, records, *, retokenized_ok: bool = False) -> None:
    by_id = {r.record_id: r for r in records}
    for trace in result.traces:
        check_trace(trace, by_id, retokenized_ok=retokenized_ok)
    used = [rid for t in result.traces for rid in t.record_ids]
    assert sorted(used) == sorted(r.record_id for r in records if r.status == "ok"), "a call was lost or duplicated"


def test_tool_loop_merges_into_one_exact_trace() -> None:
    sim = AgentSim()
    tool_loop(sim, [SYSTEM, TASK], coding_turns(8))
    result = build(sim.records)
    checked(result, sim.records)
    [trace] = result.traces
    assert trace.calls_merged == 8 and trace.break_cause is None and trace.trainable and trace.reward == 1.0
    # The merged stream up to the last sampled turn is exactly the last call's prompt.
    last = sim.records[-1]
    assert trace.prompt_ids + trace.completion_ids[: -len(last.response_ids)] == last.prompt_ids
    assert sum(trace.loss_mask) == sum(len(r.response_ids) for r in sim.records)
    stats = result.report.total
    assert (stats.chains_total, stats.chains_full, stats.chains_truncated) == (1, 1, 0)
    assert stats.calls_merged == 7 and stats.merge_rate == pytest.approx(7 / 8) and stats.breaks == {}


def test_eot_is_detected_from_the_first_natural_stop() -> None:
    sim = AgentSim()
    tool_loop(sim, [SYSTEM, TASK], [Turn(content="partial", max_tokens=2), *coding_turns(2)])
    assert sim.records[0].finish_reason == "length"
    assert detect_eot(sim.records) == eot_id()
    assert build(sim.records, eot_token_id=eot_id()).eot_token_id == eot_id()


def test_turn_ended_by_another_stop_token() -> None:
    """A model with two stop tokens ends a turn with <|endoftext|>; the template closes it with <|im_end|>."""
    sim = AgentSim()
    turns = coding_turns(3)
    turns[0].stop_token = "<|endoftext|>"
    tool_loop(sim, [SYSTEM, TASK], turns)
    first = sim.records[0]
    assert first.finish_reason == "tool_calls" and first.response_ids[-1] != eot_id()
    assert detect_eot(sim.records) == eot_id()  # the stop token that also closes turns in the prompt
    result = build(sim.records)
    checked(result, sim.records)
    assert [t.calls_merged for t in result.traces] == [1, 2]
    assert result.traces[0].break_cause == "template_rerender"
    [cut, _] = reconstruct_session(sim.records, eot=eot_id(), decode=decode)
    assert "ended its turn with stop token" in cut.end.detail


def test_length_capped_turn_is_closed_by_the_interstitial() -> None:
    """a_m without the end-of-turn token: u_m starts at the template's end-of-turn token."""
    sim = AgentSim()
    messages = [SYSTEM, TASK]
    first = sim.call(messages, Turn(content="I will look at the parser module first and then", max_tokens=5))
    assert first.response_ids[-1] != eot_id()
    # The harness sends back the truncated text; the template closes the turn.
    messages = messages + [
        {"role": "assistant", "content": decode(first.response_ids)},
        {"role": "user", "content": "go on"},
    ]
    tool_loop(sim, messages, coding_turns(2))
    result = build(sim.records)
    checked(result, sim.records)
    [trace] = result.traces
    u_start = len(first.response_ids)
    assert trace.completion_ids[u_start] == eot_id() and trace.loss_mask[u_start] == 0


def test_sub_agent_gets_its_own_chain_and_cuts_nothing() -> None:
    sim = AgentSim()
    main = [SYSTEM, TASK]
    spawn = sim.call(main, Turn(tool_calls=[("bash", {"cmd": "grep -rn parse src"})]))
    sub_messages = [
        {"role": "system", "content": "You are a search sub-agent."},
        {"role": "user", "content": "Find parse()."},
    ]
    tool_loop(sim, sub_messages, coding_turns(3))
    main = main + [sim.sent_back(spawn), tool_result(spawn, "src/parse.py:10")]
    tool_loop(sim, main, coding_turns(3))
    result = build(sim.records)
    checked(result, sim.records)
    main_trace, sub_trace = result.traces
    assert main_trace.calls_merged == 4 and sub_trace.calls_merged == 3
    assert main_trace.break_cause is None and sub_trace.break_cause is None
    stats = result.report.total
    assert stats.breaks == {"sub_agent": 1} and stats.chains_truncated == 0


def test_sub_agent_with_the_parents_system_prompt() -> None:
    """Same system prompt, another first user message, and the parent carries on: a sub-agent."""
    sim = AgentSim()
    main = [SYSTEM, TASK]
    spawn = sim.call(main, Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    tool_loop(sim, [SYSTEM, {"role": "user", "content": "Summarize README.md"}], coding_turns(2))
    tool_loop(sim, main + [sim.sent_back(spawn), tool_result(spawn, "README.md")], coding_turns(2))
    result = build(sim.records)
    checked(result, sim.records)
    assert result.report.total.breaks == {"sub_agent": 1}
    assert [t.break_cause for t in result.traces] == [None, None]


def test_compaction_truncates_the_chain_and_starts_a_new_one() -> None:
    sim = AgentSim()
    history = tool_loop(sim, [SYSTEM, TASK], coding_turns(4)[:-1])
    summary = {"role": "user", "content": "This session continues an earlier one. Summary: parse() was fixed."}
    tool_loop(sim, [SYSTEM, summary], coding_turns(3))
    result = build(sim.records)
    checked(result, sim.records)
    before, after = result.traces
    assert (before.calls_merged, after.calls_merged) == (3, 3)
    assert before.break_cause == BreakCause.REWRITTEN_HISTORY and after.break_cause is None
    assert result.report.total.breaks == {"rewritten_history": 1}
    assert result.report.total.chains_truncated == 1
    assert len(history) > 2


def test_history_edit_is_rewritten_history() -> None:
    """The harness drops an old tool result (same root, history differs before the tail)."""
    sim = AgentSim()
    messages = tool_loop(sim, [SYSTEM, TASK], coding_turns(3)[:-1])
    edited = [m for m in messages if not (m["role"] == "tool" and "#0" in m["content"])]
    tool_loop(sim, edited, coding_turns(2))
    result = build(sim.records)
    checked(result, sim.records)
    assert [t.break_cause for t in result.traces] == ["rewritten_history", None]
    chains = result.traces
    assert [t.calls_merged for t in chains] == [2, 2]


def test_qwen3_template_drops_old_thinking_after_a_new_user_turn() -> None:
    """Within a tool loop Qwen3 keeps thinking (merges); a new user turn re-renders earlier turns."""
    sim = AgentSim(template=QWEN3_STYLE_TEMPLATE)
    messages = tool_loop(sim, [SYSTEM, TASK], coding_turns(3, reasoning=True))
    tool_loop(
        sim, messages + [{"role": "user", "content": "Now update the changelog."}], coding_turns(3, reasoning=True)
    )
    result = build(sim.records)
    checked(result, sim.records)
    first, second = result.traces
    assert (first.calls_merged, second.calls_merged) == (3, 3)
    assert first.break_cause == BreakCause.TEMPLATE_RERENDER
    assert result.report.total.breaks == {"template_rerender": 1}


def test_template_dropping_think_from_history_breaks_instead_of_merging() -> None:
    """The next prompt extends the previous one, but its copy of the sampled turn has no think block."""
    sim = AgentSim(template=DROP_THINK_TEMPLATE)
    tool_loop(sim, [SYSTEM, TASK], coding_turns(3, reasoning=True))
    # Token prefixes hold (the generation prompt ends before the think block) ...
    for prev, nxt in zip(sim.records, sim.records[1:]):
        assert nxt.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
    result = build(sim.records)
    checked(result, sim.records)
    # ... yet merging would train turn 2 after a think block the model never saw.
    assert [t.calls_merged for t in result.traces] == [1, 1, 1]
    assert [t.break_cause for t in result.traces] == ["template_rerender", "template_rerender", None]
    assert result.report.total.breaks == {"template_rerender": 2}
    # Without a tokenizer the mismatch still breaks, as "other".
    blind = build(sim.records, use_decode=False)
    assert [t.break_cause for t in blind.traces] == ["other", "other", None]


def test_generation_prompt_unlike_history_breaks_every_call() -> None:
    """Qwen3 with thinking off opens an empty think block in the generation prompt only: no prompt
    is a prefix of the next, and every break is the template's."""
    sim = AgentSim(template=EMPTY_THINK_PROMPT_TEMPLATE)
    tool_loop(sim, [SYSTEM, TASK], coding_turns(4))
    assert decode(sim.records[0].prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    result = build(sim.records)
    checked(result, sim.records)
    assert [t.calls_merged for t in result.traces] == [1, 1, 1, 1]
    assert [t.break_cause for t in result.traces] == ["template_rerender"] * 3 + [None]
    stats = result.report.total
    assert stats.breaks == {"template_rerender": 3} and stats.chains_truncated == 3 and stats.merge_rate == 0.0


def test_harness_not_sending_reasoning_back_is_rewritten_history() -> None:
    sim = AgentSim()
    tool_loop(sim, [SYSTEM, TASK], coding_turns(3, reasoning=True), reasoning=False)
    result = build(sim.records, use_decode=False)
    checked(result, sim.records)
    assert [t.break_cause for t in result.traces] == ["rewritten_history", "rewritten_history", None]


def test_reserialized_tool_arguments_are_rewritten_history() -> None:
    sim = AgentSim()
    tool_loop(sim, [SYSTEM, TASK], coding_turns(2), compact_args=True)
    result = build(sim.records)
    assert [t.break_cause for t in result.traces] == ["rewritten_history", None]


def test_retokenized_sampled_turn_is_merged_and_counted() -> None:
    sim = AgentSim()
    turns = coding_turns(4)
    turns[1].retokenize = True
    tool_loop(sim, [SYSTEM, TASK], turns)
    result = build(sim.records)
    checked(result, sim.records, retokenized_ok=True)
    [trace] = result.traces
    assert trace.calls_merged == 4 and result.report.total.retokenized_merges == 1
    # The sampled ids are kept as sampled (not the canonical re-tokenization).
    assert (
        sim.records[1].response_ids
        != sim.records[2].prompt_ids[len(sim.records[1].prompt_ids) :][: len(sim.records[1].response_ids)]
    )
    # Without a tokenizer nothing proves the text is the same: break, cause other.
    blind = build(sim.records, use_decode=False)
    assert [t.break_cause for t in blind.traces] == ["other", None]


def test_retokenized_turn_breaks_the_chain_when_asked() -> None:
    sim = AgentSim()
    turns = coding_turns(4)
    turns[1].retokenize = True
    tool_loop(sim, [SYSTEM, TASK], turns)
    merged = build(sim.records, merge_retokenized=True)
    assert len(merged.traces) == 1 and merged.report.total.retokenized_merges == 1

    strict = build(sim.records, merge_retokenized=False)
    # Every merged turn follows exactly the prompt it was sampled after: no re-tokenized stream.
    checked(strict, sim.records, retokenized_ok=False)
    first, second = strict.traces
    assert [r.seq for r in sim.records if r.record_id in first.record_ids] == [0, 1]
    assert [r.seq for r in sim.records if r.record_id in second.record_ids] == [2, 3]
    assert first.break_cause == "retokenized" and second.break_cause is None
    assert list(second.prompt_ids) == sim.records[2].prompt_ids
    stats = strict.report.total
    assert stats.breaks == {"retokenized": 1} and stats.retokenized_merges == 0
    assert (stats.chains_total, stats.chains_truncated, stats.calls_merged) == (2, 1, 2)

    chains = reconstruct_session(sim.records, eot=eot_id(), decode=decode, merge_retokenized=False)
    assert chains[1].start is not None and chains[1].start.cause == BreakCause.RETOKENIZED
    assert chains[1].related == 0 and chains[0].continued_by == 1
    assert "call 2's prompt re-tokenized call 1's sampled turn" in chains[1].start.detail


def test_a_retokenized_previous_prompt_starts_a_chain_with_cause_retokenized() -> None:
    """The next call re-tokenized the previous call's *prompt* (same text, other ids): no chain's
    prompt is a token prefix any more, so the call opens a chain, and the cause says why."""
    from build_helpers import split_one_token

    sim = AgentSim()
    tool_loop(sim, [SYSTEM, TASK], coding_turns(2))
    first, second = sim.records
    split = split_one_token(first.prompt_ids)
    assert decode(split) == decode(first.prompt_ids) and split != first.prompt_ids
    second.prompt_ids = split + second.prompt_ids[len(first.prompt_ids) :]

    chains = reconstruct_session(sim.records, eot=eot_id(), decode=decode)
    assert len(chains) == 2 and chains[1].related == 0
    assert chains[1].start is not None and chains[1].start.cause == BreakCause.RETOKENIZED
    assert chains[1].start.detail.startswith("same text, new token ids: call 1 changes call 0's prompt at token ")
    result = build(sim.records)
    assert [t.break_cause for t in result.traces] == ["retokenized", None]
    # Without a tokenizer the same break can only be called a re-render.
    blind = reconstruct_session(sim.records, eot=eot_id(), decode=None)
    assert blind[1].start is not None and blind[1].start.cause == BreakCause.TEMPLATE_RERENDER


def test_a_retried_prompt_is_discarded_and_the_answer_used_continues_the_chain() -> None:
    sim = AgentSim()
    messages = [SYSTEM, TASK]
    sim.call(messages, Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    retry = sim.call(messages, Turn(tool_calls=[("bash", {"cmd": "ls src"})]))
    tool_loop(sim, messages + [sim.sent_back(retry), tool_result(retry, "a.py")], coding_turns(2))
    result = build(sim.records)
    [trace] = result.traces
    # The harness threw the first answer away: it did not act on the task, so it is not credited with the outcome.
    assert trace.calls_merged == 3 and sim.records[0].record_id not in trace.record_ids and trace.trainable
    assert result.report.total.roles == {"agent": 3, "discarded: retried": 1}
    assert result.report.total.breaks == {}

    # Trained on purpose (--roles agent,discarded), the repeat branches off as before roles.
    kept = build(sim.records, roles={"agent", "discarded"})
    checked(kept, sim.records)
    first, second = kept.traces
    assert first.calls_merged == 1 and second.calls_merged == 3
    assert (first.role, second.role) == ("discarded", "agent") and first.trainable
    assert first.break_cause == "other"
    assert kept.report.total.breaks == {"other": 1}


def test_failed_calls_are_never_training_data() -> None:
    sim = AgentSim()
    messages = [SYSTEM, TASK]
    first = sim.call(messages, Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    messages = messages + [sim.sent_back(first), tool_result(first, "a.py")]
    sim.call(messages, Turn(content="x"), status="failed")
    tool_loop(sim, messages, coding_turns(2))
    result = build(sim.records)
    checked(result, sim.records)
    [trace] = result.traces
    assert trace.calls_merged == 3
    assert sim.records[1].record_id not in trace.record_ids
    assert result.report.total.calls_unusable == {"failed call": 1}


def test_temperature_change_breaks() -> None:
    sim = AgentSim()
    messages = [SYSTEM, TASK]
    first = sim.call(messages, Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    sim.call(messages + [sim.sent_back(first), tool_result(first, "a.py")], Turn(content="done"), temperature=0.6)
    result = build(sim.records)
    assert [t.break_cause for t in result.traces] == ["other", None]
    assert [t.temperature for t in result.traces] == [1.0, 0.6]


def test_changed_tool_definitions_are_rewritten_history() -> None:
    sim = AgentSim()
    messages = tool_loop(sim, [SYSTEM, TASK], coding_turns(2)[:-1])
    sim.call(messages, Turn(content="done"), tools=sim.tools[:1])
    result = build(sim.records)
    assert [t.break_cause for t in result.traces] == ["rewritten_history", None]


def test_rebuild_is_deterministic_and_order_independent() -> None:
    sims = []
    for i in range(3):
        sim = AgentSim(f"s{i}")
        tool_loop(sim, [SYSTEM, TASK], coding_turns(4, reasoning=i == 1))
        sims.append(sim)
    records = [r for s in sims for r in s.records]
    a = build(records)
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    b = build(shuffled)
    assert [t.to_dict() for t in a.traces] == [t.to_dict() for t in b.traces]
    assert a.report.to_dict() == b.report.to_dict()


def test_eot_detection_skips_a_stop_token_the_template_never_writes() -> None:
    """A random model may stop on <|endoftext|> (never in a prompt) in the first session read;
    detection must still settle on the token that closes turns in prompts."""
    from polar_cli.build import iter_session_builds

    a = [ok_call("a", 0, [5, 6], [7, 0], logprobs=[-1.0, -1.0])]  # stopped on 0, which no prompt holds
    b = [ok_call("b", 0, [5, 2, 6], [8, 2], logprobs=[-1.0, -1.0])]  # 2 closes a turn in the prompt
    built = list(iter_session_builds(a + b, {}))  # sessions in store order: a first
    assert {s.eot_token_id for s in built} == {2}
