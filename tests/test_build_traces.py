"""The trace row built from records (make_trace, per_request_trace) and the build's session pipeline.

Records here are written by hand with distinct values in every field, so a trace field taken from the wrong record
(a later call's sampling, the record's identity where the session row has one) or left at its default shows.
"""

from __future__ import annotations

import pytest
from build_helpers import ok_call

from polar_addon.capture import CaptureRecord
from polar_cli.build import BuildStats, build_session, build_traces, iter_session_builds
from polar_cli.build.per_request import per_request_trace
from polar_cli.build.rewards import RewardDecision, SessionInfo
from polar_cli.build.traces import make_trace

DECISION = RewardDecision(reward=0.5, trainable=True, reason="outcome reward")


def record(seq: int, **kw: object) -> CaptureRecord:
    fields: dict = dict(
        record_id=f"rec-{seq}",
        session_id="sess",
        seq=seq,
        api="openai_chat",
        status="ok",
        prompt_ids=[100 + seq, 101 + seq],
        response_ids=[200 + seq, 201 + seq, 202 + seq],
        logprobs=[-0.1 * (seq + 1), -0.2, -0.3],
        task_id=f"rec-task-{seq}",
        group_id=f"rec-group-{seq}",
        sample_index=10 + seq,
        temperature=0.6 + seq / 10,
        top_p=0.9 - seq / 10,
        top_k=20 + seq,
        min_p=0.01 * (seq + 1),
    )
    fields.update(kw)
    return CaptureRecord(**fields)


def trace_of(records: list[CaptureRecord], session: SessionInfo | None, **kw: object):
    args: dict = dict(
        trace_id="sess:c3",
        session_id="sess",
        session=session,
        harness="claude-cli",
        chain_index=3,
        records=records,
        completion_ids=[7, 8, 9],
        loss_mask=[1, 0, 1],
        logprobs=[-0.5, 0.0, -0.25],
        decision=DECISION,
        break_cause="compaction",
        role="auxiliary",
    )
    args.update(kw)
    return make_trace(**args)


def test_make_trace_takes_the_chain_from_its_arguments_and_sampling_from_the_first_call() -> None:
    session = SessionInfo("sess", task_id="t", group_id="g", sample_index=4, harness="h", status="timeout")
    trace = trace_of([record(0), record(1)], session)
    assert trace.to_dict() == {
        "trace_id": "sess:c3",
        "session_id": "sess",
        "prompt_ids": [100, 101],
        "completion_ids": [7, 8, 9],
        "loss_mask": [1, 0, 1],
        "behavior_logprobs": [-0.5, 0.0, -0.25],
        "task_id": "t",
        "group_id": "g",
        "sample_index": 4,
        "chain_index": 3,
        "reward": 0.5,
        "trainable": True,
        "status": "timeout",
        "calls_merged": 2,
        "record_ids": ["rec-0", "rec-1"],
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.01,
        "weight_versions": [],
        "harness": "claude-cli",
        "break_cause": "compaction",
        "role": "auxiliary",
    }


def test_the_decision_decides_reward_and_trainable() -> None:
    trace = trace_of([record(0)], None, decision=RewardDecision(0.0, False, "no session row"))
    assert (trace.reward, trace.trainable) == (0.0, False)
    assert trace_of([record(0)], None, decision=RewardDecision(1.0, True, "x")).trainable is True


