"""polar's training rows -> TRL's ``RolloutSample``: pure, no trainer, no engine.

A sample is one row of ``polar train``'s own dataset (``prepare_rows``: the same traces, advantages, masks and
length clipping), laid out as TRL's async trainer reads it: ``input_ids`` = prompt + completion, and per position
``completion_mask`` (1 where the engine sampled the token and the build trains it) and ``old_log_probs`` (the
engine's logprob of that token, 0 elsewhere, as TRL's own worker zero-fills context). TRL's packer takes
``old_log_probs[p]`` as the behaviour logprob of ``input_ids[p]``, so nothing is shifted here.

The sample's ``model_version`` is not what the worker believes it served but what the calls record: the oldest
``weight_version`` among the trace's calls (the most stale token decides whether TRL's staleness bound drops it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from polar_cli.rollout.async_loop import oldest_version
from polar_cli.trace import Trace
from polar_cli.train.dataset import TrainRow


class UntaggedCall(ValueError):
    """A trace holds a call with no numeric ``weight_version``: its staleness cannot be bounded."""


def trace_version(trace: Trace) -> int:
    """The oldest weight version among the trace's calls."""
    oldest = oldest_version(trace.weight_versions)
    if oldest is None:
        raise UntaggedCall(
            f"trace {trace.trace_id} (session {trace.session_id}) has calls without a numeric weight_version "
            f"({trace.weight_versions!r}): serve the policy through a spec with ?weight_version=V"
        )
    return oldest


def row_sample(
    row: TrainRow,
    *,
    model_version: int,
    group_id: int,
    decode: Callable[[Sequence[int]], str] | None = None,
    enqueued_at: float | None = None,
) -> RolloutSample:
    """One TRL sample of one training row."""
    n_prompt = len(row.prompt_ids)
    ids = np.asarray([*row.prompt_ids, *row.completion_ids], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.int64)
    mask[n_prompt:] = row.loss_mask
    logprobs = np.zeros(len(ids), dtype=np.float32)
    # Context inside the completion (tool results merged into the chain) carries no behaviour logprob to train on.
    logprobs[n_prompt:] = np.where(mask[n_prompt:] == 1, np.asarray(row.behavior_logprobs, dtype=np.float32), 0.0)
    prompt: list[dict[str, Any]] = []
    completion: list[dict[str, Any]] = []
    if decode is not None:  # for TRL's trace logging only; the trainer reads the ids
        prompt = [{"role": "user", "content": decode(row.prompt_ids)}]
        completion = [{"role": "assistant", "content": decode(row.completion_ids)}]
    return RolloutSample(
        prompt=prompt,
        completion=completion,
        input_ids=ids,
        completion_mask=mask,
        old_log_probs=logprobs,
        advantage=float(row.advantage),
        model_version=model_version,
        group_id=group_id,
        metrics={"reward": float(row.session_reward)},
        enqueued_at=enqueued_at,
    )


def rows_to_samples(
    rows: Sequence[TrainRow],
    traces: Mapping[str, Trace],
    group_ids: dict[str, int],
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> list[RolloutSample]:
    """Every row as a sample, a group's rows together (TRL packs a group's shared prefix once). ``traces``: by trace
    id, for the versions; ``group_ids``: polar group key -> TRL's int group id, extended here for new groups so ids
    stay unique across batches."""
    now = time.time()
    samples = []
    for row in sorted(rows, key=lambda r: r.group_id):
        gid = group_ids.setdefault(row.group_id, len(group_ids))
        version = trace_version(traces[row.trace_id])
        samples.append(row_sample(row, model_version=version, group_id=gid, decode=decode, enqueued_at=now))
    return samples
