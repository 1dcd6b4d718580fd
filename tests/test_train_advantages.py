"""Trajectory-level advantages: hand-computed cases (pure, no torch)."""

from __future__ import annotations

import math
import statistics

import pytest

from polar_cli.trace import Trace
from polar_cli.train.advantages import SCALE_EPS, loo_advantages, session_advantages


def trace(session: str, group: str | None, reward: float, idx: int = 0, trainable: bool = True, task=None) -> Trace:
    return Trace(
        trace_id=f"{session}-{idx}",
        session_id=session,
        group_id=group,
        task_id=task,
        prompt_ids=[1, 2],
        completion_ids=[3],
        loss_mask=[1],
        behavior_logprobs=[-0.5],
        reward=reward,
        trainable=trainable,
        chain_index=idx,
    )


def test_loo_binary_group_by_hand() -> None:
    # rewards 1,0,0,0: baselines 0, 1/3, 1/3, 1/3; sample std of [1,0,0,0] = 0.5
    adv = loo_advantages([1.0, 0.0, 0.0, 0.0])
    s = 0.5 + SCALE_EPS
    assert adv == pytest.approx([1.0 / s, (0 - 1 / 3) / s, (0 - 1 / 3) / s, (0 - 1 / 3) / s], rel=1e-12)


def test_loo_graded_group_by_hand() -> None:
    rewards = [0.5, 0.0, 1.0, 0.25]
    s = statistics.stdev(rewards) + SCALE_EPS  # 0.4269...
    expected = [
        (0.5 - (0.0 + 1.0 + 0.25) / 3) / s,
        (0.0 - (0.5 + 1.0 + 0.25) / 3) / s,
        (1.0 - (0.5 + 0.0 + 0.25) / 3) / s,
        (0.25 - (0.5 + 0.0 + 1.0) / 3) / s,
    ]
    assert loo_advantages(rewards) == pytest.approx(expected, rel=1e-12)
    assert loo_advantages(rewards, "none") == pytest.approx([e * s for e in expected], rel=1e-12)
    # LOO advantages of a group always sum to zero: the baseline is unbiased within the group.
    assert math.fsum(loo_advantages(rewards)) == pytest.approx(0.0, abs=1e-12)


def test_identical_rewards_and_singletons_give_zero() -> None:
    assert loo_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert loo_advantages([0.0, 0.0]) == [0.0, 0.0]
    assert loo_advantages([1.0]) == [0.0]
    assert loo_advantages([]) == []
    with pytest.raises(ValueError):
        loo_advantages([1.0, 0.0], "batch")


def test_session_with_two_traces_counts_once() -> None:
    # Session a fans out into two traces; counted per trace, the group mean would be 2/3 and the
    # std different. Counted per session: rewards [1, 0] -> advantages +-1/(std + eps).
    traces = [trace("a", "g", 1.0, 0), trace("a", "g", 1.0, 1), trace("b", "g", 0.0)]
    adv = session_advantages(traces)
    s = statistics.stdev([1.0, 0.0]) + SCALE_EPS
    assert adv["a"].advantage == pytest.approx(1.0 / s)
    assert adv["b"].advantage == pytest.approx(-1.0 / s)
    assert adv["a"].num_traces == 2 and adv["b"].num_traces == 1
    # the per-trace view would have been biased: baseline for b = mean(1, 1) = 1 with std of [1,1,0]
    per_trace = loo_advantages([1.0, 1.0, 0.0])
    assert per_trace[2] != pytest.approx(adv["b"].advantage)


def test_session_reward_is_mean_of_its_trainable_traces() -> None:
    traces = [
        trace("a", "g", 1.0, 0),
        trace("a", "g", 0.0, 1),  # e.g. a parser-invalid sub-agent trace forced to 0
        trace("a", "g", 1.0, 2, trainable=False),  # infrastructure failure: does not vote
        trace("b", "g", 0.0),
        trace("c", "g", 1.0),
    ]
    adv = session_advantages(traces)
    assert adv["a"].reward == pytest.approx(0.5)
    rewards = [0.5, 0.0, 1.0]
    assert [adv[s].advantage for s in "abc"] == pytest.approx(loo_advantages(rewards))


def test_untrainable_sessions_leave_the_baseline() -> None:
    traces = [trace("a", "g", 1.0), trace("b", "g", 0.0), trace("c", "g", 0.0, trainable=False)]
    adv = session_advantages(traces)
    assert set(adv) == {"a", "b"}
    assert adv["a"].advantage == pytest.approx(loo_advantages([1.0, 0.0])[0])


def test_groups_fall_back_to_task_then_session() -> None:
    traces = [
        trace("a", None, 1.0, task="t1"),
        trace("b", None, 0.0, task="t1"),
        trace("c", None, 1.0),  # no group, no task: its own group, so no signal
    ]
    adv = session_advantages(traces)
    assert adv["a"].group_id == adv["b"].group_id == "t1"
    assert adv["a"].advantage > 0 > adv["b"].advantage
    assert adv["c"].advantage == 0.0


def test_session_in_two_groups_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        session_advantages([trace("a", "g1", 1.0, 0), trace("a", "g2", 1.0, 1)])
    assert (
        str(err.value)
        == "session a has traces in two groups ('g1' and 'g2'); a session must belong to exactly one group"
    )


