"""The trace dataset on disk (`polar_cli.build.output`) and the trace row itself (`polar_cli.trace`): what a build
writes is what training reads, whole and in order, split into parts no reader sees half-written, and a trace whose
sampling was truncated is known to be one (the trainer cannot recompute its logprobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_cli.build.output import STATS_FILE, TraceWriter, read_build_stats, read_traces
from polar_cli.build.stats import BuildReport
from polar_cli.trace import TRACE_SCHEMA, Trace, table_to_traces, traces_to_table


def _trace(i: int, **kw: object) -> Trace:
    fields: dict[str, object] = dict(
        trace_id=f"t{i}", session_id=f"s{i}", prompt_ids=[1, i], completion_ids=[7, 8, 9], loss_mask=[1, 0, 1],
        behavior_logprobs=[-0.5, 0.0, -1.25], task_id="task", group_id="g", sample_index=i, chain_index=2,
        reward=0.75, trainable=i % 2 == 0, status="completed", calls_merged=2, record_ids=["r1", "r2"],
        temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, weight_versions=["3", "4"], harness="codex",
        break_cause="compaction", role="agent",
    )  # fmt: skip
    return Trace(**(fields | kw))  # type: ignore[arg-type]


def test_a_trace_refuses_arrays_of_different_lengths() -> None:
    with pytest.raises(ValueError) as refused:
        Trace("t", "s", [1], [1, 2], [1], [-0.5, -0.5])
    assert str(refused.value) == (
        "trace t: completion_ids (2), loss_mask (1) and behavior_logprobs (2) must have the same length"
    )
    with pytest.raises(ValueError, match=r"behavior_logprobs \(1\)"):
        Trace("t", "s", [1], [1, 2], [1, 1], [-0.5])
    Trace("t", "s", [], [], [], [])  # an empty completion is consistent


@pytest.mark.parametrize(
    ("sampling", "truncated"),
    [
        ({}, False),
        ({"top_p": 1.0, "top_k": -1, "min_p": 0.0}, False),
        ({"top_k": 0}, False),
        ({"top_p": 0.999}, True),
        ({"top_k": 1}, True),
        ({"min_p": 1e-6}, True),
        ({"top_p": 1.0, "top_k": 20}, True),
        ({"top_p": 0.8, "top_k": -1, "min_p": 0.0}, True),
    ],
)
def test_truncated_sampling(sampling: dict, truncated: bool) -> None:
    assert Trace("t", "s", [1], [2], [1], [-0.1], **sampling).truncated_sampling is truncated


def test_the_table_round_trips_every_field() -> None:
    traces = [_trace(0), _trace(1, top_p=None, top_k=None, min_p=None, role=None, break_cause=None)]
    table = traces_to_table(traces)
    assert table.schema == TRACE_SCHEMA
    back = table_to_traces(table)
    assert back == traces  # the float32 logprobs above are exact in float32


def test_parts_of_rows_per_file_then_the_rest(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "out", rows_per_file=2)
    writer.write([_trace(0)])
    assert writer.files == []  # under a part's worth: buffered
    writer.write([_trace(1), _trace(2), _trace(3), _trace(4)])
    assert [p.name for p in writer.files] == ["part-00000.parquet", "part-00001.parquet"]
    report = BuildReport()
    writer.close(report, {"mode": "prefix_merge", "store": "S"})
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        STATS_FILE, "part-00000.parquet", "part-00001.parquet", "part-00002.parquet",
    ]  # fmt: skip
    assert [pq.read_table(out / f"part-0000{i}.parquet").num_rows for i in range(3)] == [2, 2, 1]
    assert [t.trace_id for t in read_traces(out)] == ["t0", "t1", "t2", "t3", "t4"]
    assert read_traces(out) == [_trace(i) for i in range(5)]
    stats = read_build_stats(out)
    assert stats == {
        "mode": "prefix_merge", "store": "S", "files": ["part-00000.parquet", "part-00001.parquet",
        "part-00002.parquet"], "rows": 5, **report.to_dict(),
    }  # fmt: skip
    assert (out / STATS_FILE).read_text() == json.dumps(stats, indent=2)  # people read it too
    assert pq.ParquetFile(out / "part-00000.parquet").metadata.row_group(0).column(0).compression == "ZSTD"


def test_exactly_a_part_leaves_no_empty_part_and_an_empty_build_one_readable_part(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "new" / "parents" / "full", rows_per_file=2)  # made with its parents
    writer.write([_trace(0), _trace(1)])
    assert [p.name for p in writer.files] == ["part-00000.parquet"]  # a full part is written at once
    writer.close(BuildReport(), {})
    assert [p.name for p in writer.files] == ["part-00000.parquet"] and writer.rows == 2
    empty = TraceWriter(tmp_path / "empty")
    empty.close(BuildReport(), {})
    assert [p.name for p in empty.files] == ["part-00000.parquet"] and empty.rows == 0
    assert read_traces(tmp_path / "empty") == []
    assert pq.read_table(tmp_path / "empty" / "part-00000.parquet").schema == TRACE_SCHEMA
    assert read_build_stats(tmp_path / "empty")["files"] == ["part-00000.parquet"]


def test_a_part_holds_1024_rows_by_default(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path)
    writer.write([_trace(i) for i in range(1023)])
    assert writer.files == []
    writer.write([_trace(1023)])
    assert len(writer.files) == 1 and writer.rows == 1024


def test_no_temporary_file_is_left_and_parts_are_read_in_order(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, rows_per_file=1)
    writer.write([_trace(i) for i in range(12)])
    writer.close(BuildReport(), {})
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # part-00010 sorts after part-00009: the number is zero-padded
    assert [t.trace_id for t in read_traces(tmp_path)] == [f"t{i}" for i in range(12)]
    assert writer.files[10].name == "part-00010.parquet"