def test_identity_comes_from_the_session_row_where_it_has_one_else_from_the_first_call() -> None:
    calls = [record(0), record(1)]
    # No session row: the first call's identity, and a status nobody reported.
    bare = trace_of(calls, None)
    assert (bare.task_id, bare.group_id, bare.sample_index, bare.status) == (
        "rec-task-0",
        "rec-group-0",
        10,
        "unknown",
    )
    # A session row without identity fields: still the first call's, with the row's status.
    empty = trace_of(calls, SessionInfo("sess", status="error"))
    assert (empty.task_id, empty.group_id, empty.sample_index, empty.status) == (
        "rec-task-0",
        "rec-group-0",
        10,
        "error",
    )
    # Sample 0 and empty ids are set values, not missing ones.
    zero = trace_of(calls, SessionInfo("sess", task_id="", group_id="", sample_index=0))
    assert (zero.task_id, zero.group_id, zero.sample_index, zero.status) == ("", "", 0, "completed")
    # Each field falls back on its own.
    mixed = trace_of(calls, SessionInfo("sess", group_id="G"))
    assert (mixed.task_id, mixed.group_id, mixed.sample_index) == ("rec-task-0", "G", 10)
    mixed = trace_of(calls, SessionInfo("sess", task_id="T"))
    assert (mixed.task_id, mixed.group_id, mixed.sample_index) == ("T", "rec-group-0", 10)
    mixed = trace_of(calls, SessionInfo("sess", sample_index=7))
    assert (mixed.task_id, mixed.group_id, mixed.sample_index) == ("rec-task-0", "rec-group-0", 7)


def test_weight_versions_are_each_version_once_in_the_order_first_seen() -> None:
    versions = ["w1", None, "w2", "w1", "w3", "w2", None]
    trace = trace_of([record(i, weight_version=v) for i, v in enumerate(versions)], None)
    assert trace.weight_versions == ["w1", "w2", "w3"]
    assert trace.calls_merged == 7 and trace.record_ids == [f"rec-{i}" for i in range(7)]
    assert trace_of([record(0, weight_version=None)], None).weight_versions == []
    # A later call's version counts even when the first call has none.
    assert trace_of([record(0, weight_version=None), record(1, weight_version="w9")], None).weight_versions == ["w9"]


def test_a_call_sampled_across_a_push_adds_every_version_of_its_spans() -> None:
    spans = '[{"version":"3","start":0,"end":2},{"version":"4","start":2,"end":5}]'
    calls = [record(0, weight_version="3", weight_versions_json=spans), record(1, weight_version="4")]
    assert trace_of(calls, None).weight_versions == ["3", "4"]
    assert trace_of([record(0, weight_version="3", weight_versions_json=spans)], None).weight_versions == ["3", "4"]


def test_temperature_is_the_first_calls_as_a_float_and_one_when_unrecorded() -> None:
    unrecorded = trace_of([record(0, temperature=None), record(1, temperature=0.2)], None)
    assert unrecorded.temperature == 1.0
    greedy = trace_of([record(0, temperature=0), record(1)], None)
    assert greedy.temperature == 0.0 and isinstance(greedy.temperature, float)
    untruncated = trace_of([record(0, top_p=None, top_k=None, min_p=None), record(1)], None)
    assert (untruncated.top_p, untruncated.top_k, untruncated.min_p) == (None, None, None)


def test_per_request_trace_is_the_call_itself_all_sampled() -> None:
    call = record(6, weight_version="w5")
    session = SessionInfo("sess", task_id="t", group_id="g", sample_index=1, status="completed", reward=1.0)
    trace = per_request_trace(call, session, "codex", RewardDecision(1.0, True, "outcome reward"), "agent")
    assert trace.to_dict() == {
        "trace_id": "sess:r6",
        "session_id": "sess",
        "prompt_ids": [106, 107],
        "completion_ids": [206, 207, 208],
        "loss_mask": [1, 1, 1],
        "behavior_logprobs": call.logprobs,
        "task_id": "t",
        "group_id": "g",
        "sample_index": 1,
        "chain_index": 6,
        "reward": 1.0,
        "trainable": True,
        "status": "completed",
        "calls_merged": 1,
        "record_ids": ["rec-6"],
        "temperature": 1.2,
        "top_p": 0.9 - 0.6,
        "top_k": 26,
        "min_p": 0.07,
        "weight_versions": ["w5"],
        "harness": "codex",
        "break_cause": None,
        "role": "agent",
    }
    untrained = per_request_trace(call, None, "pi", RewardDecision(0.0, False, "no broadcast"), "discarded")
    assert (untrained.role, untrained.trainable, untrained.status, untrained.task_id) == (
        "discarded",
        False,
        "unknown",
        "rec-task-6",
    )


