"""Traces keep the truncation their calls were sampled with; training refuses truncated sampling, whose
behaviour policy is not the full softmax the trainer recomputes; old trace datasets still load."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_cli.build import SessionInfo, build_traces
from polar_cli.trace import traces_to_table
from polar_cli.train.dataset import TruncatedSampling, prepare_rows, read_trace_dataset
from tests.build_helpers import AgentSim, coding_turns, decode, tool_loop

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Make the tests pass."}


def _traces(sampling: dict, sessions: int = 2) -> list:
    records, infos = [], []
    for i in range(sessions):
        sim = AgentSim(f"s{i}")
        tool_loop(sim, [SYSTEM, TASK], coding_turns(2))
        for record in sim.records:
            for name, value in sampling.items():
                setattr(record, name, value)
        records += sim.records
        infos.append(SessionInfo(f"s{i}", group_id="g", reward=float(i)))
    return build_traces(records, infos, decode=decode).traces


def test_traces_carry_the_calls_sampling() -> None:
    [first, _] = _traces({"top_p": 0.95, "top_k": 20, "min_p": 0.0})
    assert (first.top_p, first.top_k, first.min_p) == (0.95, 20, 0.0)
    assert first.truncated_sampling


@pytest.mark.parametrize("sampling", [{"top_p": 0.95}, {"top_k": 20}, {"min_p": 0.05}])
def test_training_refuses_truncated_sampling_naming_count_and_fix(sampling: dict) -> None:
    traces = _traces({"top_p": 1.0, "top_k": 0, "min_p": 0.0} | sampling)
    with pytest.raises(TruncatedSampling) as err:
        prepare_rows(traces, max_length=4096)
    message = " ".join(str(err.value).split())
    assert message.startswith("2 trainable traces (of 2, 2 sessions) were sampled with truncation")
    assert "top_p=1, top_k=0 and min_p=0" in message


def test_untruncated_and_unrecorded_sampling_trains() -> None:
    assert prepare_rows(_traces({"top_p": 1.0, "top_k": 0, "min_p": 0.0}), max_length=4096).rows
    # Captures from before the proxy filled the parameters in (all null) are read as untruncated.
    assert prepare_rows(_traces({}), max_length=4096).rows


def test_a_dataset_written_before_the_sampling_columns_loads(tmp_path: Path) -> None:
    table = traces_to_table(_traces({"top_k": 20})).drop_columns(["top_p", "top_k", "min_p"])
    pq.write_table(table, tmp_path / "old.parquet")
    loaded = read_trace_dataset([tmp_path])
    assert len(loaded) == 2 and loaded[0].top_k is None and not loaded[0].truncated_sampling
