"""Reward rules, per_request traces, the Parquet round trip, and the invariant checker itself."""

from __future__ import annotations

import math

import orjson
import pytest
from build_helpers import AgentSim, Turn, check_trace, coding_turns, decode, tool_loop

from polar_addon.capture import CaptureRecord
from polar_cli.build import SessionInfo, build_traces
from polar_cli.build.output import TraceWriter, read_build_stats, read_traces
from polar_cli.build.rewards import (
    RewardDecision,
    check_tool_call_reward,
    decide_reward,
    invalid_tool_call,
    parsed_tool_call,
    untrained_role,
)
from polar_cli.build.stats import BuildReport
from polar_cli.trace import Trace

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Make the tests pass."}


def _session(session_id: str = "s1", n: int = 4) -> AgentSim:
    sim = AgentSim(session_id)
    tool_loop(sim, [SYSTEM, TASK], coding_turns(n))
    return sim


@pytest.mark.parametrize(
    ("status", "reward", "expected"),
    [
        ("completed", 0.75, (0.75, True, "outcome reward")),
        ("completed", None, (0.0, False, "no outcome reward")),
        ("completed", math.nan, (0.0, False, "non-finite outcome reward")),
        ("timeout", 1.0, (0.0, True, "agent timeout")),
        ("agent_error", None, (0.0, True, "agent error")),
        ("error", 1.0, (0.0, False, "infrastructure failure")),
        ("running", None, (0.0, False, "session still running")),
    ],
)
def test_session_status_decides_reward_and_trainability(status: str, reward: float | None, expected: tuple) -> None:
    sim = _session()
    result = build_traces(sim.records, [SessionInfo("s1", status=status, reward=reward)], decode=decode)
    [trace] = result.traces
    assert (trace.reward, trace.trainable) == expected[:2]
    assert result.report.total.reward_reasons == {expected[2]: 1}
    check_trace(trace, {r.record_id: r for r in sim.records})
    if not trace.trainable:
        assert result.report.total.trainable_tokens == 0
    # the mask marks the sampled tokens whether RL may use the trace or not (issue 10 #8)
    assert sum(trace.loss_mask) == sum(len(r.response_ids) for r in sim.records)


def _call(content: str | None = "done", finish: str = "stop", calls: list | None = None) -> CaptureRecord:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return CaptureRecord(
        "r", "s1", 0, "openai_chat", "ok", finish_reason=finish, response_json=orjson.dumps(message).decode()
    )


BAD_CALL = _call('<function=bash>{"cmd": "ls"}</function>')
Info = SessionInfo  # short, for the table below
PER_REQUEST_UNTRAINED = RewardDecision(0.0, False, "per-request trace without --broadcast-rewards")


@pytest.mark.parametrize(
    ("session", "records", "per_request", "broadcast", "expected"),
    [
        (None, [], False, False, RewardDecision(0.0, False, "no session row")),
        (Info("s", status="error", reward=1.0), [], True, True, RewardDecision(0.0, False, "infrastructure failure")),
        (Info("s", status="running", reward=1.0), [], True, True, RewardDecision(0.0, False, "session still running")),
        (Info("s", status="timeout", reward=1.0), [], True, False, PER_REQUEST_UNTRAINED),
        (Info("s", reward=1.0), [], True, False, PER_REQUEST_UNTRAINED),
        (Info("s", status="timeout", reward=1.0), [BAD_CALL], True, True, RewardDecision(0.0, True, "agent timeout")),
        (Info("s", status="agent_error", reward=1.0), [], False, False, RewardDecision(0.0, True, "agent error")),
        (
            Info("s", status="crashed", reward=1.0),
            [],
            False,
            False,
            RewardDecision(0.0, False, "unknown session status 'crashed'"),
        ),
        (Info("s"), [], False, False, RewardDecision(0.0, False, "no outcome reward")),
        (Info("s", reward=math.inf), [], False, False, RewardDecision(0.0, False, "non-finite outcome reward")),
        (
            Info("s", reward=0.5),
            [_call(), BAD_CALL],
            False,
            False,
            RewardDecision(0.0, True, "parser-invalid tool call"),
        ),
        (Info("s", reward=0.5), [_call()], True, True, RewardDecision(0.5, True, "outcome reward")),
        (Info("s", reward=2), [_call()], False, False, RewardDecision(2.0, True, "outcome reward")),
    ],
)
def test_decide_reward_each_rule_in_precedence_order(
    session: Info | None, records: list, per_request: bool, broadcast: bool, expected: RewardDecision
) -> None:
    decision = decide_reward(session, records, per_request=per_request, broadcast=broadcast)
    assert decision == expected and type(decision.reward) is float


