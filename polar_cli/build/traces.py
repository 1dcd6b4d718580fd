"""Trace rows from merged chains or single calls, with the reward rules applied."""

from __future__ import annotations

import orjson

from polar_addon.capture import CaptureRecord
from polar_cli.build.rewards import RewardDecision, SessionInfo
from polar_cli.trace import Trace


def make_trace(
    *,
    trace_id: str,
    session_id: str,
    session: SessionInfo | None,
    harness: str,
    chain_index: int,
    records: list[CaptureRecord],
    completion_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float],
    decision: RewardDecision,
    break_cause: str | None,
    role: str,
) -> Trace:
    first = records[0]
    versions: list[str] = []
    for record in records:
        # A call sampled across a push (polar loop --drain keep) names every version in its spans, oldest first.
        spans = orjson.loads(record.weight_versions_json) if record.weight_versions_json else []
        for version in [record.weight_version, *(span["version"] for span in spans)]:
            if version is not None and version not in versions:
                versions.append(version)
    return Trace(
        trace_id=trace_id,
        session_id=session_id,
        prompt_ids=first.prompt_ids,
        completion_ids=completion_ids,
        # The mask always marks the sampled tokens (inspection and SFT-style use need it even when
        # RL may not use the trace); ``trainable`` alone says whether RL learns from it.
        loss_mask=loss_mask,
        behavior_logprobs=logprobs,
        task_id=session.task_id if session and session.task_id is not None else first.task_id,
        group_id=session.group_id if session and session.group_id is not None else first.group_id,
        sample_index=session.sample_index if session and session.sample_index is not None else first.sample_index,
        chain_index=chain_index,
        reward=decision.reward,
        trainable=decision.trainable,
        status=session.status if session else "unknown",
        calls_merged=len(records),
        record_ids=[r.record_id for r in records],
        temperature=1.0 if first.temperature is None else float(first.temperature),
        top_p=first.top_p,
        top_k=first.top_k,
        min_p=first.min_p,
        weight_versions=versions,
        harness=harness,
        break_cause=break_cause,
        role=role,
    )