def test_penalised_chain_keeps_its_own_reward() -> None:
    """Issue 10 #6: session a has a valid chain (1) and an invalid one (0); b scored 0.

    Averaged first, both of a's chains would get (0.5 - 0) / stdev([0.5, 0]) = +1.414, reinforcing
    the invalid call. Each trace against a's baseline (b's reward 0), with the group's session scale.
    """
    traces = [trace("a", "g", 1.0, 0), trace("a", "g", 0.0, 1), trace("b", "g", 0.0)]
    adv = session_advantages(traces)
    s = statistics.stdev([0.5, 0.0]) + SCALE_EPS
    assert adv["a"].of(1.0) == pytest.approx((1.0 - 0.0) / s, rel=1e-12)  # 2.828
    assert adv["a"].of(0.0) == pytest.approx(0.0, abs=1e-12)  # not +1.414
    assert adv["b"].of(0.0) == pytest.approx((0.0 - 0.5) / s, rel=1e-12)
    # the session still votes once: b's baseline is a's mean reward, not the mean of a's chains and b
    assert adv["b"].baseline == pytest.approx(0.5)


def test_penalised_chain_gets_a_negative_advantage_in_rows() -> None:
    from polar_cli.train.dataset import prepare_rows

    traces = [trace("a", "g", 1.0, 0), trace("a", "g", 0.0, 1), trace("b", "g", 1.0), trace("c", "g", 0.0)]
    for t in traces:
        t.temperature = 1.0
    rows = {r.trace_id: r for r in prepare_rows(traces, max_length=64, drop_zero_advantage=False).rows}
    session_rewards = [0.5, 1.0, 0.0]
    s = statistics.stdev(session_rewards) + SCALE_EPS  # 0.5 + eps
    baseline_a = (1.0 + 0.0) / 2
    assert rows["a-0"].advantage == pytest.approx((1.0 - baseline_a) / s, rel=1e-12)
    assert rows["a-1"].advantage == pytest.approx((0.0 - baseline_a) / s, rel=1e-12)
    assert rows["b-0"].advantage == pytest.approx((1.0 - 0.25) / s, rel=1e-12)
    assert rows["c-0"].advantage == pytest.approx((0.0 - 0.75) / s, rel=1e-12)
    assert rows["a-0"].session_weight == rows["a-1"].session_weight == 0.5


def test_equal_session_rewards_still_rank_a_sessions_chains() -> None:
    # Both sessions average 0.5: no preference between them, but a's invalid chain is still below
    # the baseline (unscaled, since the session std is 0).
    traces = [trace("a", "g", 1.0, 0), trace("a", "g", 0.0, 1), trace("b", "g", 0.5)]
    adv = session_advantages(traces)
    assert adv["a"].advantage == 0.0 and adv["b"].of(0.5) == 0.0
    assert adv["a"].of(1.0) == pytest.approx(0.5) and adv["a"].of(0.0) == pytest.approx(-0.5)
    # a lone session has no baseline at all
    assert session_advantages([trace("z", "solo", 1.0, 0), trace("z", "solo", 0.0, 1)])["z"].of(0.0) == 0.0


def test_group_id_takes_precedence_over_task_id() -> None:
    """Two tasks sampled inside one explicit group form one GRPO group; one task split over two
    groups forms two. Computed values: rewards [1, 0] in one group give +-1/(std + eps)."""
    traces = [
        trace("a", "g", 1.0, task="t1"),
        trace("b", "g", 0.0, task="t2"),
        trace("c", "h", 1.0, task="t1"),
    ]
    adv = session_advantages(traces)
    assert (adv["a"].group_id, adv["b"].group_id, adv["c"].group_id) == ("g", "g", "h")
    scale = statistics.stdev([1.0, 0.0]) + SCALE_EPS
    assert adv["a"].advantage == pytest.approx(1.0 / scale)
    assert adv["b"].advantage == pytest.approx(-1.0 / scale)
    assert adv["c"].advantage == 0.0  # alone in group h


def test_values_by_hand_with_a_unit_std_and_without_scaling() -> None:
    """Rewards 0, 1, 2 have a sample std of exactly 1 (not a degenerate group); unscaled advantages
    are the raw leave-one-out differences."""
    traces = [trace("a", "g", 0.0), trace("b", "g", 1.0), trace("c", "g", 2.0)]
    scaled = session_advantages(traces)
    assert [scaled[s].advantage for s in "abc"] == pytest.approx([-1.5 / (1 + SCALE_EPS), 0.0, 1.5 / (1 + SCALE_EPS)])
    raw = session_advantages(traces, scale_rewards="none")
    # Exact: the group's scale is 1 without scaling, not 1 + SCALE_EPS (approx's rel 1e-6 would not tell them apart).
    assert [raw[s].advantage for s in "abc"] == [-1.5, 0.0, 1.5]
    assert [(raw[s].session_id, raw[s].group_id, raw[s].reward, raw[s].num_traces) for s in "abc"] == [
        ("a", "g", 0.0, 1),
        ("b", "g", 1.0, 1),
        ("c", "g", 2.0, 1),
    ]
    with pytest.raises(ValueError, match="scale_rewards must be 'group' or 'none', not 'batch'"):
        loo_advantages([0.0, 1.0], scale_rewards="batch")


def test_a_lone_session_has_no_baseline_and_a_unit_scale() -> None:
    solo = session_advantages([trace("z", "solo", 0.7)])["z"]
    assert (solo.baseline, solo.scale, solo.has_baseline, solo.advantage) == (0.0, 1.0, False, 0.0)