# ---- the build pipeline (polar_cli.build) -------------------------------------------------------------------------

EOT = 2  # closes every turn below, in prompts and sampled ids alike


def tool_answer() -> str:
    return '{"content": null, "tool_calls": [{"id": "c1", "name": "bash", "arguments": "{}"}]}'


def loop(session: str = "s", **first: object) -> list[CaptureRecord]:
    """Two calls that merge (the second prompt continues the first turn), then one with an unrelated prompt."""
    return [
        ok_call(session, 0, [5, 6], [7, EOT], **first),
        ok_call(session, 1, [5, 6, 7, EOT, 9], [10, 11, EOT]),
        ok_call(session, 2, [30, 31, 32], [33, EOT]),
    ]


def test_an_unknown_strategy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError) as refused:
        build_session("s", loop(), None, strategy="greedy", eot_token_id=EOT)
    assert str(refused.value) == "unknown strategy 'greedy': use one of prefix_merging, per_request"


def test_session_stats_count_every_call_chain_and_token() -> None:
    records = [
        ok_call("s", 0, [5, 6], [7, EOT], prompt_source="fresh", prompt_reason="first_call", tool_call_parser="hermes",
             parse_failures=0),
        ok_call("s", 1, [5, 6, 7, EOT, 9], [10, 11, EOT], prompt_source="continuity", prompt_reason="kept",
             harness="pi/0.3 (linux)", parse_failures=2, tool_call_parser="hermes"),
        CaptureRecord("s2", "s", 2, "openai_chat", "failed", error="engine down", role="discarded",
                      role_reason="failed"),
        ok_call("s", 3, [30, 31, 32], [33, EOT], prompt_source="fresh", prompt_reason="no_delta: tools changed",
             tool_call_parser="fenced_json", harness="codex"),
        ok_call("s", 4, [30, 31, 32, 33, EOT, 40], [41, EOT], prompt_source="fresh", prompt_reason=None),
    ]  # fmt: skip
    built = build_session("s", records, SessionInfo("s", reward=1.0), eot_token_id=EOT)
    assert (built.session_id, built.harness, built.eot_token_id) == ("s", "pi", EOT)
    assert [len(c.records) for c in built.chains] == [2, 2]
    # Chain 0 holds a parse failure: reward 0, still trainable.
    assert [(t.trace_id, t.chain_index, t.reward, t.trainable) for t in built.traces] == [
        ("s:c0", 0, 0.0, True),
        ("s:c1", 1, 1.0, True),
    ]
    assert built.stats == BuildStats(
        sessions=1,
        calls=4,
        calls_unusable={"failed call": 1},
        chains_total=2,
        # The second chain is another conversation (no messages relate it to the first): nothing was cut.
        chains_full=2,
        chains_truncated=0,
        calls_merged=2,
        retokenized_merges=0,
        breaks={"other": 1},
        traces=2,
        traces_trainable=2,
        reward_reasons={"parser-invalid tool call": 1, "outcome reward": 1},
        prompt_sources={"fresh": 3, "continuity": 1},
        fresh_reasons={"first_call": 1, "no_delta: tools changed": 1},
        parse_failed_calls=1,
        tool_call_parsers={"hermes": 2, "fenced_json": 1},
        roles={"agent": 4, "discarded: failed": 1},
        mixed_role_chains=0,
        prompt_tokens=2 + 3,
        completion_tokens=(2 + 1 + 3) + (2 + 1 + 2),
        trainable_tokens=(2 + 3) + (2 + 2),
    )
    # An untrainable session trains no token, though its traces are counted.
    masked = build_session("s", records, SessionInfo("s", status="error"), eot_token_id=EOT).stats
    assert (masked.traces, masked.traces_trainable, masked.trainable_tokens) == (2, 0, 0)
    assert masked.completion_tokens == 11