TOOL_CALL = _call(None, finish="tool_calls", calls=[{"name": "bash", "arguments": "{}"}])
SHAPED = "outcome reward + tool-call reward"


@pytest.mark.parametrize(
    ("session", "records", "per_request", "expected"),
    [
        (Info("s", reward=0.0), [_call(), TOOL_CALL], False, RewardDecision(0.25, True, SHAPED)),
        (Info("s", reward=1.0), [TOOL_CALL], False, RewardDecision(1.25, True, SHAPED)),
        (Info("s", reward=1.0), [TOOL_CALL], True, RewardDecision(1.25, True, SHAPED)),  # with --broadcast-rewards
        (Info("s", reward=0.5), [_call(), _call()], False, RewardDecision(0.5, True, "outcome reward")),
        # Policy failures and unrewarded or unusable sessions earn no bonus for the calls they made.
        (Info("s", status="timeout", reward=1.0), [TOOL_CALL], False, RewardDecision(0.0, True, "agent timeout")),
        (Info("s", status="agent_error"), [TOOL_CALL], False, RewardDecision(0.0, True, "agent error")),
        (Info("s", reward=1.0), [TOOL_CALL, BAD_CALL], False, RewardDecision(0.0, True, "parser-invalid tool call")),
        (Info("s"), [TOOL_CALL], False, RewardDecision(0.0, False, "no outcome reward")),
        (Info("s", status="error", reward=1), [TOOL_CALL], False, RewardDecision(0.0, False, "infrastructure failure")),
        (Info("s", reward=math.nan), [TOOL_CALL], False, RewardDecision(0.0, False, "non-finite outcome reward")),
        (None, [TOOL_CALL], False, RewardDecision(0.0, False, "no session row")),
    ],
)
def test_tool_call_reward_is_added_only_to_rewarded_traces_with_a_parsed_call(
    session: Info | None, records: list, per_request: bool, expected: RewardDecision
) -> None:
    decision = decide_reward(session, records, per_request=per_request, broadcast=True, tool_call_reward=0.25)
    assert decision == expected and type(decision.reward) is float
    # Off by default, and 0 is off: the plain outcome rules.
    for off in ({}, {"tool_call_reward": 0.0}):
        plain = decide_reward(session, records, per_request=per_request, broadcast=True, **off)
        assert plain.reason != SHAPED
        if expected.reason == SHAPED:
            assert plain == RewardDecision(expected.reward - 0.25, True, "outcome reward")


def test_parsed_tool_call_reads_the_parsers_answer_not_the_text() -> None:
    assert parsed_tool_call(TOOL_CALL)
    assert not parsed_tool_call(_call(None, finish="tool_calls", calls=[]))
    # What the agent writes as text is never a parsed call, however it looks.
    assert not parsed_tool_call(_call('{"name": "bash", "arguments": {"cmd": "ls"}}'))
    assert not parsed_tool_call(_call("<tool_call>\n{}\n</tool_call>"))
    assert not parsed_tool_call(CaptureRecord("r", "s1", 0, "openai_chat", "ok", finish_reason="stop"))


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, -math.inf])
def test_tool_call_reward_must_be_finite_and_not_negative(bad: float) -> None:
    with pytest.raises(ValueError, match="--tool-call-reward"):
        check_tool_call_reward(bad)
    assert check_tool_call_reward(0.0) == 0.0 and check_tool_call_reward(0.2) == 0.2


