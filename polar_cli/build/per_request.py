"""per_request: one trace per call, the paper's lossless baseline (prompt = the call's prompt,
completion = its sampled ids, all sampled). Shared prefixes are trained once per call, so a
session of T calls costs O(T^2) tokens; ``bench/build.py`` measures the ratio to prefix merging.
Rewards follow ``rewards.decide_reward(per_request=True)``: none without ``--broadcast-rewards``."""

from __future__ import annotations

from polar_addon.capture import CaptureRecord
from polar_cli.build.rewards import RewardDecision, SessionInfo
from polar_cli.build.traces import make_trace
from polar_cli.trace import Trace


def per_request_trace(
    record: CaptureRecord, session: SessionInfo | None, harness: str, decision: RewardDecision, role: str
) -> Trace:
    n = len(record.response_ids)
    return make_trace(
        trace_id=f"{record.session_id}:r{record.seq}",
        session_id=record.session_id,
        session=session,
        harness=harness,
        chain_index=record.seq,
        records=[record],
        completion_ids=record.response_ids,
        loss_mask=[1] * n,
        logprobs=record.logprobs,
        decision=decision,
        break_cause=None,
        role=role,
    )