def test_a_chain_of_two_roles_is_counted_mixed() -> None:
    records = loop()
    records[0].role, records[0].role_reason = "auxiliary", "claude-code title"
    stats = build_session("s", records, SessionInfo("s", reward=1.0), eot_token_id=EOT).stats
    assert stats.mixed_role_chains == 1
    assert stats.roles == {"agent": 2, "auxiliary: claude-code title": 1}


def test_the_harness_is_the_sessions_else_the_first_call_that_names_one() -> None:
    records = loop()
    records[1].harness, records[2].harness = "claude-cli/2.1 (external, cli)", "codex"
    assert build_session("s", records, None, eot_token_id=EOT).harness == "claude-cli"
    assert build_session("s", records, SessionInfo("s", harness="pi"), eot_token_id=EOT).harness == "pi"
    assert build_session("s", loop(), None, eot_token_id=EOT).harness == "unknown"


def test_defaults_merge_prefix_chains_without_broadcast_or_bonus() -> None:
    records = loop(response_json=tool_answer(), finish_reason="tool_calls")
    session = SessionInfo("s", task_id="t", reward=1.0)
    merged = build_session("s", records, session, eot_token_id=EOT)
    # No tool-call bonus unless asked for.
    assert [(t.reward, t.calls_merged) for t in merged.traces] == [(1.0, 2), (1.0, 1)]
    # per_request: no reward without --broadcast-rewards.
    single = build_session("s", records, session, strategy="per_request", eot_token_id=EOT)
    assert {(t.reward, t.trainable) for t in single.traces} == {(0.0, False)}
    assert single.stats.reward_reasons == {"per-request trace without --broadcast-rewards": 3}
    via_iter = list(iter_session_builds(records, {"s": session}, "per_request", eot_token_id=EOT))
    assert [t.trainable for t in via_iter[0].traces] == [False, False, False]
    [built] = list(iter_session_builds(records, {"s": session}, eot_token_id=EOT))
    assert [t.reward for t in built.traces] == [1.0, 1.0]


def test_per_request_traces_carry_the_session_the_bonus_and_the_harness() -> None:
    records = loop(response_json=tool_answer(), finish_reason="tool_calls")
    session = SessionInfo("s", task_id="t", group_id="g", sample_index=0, harness="pi", reward=1.0)
    built = build_session(
        "s", records, session, strategy="per_request", eot_token_id=EOT, broadcast_rewards=True, tool_call_reward=0.5
    )
    assert [(t.trace_id, t.reward, t.trainable) for t in built.traces] == [
        ("s:r0", 1.5, True),
        ("s:r1", 1.0, True),
        ("s:r2", 1.0, True),
    ]
    assert {(t.task_id, t.group_id, t.sample_index, t.status, t.harness) for t in built.traces} == {
        ("t", "g", 0, "completed", "pi")
    }
    # Stats still come from the chain analysis.
    assert (built.stats.chains_total, built.stats.calls_merged, built.stats.traces) == (2, 1, 3)
    through = build_traces(records, [session], "per_request", broadcast_rewards=True, tool_call_reward=0.5)
    assert [t.reward for t in through.traces] == [1.5, 1.0, 1.0]


def test_iter_session_builds_passes_its_options_on() -> None:
    records = loop(response_json=tool_answer(), finish_reason="tool_calls")
    session = SessionInfo("s", reward=1.0)
    [built] = list(iter_session_builds(records, {"s": session}, eot_token_id=EOT, tool_call_reward=0.25))
    assert [t.reward for t in built.traces] == [1.25, 1.0]