def test_tool_call_reward_through_the_build() -> None:
    """A merged tool loop (parsed calls) gets outcome + B; a session that never called a tool gets its outcome."""
    caller = _session("s1")
    talker = AgentSim("s2")
    tool_loop(talker, [SYSTEM, TASK], [Turn(content="I would run ls."), Turn(content="Done.")])
    info = [SessionInfo("s1", reward=0.0), SessionInfo("s2", reward=0.0)]
    result = build_traces(caller.records + talker.records, info, decode=decode, tool_call_reward=0.2)
    rewards = {t.session_id: (t.reward, t.trainable) for t in result.traces}
    assert rewards == {"s1": (0.2, True), "s2": (0.0, True)}
    assert result.report.total.reward_reasons == {SHAPED: 1, "outcome reward": 1}
    assert {t.session_id: t.reward for t in build_traces(caller.records + talker.records, info).traces} == {
        "s1": 0.0,
        "s2": 0.0,
    }


def test_an_untrained_role_keeps_its_reward_but_leaves_training() -> None:
    trained = RewardDecision(0.75, True, "outcome reward")
    assert untrained_role(trained, "agent", {"agent"}) is trained
    out = untrained_role(trained, "auxiliary", {"agent"})
    assert out == RewardDecision(0.75, False, "auxiliary calls not trained (--roles)") and out.trainable is False
    # Already untrained: its own reason stays (the first cause is the one reported).
    masked = RewardDecision(0.0, False, "infrastructure failure")
    assert untrained_role(masked, "auxiliary", {"agent"}) is masked


def test_invalid_tool_call_markers_and_empty_tool_calls_finish() -> None:
    assert invalid_tool_call(_call("<tool_call>\n{}\n</tool_call>")) and invalid_tool_call(BAD_CALL)
    assert invalid_tool_call(_call(None, finish="tool_calls", calls=[]))
    assert not invalid_tool_call(_call(None, finish="tool_calls", calls=[{"name": "bash", "arguments": "{}"}]))
    assert not invalid_tool_call(_call("I used the tool_call API."))
    assert not invalid_tool_call(_call(None))
    # part-list content is not searched (canonical content is a string)
    assert not invalid_tool_call(_call([{"type": "text", "text": "<tool_call>"}]))  # type: ignore[arg-type]
    no_message = CaptureRecord("r", "s1", 0, "openai_chat", "ok", finish_reason="stop")
    assert not invalid_tool_call(no_message)


def test_polar_parsed_turns_are_judged_by_their_parse_failures() -> None:
    """Where polar parsed the turn (parse_failures set) its count decides; the markup test only for engine-parsed
    ones."""
    prose = _call("Qwen3-Coder writes <function=f> here.")
    assert invalid_tool_call(prose)  # engine-parsed (null): markup in the text fails it
    prose.parse_failures = 0
    assert not invalid_tool_call(prose)  # polar's hermes parser read it as text
    clean_looking = _call("Done.")
    clean_looking.parse_failures = 1
    assert invalid_tool_call(clean_looking)
    # A tool_calls finish without a call is invalid whoever parsed it.
    empty = _call(None, finish="tool_calls", calls=[])
    empty.parse_failures = 0
    assert invalid_tool_call(empty)


def test_calls_without_a_session_row_are_not_trained() -> None:
    sim = _session()
    [trace] = build_traces(sim.records, []).traces
    assert not trace.trainable and trace.status == "unknown"


def test_parser_invalid_tool_call_gets_zero_reward_but_stays_trainable() -> None:
    sim = AgentSim()
    messages = [SYSTEM, TASK]
    broken = sim.call(messages, Turn(content='<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"\n</tool_call>'))
    assert invalid_tool_call(broken)
    messages = messages + [sim.sent_back(broken), {"role": "user", "content": "That tool call was malformed."}]
    tool_loop(sim, messages, coding_turns(2))
    result = build_traces(sim.records, [SessionInfo("s1", reward=1.0)], decode=decode)
    [trace] = result.traces
    assert trace.calls_merged == 3 and trace.reward == 0.0 and trace.trainable
    assert result.report.total.reward_reasons == {"parser-invalid tool call": 1}
    # A tool_calls finish with no parsed call is invalid too.
    broken.finish_reason = "tool_calls"
    broken.response_json = '{"content": null, "reasoning": null, "tool_calls": []}'
    assert invalid_tool_call(broken)
    assert not invalid_tool_call(sim.records[1])


