"""`polar reward`, `polar shards inspect` and `polar shards validate` (which must catch every broken invariant)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store import TraceStore, read_sessions
from polar_addon.store.shards import CALLS, REWARDS, SCHEMAS, Output
from polar_cli.app import app
from tests.support.store_rows import stored_row
from tests.test_store_basic import Agent, make_record

runner = CliRunner()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    rng = random.Random(11)

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as st:
            for i in range(3):
                agent = Agent(f"sess-{i}", rng)
                await st.session_update(
                    agent.session_id,
                    task_id="t",
                    group_id="g",
                    sample_index=i,
                    harness="claude-cli/2.1",
                    status="running",
                    started_at=1.0,
                )
                for _ in range(4):
                    await st.append(agent.next_call())
            await st.append(make_record("sess-0", [], [], [], status="failed"))
            await st.session_update("sess-1", status="completed")

    asyncio.run(main())
    return tmp_path


def test_reward_single_file_and_unknown(store: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["reward", str(store), "--session", "sess-1", "--value", "1.0"])
    assert result.exit_code == 0, result.output
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text(
        '{"session_id": "sess-0", "value": 0}\n\n{"session_id": "sess-2", "value": 0.5, "name": "tests"}\n'
    )
    result = runner.invoke(app, ["reward", str(store), "--file", str(rewards)])
    assert result.exit_code == 0, result.output
    assert "recorded 2 reward(s)" in result.output

    result = runner.invoke(app, ["reward", str(store), "--session", "typo", "--value", "1"])
    assert result.exit_code == 2 and "unknown session(s)" in result.output
    result = runner.invoke(app, ["reward", str(store), "--session", "new", "--value", "1", "--allow-unknown"])
    assert result.exit_code == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": "sess-0", "value": "high"}\n')
    result = runner.invoke(app, ["reward", str(store), "--file", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:1" in result.output
    result = runner.invoke(app, ["reward", str(store), "--session", "sess-0"])
    assert result.exit_code != 0

    sessions = {s.session_id: s for s in read_sessions(str(store))}
    assert sessions["sess-1"].rewards == {"reward": 1.0}
    assert sessions["sess-0"].rewards == {"reward": 0.0}
    assert sessions["sess-2"].rewards == {"tests": 0.5}
    assert sessions["sess-1"].reward_history[0].source == "cli"
    assert sessions["new"].reward == 1.0  # recorded with --allow-unknown; validate will flag it
    result = runner.invoke(app, ["shards", "validate", str(store)])
    assert result.exit_code == 1 and "unknown session new" in result.output


def test_reward_sees_sessions_still_in_a_live_writers_journal(tmp_path: Path) -> None:
    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_records=1000, shard_max_seconds=600) as proxy:
            await proxy.append(make_record("live", [1, 2], [3], []))
            result = await asyncio.to_thread(
                runner.invoke, app, ["reward", str(tmp_path), "--session", "live", "--value", "2"]
            )
            assert result.exit_code == 0, result.output

    asyncio.run(main())
    assert {s.session_id: s.reward for s in read_sessions(str(tmp_path))} == {"live": 2.0}


def test_inspect_and_validate_a_good_store(store: Path) -> None:
    runner.invoke(app, ["reward", str(store), "--session", "sess-1", "--value", "1.0"])
    result = runner.invoke(app, ["shards", "inspect", str(store)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.output
    for expected in (
        "sessions",
        "calls ok",
        "12",
        "calls failed",
        "test-agent/1.0",
        "completed",
        "running",
        "engine down",
        "sess-2",
        "t/g/2",
        "4/1",
    ):
        assert expected in out, expected
    result = runner.invoke(app, ["shards", "validate", str(store)])
    assert result.exit_code == 0, result.output
    assert "valid: 13 calls (1 failed) in 3 sessions" in result.output


def _rows(session_id: str, n: int, rng: random.Random) -> list[dict]:
    agent = Agent(session_id, rng)
    rows, tips = [], []
    for seq in range(n):
        row, tip = stored_row(agent.next_call(), seq, tips)
        rows.append(row)
        tips = [*tips, tip]
    return rows


def _write_calls(out: Output, name: str, rows: list[dict]) -> None:
    out.write_shard(CALLS, name, pa.Table.from_pylist(rows, schema=SCHEMAS[CALLS]))


def test_validate_lists_every_violation(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    rng = random.Random(12)
    good = _rows("good", 3, rng)
    _write_calls(out, "0001-good", good)

    bad = _rows("bad", 6, rng)
    bad[1]["logprobs"] = bad[1]["logprobs"][:-1]  # one logprob short
    bad[2]["prompt_ref"] = "0" * 32  # resolves to nothing
    bad[3]["seq"] = 4  # seq 3 missing, 4 twice
    failed = make_record("bad", [], [], [], status="failed")
    failed_row, _ = stored_row(failed, 6)
    failed_row.update(response_ids=[1, 2], logprobs=[-1.0, -1.0])  # a failed call with tokens
    _write_calls(out, "0002-bad", bad + [failed_row])
    _write_calls(out, "0003-dup", [dict(good[0])])  # the same record_id again

    (tmp_path / "calls" / "0004-truncated.parquet").write_bytes(b"PAR1\x00\x01")  # not a whole file
    (tmp_path / "calls" / ".0005-in-progress.parquet.tmp").write_bytes(b"ignored: hidden temp name")
    wrong = pa.Table.from_pylist(
        [{"reward_id": "r1", "session_id": "good", "name": "reward", "value": "1", "source": "x", "created_at": 1.0}]
    )
    out.write_shard(REWARDS, "0006-wrong-type", wrong)
    out.write_shard(
        REWARDS,
        "0007-unknown",
        pa.Table.from_pylist(
            [
                {
                    "reward_id": "r2",
                    "session_id": "ghost",
                    "name": "reward",
                    "value": float("nan"),
                    "source": "x",
                    "created_at": 1.0,
                }
            ],
            schema=SCHEMAS[REWARDS],
        ),
    )

    result = runner.invoke(app, ["shards", "validate", str(tmp_path)])
    assert result.exit_code == 1
    out_text = result.output
    for expected in (
        "5 logprobs for 6 response tokens",
        "prompt_ref 000000",
        "session bad: seq not contiguous from 0 (duplicated [4], missing [3])",
        "a failed call has tokens",
        f"record_id {good[0]['record_id']} appears 2 times",
        "calls/0004-truncated.parquet: unreadable Parquet",
        "rewards/0006-wrong-type.parquet: column value is string, expected double",
        "reward r2 (session ghost): value nan not finite",
        "reward r2: unknown session ghost",
    ):
        assert expected in out_text, (expected, out_text)
    assert "in-progress" not in out_text


def test_validate_catches_a_prefix_longer_than_its_reference(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    rows = _rows("s", 2, random.Random(13))
    rows[1]["prompt_prefix_len"] += 10_000
    rows[1]["prompt_len"] += 10_000
    _write_calls(out, "0001", rows)
    result = runner.invoke(app, ["shards", "validate", str(tmp_path)])
    assert result.exit_code == 1
    assert "prompt_prefix_len" in result.output and "exceeds" in result.output


def test_validate_of_a_capture_record_without_compaction(tmp_path: Path) -> None:
    """A store written by a foreign tool with whole prompts (no references) is valid too."""
    out = Output.from_uri(str(tmp_path))
    record = CaptureRecord(
        record_id=new_record_id(),
        session_id="x",
        seq=0,
        api="openai_chat",
        status="ok",
        prompt_ids=[1, 2, 3],
        response_ids=[4],
        logprobs=[-0.1],
    )
    row, _ = stored_row(record, 0)
    _write_calls(out, "0001", [row])
    assert runner.invoke(app, ["shards", "validate", str(tmp_path)]).exit_code == 0