def test_a_given_end_of_turn_token_is_used_as_given() -> None:
    # Detection would find EOT; the caller's token wins (and, being no stop here, merges nothing).
    built = list(iter_session_builds(loop("a") + loop("b"), {}, eot_token_id=99))
    assert [(b.session_id, b.eot_token_id) for b in built] == [("a", 99), ("b", 99)]
    result = build_traces(loop("a"), [], eot_token_id=99)
    assert result.eot_token_id == 99
    assert build_traces([], {}, eot_token_id=7).eot_token_id == 7
    assert build_traces([], {}).eot_token_id is None


def unconfirmed(session: str, stop: int) -> list[CaptureRecord]:
    """A session whose only natural stop token is in no prompt: it cannot confirm an end-of-turn token."""
    return [ok_call(session, 0, [5, 6], [7, stop])]


def test_sessions_wait_for_a_confirmed_end_of_turn_token_in_store_order() -> None:
    built = list(iter_session_builds(unconfirmed("a", 0) + loop("b") + unconfirmed("c", 3), {}))
    assert [(b.session_id, b.eot_token_id) for b in built] == [("a", EOT), ("b", EOT), ("c", EOT)]


def test_without_a_confirmed_token_the_fallback_then_the_first_unconfirmed_stop() -> None:
    records = unconfirmed("a", 0) + unconfirmed("c", 3)
    built = list(iter_session_builds(records, {}))
    assert [(b.session_id, b.eot_token_id) for b in built] == [("a", 0), ("c", 0)]
    assert [len(b.traces) for b in built] == [1, 1]
    fallback = list(iter_session_builds(records, {}, fallback_eot_token_id=42))
    assert [(b.session_id, b.eot_token_id) for b in fallback] == [("a", 42), ("c", 42)]
    # A fallback of 0 is a token id, not a missing one.
    zero = list(iter_session_builds(unconfirmed("c", 3), {}, fallback_eot_token_id=0))
    assert [b.eot_token_id for b in zero] == [0]
    # No stop at all: no token.
    capped = [ok_call("d", 0, [5], [6, 7], finish_reason="length")]
    assert [b.eot_token_id for b in iter_session_builds(capped, {})] == [None]
    assert build_traces(records, {}).eot_token_id == 0


def test_build_traces_reports_per_harness_and_reads_session_lists() -> None:
    pi = loop("a", harness="pi/1.0")
    codex = loop("b", harness="codex_cli_rs/0.1")
    result = build_traces(codex + pi, [SessionInfo("a", reward=1.0), SessionInfo("b", reward=0.0)])
    assert [t.trace_id for t in result.traces] == ["a:c0", "a:c1", "b:c0", "b:c1"]
    assert [t.reward for t in result.traces] == [1.0, 1.0, 0.0, 0.0]
    assert sorted(result.report.by_harness) == ["codex_cli_rs", "pi"]
    assert result.report.by_harness["pi"].sessions == 1 and result.report.total.sessions == 2
    assert result.eot_token_id == EOT


PIECES = {5: "<s>", 6: "Q", 9: "T", 10: "a", 11: "b", 12: "ab", 13: "c", EOT: "</t>"}


def pieces(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def test_a_retokenized_turn_is_merged_by_default() -> None:
    # The second prompt holds the first turn's text "ab" as one token, where the model sampled "a" "b".
    records = [ok_call("s", 0, [5, 6], [10, 11, EOT]), ok_call("s", 1, [5, 6, 12, EOT, 9], [13, EOT])]
    session = SessionInfo("s", reward=1.0)
    merged = build_session("s", records, session, eot_token_id=EOT, decode=pieces)
    assert [len(c.records) for c in merged.chains] == [2] and merged.stats.retokenized_merges == 1
    [built] = list(iter_session_builds(records, {"s": session}, eot_token_id=EOT, decode=pieces))
    assert built.stats.retokenized_merges == 1 and built.stats.chains_total == 1
    strict = build_session("s", records, session, eot_token_id=EOT, decode=pieces, merge_retokenized=False)
    assert strict.stats.breaks == {"retokenized": 1} and strict.stats.chains_truncated == 1
