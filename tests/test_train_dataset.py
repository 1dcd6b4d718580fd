"""Traces -> training rows: temperature check, causal-prefix clipping, filtering, partitions (pure)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_cli.trace import Trace, traces_to_table
from polar_cli.train.dataset import (
    TemperatureMismatch,
    clip_to_length,
    is_trace_dataset,
    partition_rows,
    prepare_rows,
    read_trace_dataset,
    resolve_temperature,
)


def trace(session: str, group: str, reward: float, *, prompt=(1, 2, 3), n=4, mask=None, t=1.0, trainable=True):
    mask = list(mask) if mask is not None else [1] * n
    return Trace(
        trace_id=f"{session}-t",
        session_id=session,
        group_id=group,
        prompt_ids=list(prompt),
        completion_ids=list(range(10, 10 + len(mask))),
        loss_mask=mask,
        behavior_logprobs=[-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)],
        reward=reward,
        temperature=t,
        trainable=trainable,
    )


def test_temperature_is_read_from_traces_and_mismatch_refused() -> None:
    traces = [trace("a", "g", 1.0, t=0.7), trace("b", "g", 0.0, t=0.7)]
    assert resolve_temperature(traces, None) == 0.7
    assert resolve_temperature(traces, 0.7) == 0.7
    with pytest.raises(TemperatureMismatch, match="differs from the capture temperature 0.7"):
        resolve_temperature(traces, 1.0)
    with pytest.raises(TemperatureMismatch, match="several temperatures"):
        resolve_temperature(traces + [trace("c", "g", 1.0, t=1.0)], None)
    with pytest.raises(TemperatureMismatch, match="greedily"):
        resolve_temperature([trace("a", "g", 1.0, t=0.0)], None)
    # untrainable traces do not vote on the temperature
    assert resolve_temperature(traces + [trace("c", "g", 1.0, t=1.0, trainable=False)], None) == 0.7


def test_overlong_completion_is_clipped_as_causal_prefix_prompt_untouched() -> None:
    t = trace("a", "g", 1.0, prompt=(1, 2, 3, 4), mask=[1, 1, 0, 0, 1, 1])
    ids, mask, lps, clipped = clip_to_length(t, 7)
    assert clipped
    assert ids == t.completion_ids[:3] and mask == [1, 1, 0] and lps == t.behavior_logprobs[:3]
    assert clip_to_length(t, 10)[3] is False
    assert clip_to_length(t, 4) is None  # the prompt alone fills max_length: never left-trimmed

    data = prepare_rows(
        [t, trace("b", "g", 0.0, prompt=tuple(range(50)))], max_length=7, drop_zero_advantage=False
    )
    assert data.stats["overlong_prompt"] == 1 and data.stats["clipped"] == 1
    (row,) = data.rows
    assert row.prompt_ids == [1, 2, 3, 4] and len(row.completion_ids) == 3 and row.clipped


def test_rows_drop_untrainable_maskless_and_zero_advantage() -> None:
    traces = [
        trace("a", "g", 1.0),
        trace("b", "g", 0.0),
        trace("c", "g", 0.0, trainable=False),
        trace("d", "g", 1.0, mask=[0, 0, 0]),  # no trainable token: nothing to learn from it
        trace("e", "h", 1.0),
        trace("f", "h", 1.0),  # group h: identical rewards
    ]
    data = prepare_rows(traces, max_length=100)
    assert {r.session_id for r in data.rows} == {"a", "b"}
    assert data.stats["untrainable"] == 1
    assert data.stats["no_trainable_tokens"] == 1
    assert data.stats["zero_advantage"] == 2
    kept = prepare_rows(traces, max_length=100, drop_zero_advantage=False)
    assert {r.session_id for r in kept.rows} == {"a", "b", "e", "f"}
    assert [kept.group_keys[i] for i in range(len(kept.groups))] == ["g", "h"]
    assert all(kept.rows[i].advantage == 0.0 for i in kept.groups[1])


def test_session_weights_count_each_session_once() -> None:
    a1, a2 = trace("a", "g", 1.0), trace("a", "g", 1.0)
    a2.trace_id = "a-t2"
    data = prepare_rows([a1, a2, trace("b", "g", 0.0)], max_length=100)
    assert sum(r.session_weight for r in data.rows) == pytest.approx(2.0)
    # Computed, not compared row with row: session rewards a=1, b=0, LOO over std(1, 0) + 1e-6.
    expected = 1.0 / (statistics.stdev([1.0, 0.0]) + 1e-6)
    by_session = {}
    for row in data.rows:
        by_session.setdefault(row.session_id, []).append((row.advantage, row.session_weight))
    assert by_session["a"] == [(pytest.approx(expected), pytest.approx(0.5))] * 2
    assert by_session["b"] == [(pytest.approx(-expected), pytest.approx(1.0))]


def test_missing_behaviour_logprob_on_a_trainable_token_is_refused() -> None:
    bad = trace("a", "g", 1.0)
    bad.behavior_logprobs[1] = float("nan")
    with pytest.raises(ValueError, match="trainable token 1"):
        prepare_rows([bad, trace("b", "g", 0.0)], max_length=100)


def test_partition_is_deterministic_and_balanced() -> None:
    lengths = [50, 10, 40, 30, 20, 5]
    bins = partition_rows(lengths, 2)
    assert bins == partition_rows(lengths, 2)
    assert sorted(i for b in bins for i in b) == list(range(6))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert abs(loads[0] - loads[1]) <= 5
    assert sorted(len(b) for b in partition_rows(lengths, 4)) == [1, 1, 2, 2]  # at most ceil(6/4) each
    assert partition_rows([7], 3) == [[0], [], []]


def test_trace_dataset_round_trip_and_detection(tmp_path: Path) -> None:
    traces = [trace("a", "g", 1.0), trace("b", "g", 0.0)]
    pq.write_table(traces_to_table(traces), tmp_path / "traces.parquet")
    assert is_trace_dataset([tmp_path])
    assert [t.session_id for t in read_trace_dataset([tmp_path])] == ["a", "b"]
    import pyarrow as pa

    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"record_id": ["x"], "prompt_ids": [[1]]}), raw / "calls.parquet")
    assert not is_trace_dataset([raw])
    with pytest.raises(ValueError, match="mix"):
        is_trace_dataset([tmp_path / "traces.parquet", raw / "calls.parquet"])
