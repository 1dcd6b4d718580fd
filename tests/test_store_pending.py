"""Read commands see what the journal holds (a live writer's unsealed segment, a killed writer's segments),
read-only; and a path that holds no store is an error for every read command."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_addon.store import TraceStore, journal, read_records, read_sessions, validate_store
from polar_addon.store.compaction import SessionTips
from polar_addon.store.entries import call_entry
from polar_addon.store.shards import Output
from polar_addon.store.trace_store import segment_tables
from polar_cli.app import app
from tests.test_store_basic import Agent
from tests.test_store_crash import _call, _orphan_segment

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def _segments(store: Path) -> list[Path]:
    return sorted((store / "_journal").glob("w-*/*.wal"))


def test_a_live_writers_unsealed_calls_are_read_without_touching_its_journal(tmp_path: Path) -> None:
    rng = random.Random(3)

    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_records=1000, shard_max_seconds=600) as proxy:
            for i in range(2):
                agent = Agent(f"live-{i}", rng)
                await proxy.session_update(agent.session_id, harness="pi/0.73", status="running")
                for _ in range(3):
                    await proxy.append(agent.next_call())
            await proxy.add_reward("live-0", 1.0)
            segments = _segments(tmp_path)
            assert len(segments) == 1 and not list(tmp_path.glob("calls/*.parquet"))
            # What the CLI reads in another thread, while the proxy holds its journal.
            inspect = await asyncio.to_thread(
                runner.invoke, app, ["shards", "inspect", str(tmp_path)], env={"COLUMNS": "200"}
            )
            validate = await asyncio.to_thread(runner.invoke, app, ["shards", "validate", str(tmp_path)])
            records = await asyncio.to_thread(read_records, str(tmp_path))
            sessions = {s.session_id: s for s in await asyncio.to_thread(read_sessions, str(tmp_path))}
            assert inspect.exit_code == 0, inspect.output
            assert "live-0" in inspect.output and "live-1" in inspect.output
            assert validate.exit_code == 0, validate.output
            assert "valid: 6 calls (0 failed) in 2 sessions" in validate.output
            assert [(r.session_id, r.seq) for r in records] == [(f"live-{i}", s) for i in range(2) for s in range(3)]
            # Full records: the later calls' prompts extend the earlier ones token for token.
            assert records[2].prompt_ids[: len(records[1].prompt_ids)] == records[1].prompt_ids
            assert sessions["live-0"].reward == 1.0 and sessions["live-1"].harness == "pi/0.73"
            # Read-only: the segment is still the proxy's, and it keeps appending to it.
            assert _segments(tmp_path) == segments
            await proxy.append(Agent("live-2", rng).next_call())
            assert _segments(tmp_path) == segments

    asyncio.run(main())
    assert len(read_records(str(tmp_path))) == 7 and validate_store(str(tmp_path)) == []


def test_a_killed_writers_calls_are_read_before_any_restart(tmp_path: Path) -> None:
    code = (
        "import asyncio, os, signal, sys\n"
        "from polar_addon.store import TraceStore\n"
        "from tests.test_store_crash import _call\n"
        "async def main():\n"
        "    store = TraceStore(sys.argv[1], shard_max_seconds=600)\n"
        "    for i in range(4):\n"
        "        await store.append(_call('k', -1))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    segments = _segments(tmp_path)
    assert len(segments) == 1
    assert [r.seq for r in read_records(str(tmp_path))] == [0, 1, 2, 3]
    result = runner.invoke(app, ["shards", "validate", str(tmp_path)])
    assert result.exit_code == 0 and "valid: 4 calls" in result.output, result.output
    assert _segments(tmp_path) == segments  # left for the next writer to replay


def test_a_segment_already_in_shards_is_counted_once(tmp_path: Path) -> None:
    # A writer converted the segment's calls but had not deleted it yet (or a reader raced the conversion).
    entries = [call_entry(_call("s", i), i) for i in range(4)]
    segment = _orphan_segment(tmp_path / "_journal", entries)
    out = Output.from_uri(str(tmp_path))
    out.write_shard(
        "calls", journal.segment_name(str(segment)), segment_tables(entries, SessionTips().staged())["calls"]
    )
    assert [r.seq for r in read_records(str(tmp_path))] == [0, 1, 2, 3]
    assert validate_store(str(tmp_path)) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["shards", "inspect"],
        ["shards", "validate"],
        ["stats"],
        ["build", "-o", "{tmp}/traces"],
        ["view", "--session", "s", "-o", "{tmp}/t.html"],
    ],
)
def test_a_path_with_no_store_is_an_error(tmp_path: Path, argv: list[str]) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    (tmp_path / "empty").mkdir()
    for store, why in ((tmp_path / "nope", "does not exist"), (tmp_path / "empty", "holds none of")):
        result = runner.invoke(
            app,
            [*argv[: 1 if argv[0] != "shards" else 2], str(store), *argv[1 if argv[0] != "shards" else 2 :]],
            env={"COLUMNS": "300"},
        )
        assert result.exit_code == 2, result.output
        assert "no trace store" in result.output and why in result.output
    assert not (tmp_path / "traces").exists()


def test_train_on_a_path_with_no_store_is_an_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "empty").mkdir()
    for store, why in ((tmp_path / "nope", "does not exist"), (tmp_path / "empty", "no trace store")):
        result = runner.invoke(
            app,
            ["train", str(store), "--model", str(tiny_model_dir), "-o", str(tmp_path / "ckpt")],
            env={"COLUMNS": "300"},
        )
        assert result.exit_code == 2, result.output
        assert why in result.output and "nothing to train" not in result.output
    assert not (tmp_path / "ckpt").exists()
