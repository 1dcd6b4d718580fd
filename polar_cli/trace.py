"""The training unit: one trace = a prompt plus a completion stream with a per-token loss mask.

``completion_ids`` interleaves sampled tokens (loss_mask 1, the engine's logprob) and
interstitial tokens taken from the next call's canonical prompt (loss_mask 0, placeholder
logprob 0.0). Built by ``polar_cli.build``; consumed by ``polar_cli.train``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

TRACE_SCHEMA = pa.schema(
    [
        ("trace_id", pa.string()),
        ("session_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_index", pa.int64()),
        ("chain_index", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("trainable", pa.bool_()),
        ("status", pa.string()),
        ("calls_merged", pa.int32()),
        ("record_ids", pa.list_(pa.string())),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int64()),
        ("min_p", pa.float64()),
        ("weight_versions", pa.list_(pa.string())),
        ("harness", pa.string()),
        ("break_cause", pa.string()),
        ("role", pa.string()),
    ]
)


@dataclass
class Trace:
    trace_id: str
    session_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    task_id: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    chain_index: int = 0
    reward: float = 0.0
    # False for infrastructure failures: the whole trace is masked out of the loss.
    trainable: bool = True
    status: str = "completed"
    calls_merged: int = 1
    record_ids: list[str] = field(default_factory=list)
    temperature: float = 1.0
    # The truncation the engine sampled with (None: not recorded, captured before polar filled it in).
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    weight_versions: list[str] = field(default_factory=list)
    harness: str | None = None
    # Why the chain this trace came from ended before the session did (None: it did not).
    break_cause: str | None = None
    # What the calls it came from were for (polar_addon.call_roles): agent, auxiliary or discarded; None: a
    # dataset built before roles.
    role: str | None = "agent"

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"trace {self.trace_id}: completion_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"behavior_logprobs ({len(self.behavior_logprobs)}) must have the same length"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def truncated_sampling(self) -> bool:
        """Sampled from a top-p / top-k / min-p truncated distribution, which the trainer cannot recompute."""
        return (
            (self.top_p is not None and self.top_p < 1)
            or bool(self.top_k and self.top_k > 0)
            or bool(self.min_p and self.min_p > 0)
        )


def traces_to_table(traces: list[Trace]) -> pa.Table:
    return pa.Table.from_pylist([t.to_dict() for t in traces], schema=TRACE_SCHEMA)


# Columns added after the first trace datasets were written; older datasets read them as null.
LATER_TRACE_COLUMNS = ("top_p", "top_k", "min_p", "role")


def table_to_traces(table: pa.Table) -> list[Trace]:
    return [Trace(**row) for row in table.to_pylist()]
