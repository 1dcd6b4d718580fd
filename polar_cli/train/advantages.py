"""Trajectory-level GRPO advantages over stored traces (pure math, no torch).

The exchangeable unit of a GRPO group is the *session* (one run of the harness on a task), not the
trace: a session that fanned out into several traces (sub-agents, compaction, per_request calls)
must count once. So every session gets one reward (the mean of its trainable traces' rewards),
each session is compared with a leave-one-out baseline (the mean reward of the *other* sessions
of its group), and the group shares one scale (the sample std of its session rewards). Each
trace then keeps its *own* reward against its session's baseline: ``A_t = (r_t - b_s) / scale``.
Averaging first would let a chain penalised inside a good session (an invalid tool call forced to
reward 0) inherit the session's positive advantage and be reinforced. This follows Polar's Slime
bridge (``reward_post_process.py``), with one deliberate difference: a group with a single
session has no baseline at all, so its traces get advantage 0 rather than their raw reward.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from polar_cli.trace import Trace

SCALE_EPS = 1e-6


@dataclass(frozen=True)
class SessionAdvantage:
    group_id: str
    session_id: str
    reward: float  # mean reward of the session's trainable traces (its one vote in the group)
    advantage: float  # (reward - baseline) / scale: the session's own, as a whole
    num_traces: int  # trainable traces of the session
    baseline: float = 0.0  # mean reward of the group's other sessions
    scale: float = 1.0
    has_baseline: bool = False  # False: a lone session, or a group whose sessions all scored the same

    def of(self, trace_reward: float) -> float:
        """Advantage of one of the session's traces: its own reward against the session's baseline."""
        if not self.has_baseline:
            return 0.0
        return (trace_reward - self.baseline) / self.scale


def group_key(trace: Trace) -> str:
    """The GRPO group of a trace: its group id, else its task id, else (no grouping info) its session."""
    return trace.group_id or trace.task_id or f"session:{trace.session_id}"


def loo_advantages(rewards: list[float], scale_rewards: str = "group") -> list[float]:
    """Leave-one-out advantages of one group's per-session rewards.

    ``A_i = (r_i - mean_{j != i} r_j) / s`` with ``s = stdev(r) + 1e-6`` shared by the group
    (``scale_rewards="group"``) or ``s = 1`` (``"none"``). Identical rewards, or fewer than two
    sessions, give all zeros: there is no preference signal inside the group.
    """
    if scale_rewards not in ("group", "none"):
        raise ValueError(f"scale_rewards must be 'group' or 'none', not {scale_rewards!r}")
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    std = statistics.stdev(rewards)
    if std == 0.0:
        return [0.0] * n
    scale = std + SCALE_EPS if scale_rewards == "group" else 1.0
    total = math.fsum(rewards)
    return [(r - (total - r) / (n - 1)) / scale for r in rewards]


def session_advantages(traces: Iterable[Trace], scale_rewards: str = "group") -> dict[str, SessionAdvantage]:
    """Baseline, scale and advantage of every session with a trainable trace, keyed by session id.

    A trace's own advantage is ``session_advantages(...)[trace.session_id].of(trace.reward)``.

    Untrainable traces (infrastructure failures) neither train nor vote: a session made only of
    them is left out of its group's baseline, since its reward says nothing about the policy.
    """
    per_session: dict[str, list[Trace]] = {}
    session_group: dict[str, str] = {}
    for trace in traces:
        if not trace.trainable:
            continue
        key = group_key(trace)
        previous = session_group.setdefault(trace.session_id, key)
        if previous != key:
            raise ValueError(
                f"session {trace.session_id} has traces in two groups ({previous!r} and {key!r}); "
                "a session must belong to exactly one group"
            )
        per_session.setdefault(trace.session_id, []).append(trace)

    groups: dict[str, list[str]] = {}
    for session_id, key in session_group.items():
        groups.setdefault(key, []).append(session_id)

    out: dict[str, SessionAdvantage] = {}
    for key, session_ids in groups.items():
        session_ids.sort()
        rewards = [math.fsum(t.reward for t in per_session[s]) / len(per_session[s]) for s in session_ids]
        n, total = len(rewards), math.fsum(rewards)
        std = statistics.stdev(rewards) if n >= 2 else 0.0
        # Equal session rewards carry no preference between sessions, but the traces inside one
        # may still differ (a penalised chain): they are compared with the baseline unscaled.
        scale = std + SCALE_EPS if scale_rewards == "group" and std > 0.0 else 1.0
        for session_id, reward, advantage in zip(
            session_ids, rewards, loo_advantages(rewards, scale_rewards), strict=True
        ):
            out[session_id] = SessionAdvantage(
                group_id=key,
                session_id=session_id,
                reward=reward,
                advantage=advantage,
                num_traces=len(per_session[session_id]),
                baseline=(total - reward) / (n - 1) if n >= 2 else 0.0,
                scale=scale,
                has_baseline=n >= 2,
            )
    return out