def test_per_request_broadcast_needs_the_flag() -> None:
    sim = _session(n=5)
    info = [SessionInfo("s1", reward=1.0)]
    plain = build_traces(sim.records, info, "per_request")
    assert len(plain.traces) == 5 and not any(t.trainable for t in plain.traces)
    assert plain.report.total.reward_reasons == {"per-request trace without --broadcast-rewards": 5}
    broadcast = build_traces(sim.records, info, "per_request", broadcast_rewards=True)
    assert all(t.trainable and t.reward == 1.0 for t in broadcast.traces)
    by_id = {r.record_id: r for r in sim.records}
    for trace, record in zip(broadcast.traces, sim.records):
        check_trace(trace, by_id)
        assert trace.prompt_ids == record.prompt_ids and trace.completion_ids == record.response_ids
        assert trace.loss_mask == [1] * len(record.response_ids) and trace.calls_merged == 1
    # Same sampled tokens trained either way; per_request re-processes every shared prefix.
    merged = build_traces(sim.records, info, decode=decode)
    assert broadcast.report.total.trainable_tokens == merged.report.total.trainable_tokens
    assert broadcast.report.total.processed_tokens > 2 * merged.report.total.processed_tokens
    # Stats about merging come from the same chain analysis for both strategies.
    assert broadcast.report.total.chains_total == merged.report.total.chains_total == 1


def test_trace_metadata() -> None:
    sim = _session()
    sim.records[2].weight_version = "w1"
    info = SessionInfo("s1", task_id="task-7", group_id="g", sample_index=3, harness="codex", reward=1.0)
    [trace] = build_traces(sim.records, [info], decode=decode).traces
    assert (trace.task_id, trace.group_id, trace.sample_index, trace.harness) == ("task-7", "g", 3, "codex")
    assert trace.weight_versions == ["w0", "w1"] and trace.record_ids == [r.record_id for r in sim.records]
    assert trace.trace_id == "s1:c0" and trace.temperature == 1.0 and trace.status == "completed"


def test_parquet_round_trip(tmp_path) -> None:
    sims = [_session(f"s{i}") for i in range(5)]
    records = [r for s in sims for r in s.records]
    result = build_traces(records, [SessionInfo(f"s{i}", reward=float(i % 2)) for i in range(5)], decode=decode)
    writer = TraceWriter(tmp_path, rows_per_file=2)
    writer.write(result.traces)
    writer.close(result.report, {"strategy": "prefix_merging"})
    assert [p.name for p in writer.files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    back = read_traces(tmp_path)
    assert [t.trace_id for t in back] == [t.trace_id for t in result.traces]
    for a, b in zip(back, result.traces):
        assert a.completion_ids == b.completion_ids and a.loss_mask == b.loss_mask and a.reward == b.reward
        assert a.behavior_logprobs == pytest.approx(b.behavior_logprobs, abs=1e-6)
    stats = read_build_stats(tmp_path)
    assert stats["strategy"] == "prefix_merging" and stats["rows"] == 5
    assert BuildReport.from_dict(stats).to_dict() == result.report.to_dict()


def _corrupt(trace: Trace, **changes) -> Trace:
    data = trace.to_dict()
    data.update(changes)
    return Trace(**data)


def test_invariant_checker_catches_wrong_traces() -> None:
    """The invariants are only worth something if a wrong trace fails them."""
    sim = _session()
    by_id = {r.record_id: r for r in sim.records}
    [trace] = build_traces(sim.records, [SessionInfo("s1", reward=1.0)], decode=decode).traces
    check_trace(trace, by_id)
    a0 = len(sim.records[0].response_ids)
    ids, mask, lps = list(trace.completion_ids), list(trace.loss_mask), list(trace.behavior_logprobs)
    bad_token = ids[:]
    bad_token[1] = (bad_token[1] + 1) % 2000
    bad_lp = lps[:]
    bad_lp[0] -= 0.5
    bad_mask = mask[:]
    bad_mask[a0] = 1  # an interstitial token marked trainable
    bad_inter = ids[:]
    bad_inter[a0 + 2] = (bad_inter[a0 + 2] + 1) % 2000
    for wrong in (
        _corrupt(trace, completion_ids=bad_token),
        _corrupt(trace, behavior_logprobs=bad_lp),
        _corrupt(trace, loss_mask=bad_mask),
        _corrupt(trace, completion_ids=bad_inter),
        _corrupt(trace, record_ids=trace.record_ids[::-1]),
    ):
        with pytest.raises(AssertionError):
            check_trace(wrong, by_id)
