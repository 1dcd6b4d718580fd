"""The reader (polar_addon.store.reader) on planted stores: what counts as a store, shard rows then the journal's
unsealed rows (never a segment twice), filters and columns applied to both, records grouped and ordered per
session, and the order rewards and session updates are merged in."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

from polar_addon.store import journal
from polar_addon.store.entries import call_entry, row_entry
from polar_addon.store.reader import (
    StoreNotFound,
    iter_records,
    read_records,
    read_rewards,
    read_sessions,
    read_table,
    require_store,
    shard_dataset,
)
from polar_addon.store.shards import CALLS, REWARDS, SCHEMAS, SESSIONS, Output
from tests.support.store_rows import stored_row
from tests.test_store_basic import Agent, make_record


def _segment(store: Path, name: str, payloads: list[bytes]) -> None:
    writer = store / "_journal" / "w-x"
    writer.mkdir(parents=True, exist_ok=True)
    (writer / f"{name}{journal.SEGMENT_SUFFIX}").write_bytes(
        journal.MAGIC + b"".join(journal.frame(p) for p in payloads)
    )


def _rows(kind: str, rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMAS[kind])


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, dict]:
    """Shards hold b's calls 0-1 and a's failed call; the journal holds b's call 2 and c's call 0, plus a segment
    already converted (its shard exists under its name) whose rows must not come twice."""
    out = Output.from_uri(str(tmp_path))
    agent = Agent("b", random.Random(5))
    b = [agent.next_call() for _ in range(3)]
    a = make_record("a", [], [], [], status="failed")
    c = make_record("c", [7, 8], [9], [{"role": "user", "content": "hi"}])
    row0, tip0 = stored_row(b[0], 0)
    row1, _ = stored_row(b[1], 1, [tip0])
    assert row1["prompt_ref"] == b[0].record_id  # compacted in the shard
    out.write_shard(CALLS, "0001-x-000001", _rows(CALLS, [stored_row(a, 0)[0], row0, row1]))
    out.write_shard(
        SESSIONS,
        "0001-x-000001",
        _rows(SESSIONS, [{"session_id": "b", "updated_at": 0.5, "status": "running", "harness": "late"}]),
    )
    out.write_shard(
        REWARDS,
        "0001-x-000001",
        _rows(REWARDS, [{"reward_id": "r-late", "session_id": "b", "name": "reward", "value": 1.0, "created_at": 0.5}]),
    )
    _segment(tmp_path, "0001-x-000001", [call_entry(b[0], 0), row_entry(SESSIONS, {"session_id": "b"})])
    _segment(
        tmp_path,
        "0002-x-000002",
        [
            call_entry(c, 0),
            call_entry(b[2], 2),
            row_entry(SESSIONS, {"session_id": "b", "harness": "early", "updated_at": None}),
            row_entry(REWARDS, {"reward_id": "r-none", "session_id": "b", "name": "reward", "value": 0.0}),
        ],
    )
    return tmp_path, {"a": [a], "b": b, "c": [c]}


def test_a_store_is_a_directory_with_a_kind_or_a_journal_and_anything_else_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFound) as caught:
        require_store(str(tmp_path / "nope"))
    assert str(caught.value) == f"no trace store at {tmp_path}/nope: it does not exist (give the proxy's polar_out)"
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFound) as caught:
        require_store(str(tmp_path / "empty"))
    assert str(caught.value) == (
        f"no trace store at {tmp_path}/empty: it holds none of calls/, sessions/, rewards/ or a journal "
        "(give the proxy's polar_out directory)"
    )
    assert isinstance(caught.value, FileNotFoundError)
    for part in ("calls", "sessions", "rewards", "_journal"):
        (tmp_path / part / part).mkdir(parents=True)
        out = require_store(str(tmp_path / part))
        assert (out.root, out.local) == (str(tmp_path / part), True)


def test_read_table_gives_shard_rows_then_the_journals_unsealed_rows_once(store) -> None:
    path, records = store
    table = read_table(str(path))
    assert table.schema.equals(SCHEMAS[CALLS])
    assert table.column("record_id").to_pylist() == [
        records["a"][0].record_id,
        records["b"][0].record_id,
        records["b"][1].record_id,
        records["c"][0].record_id,
        records["b"][2].record_id,
    ]
    # Filters and columns apply to both parts; a repeated session id counts once.
    some = read_table(str(path), CALLS, columns=["seq", "session_id"], session_ids=["c", "b", "b"])
    assert some.column_names == ["seq", "session_id"]
    assert some.to_pylist() == [
        {"seq": 0, "session_id": "b"},
        {"seq": 1, "session_id": "b"},
        {"seq": 0, "session_id": "c"},
        {"seq": 2, "session_id": "b"},
    ]
    assert read_table(str(path), CALLS, session_ids=[]).num_rows == 0
    assert read_table(str(path), CALLS, columns=["seq"], session_ids=["a"]).to_pylist() == [{"seq": 0}]


def test_without_a_journal_read_table_is_the_shards_alone(store) -> None:
    path, records = store
    for segment in (path / "_journal" / "w-x").iterdir():
        segment.unlink()
    table = read_table(str(path), CALLS, columns=["record_id"], session_ids=["b"])
    assert table.column("record_id").to_pylist() == [records["b"][0].record_id, records["b"][1].record_id]
    assert shard_dataset(str(path)).to_table().num_rows == 3
    # A shard from before the role columns reads with nulls there, in the current schema.
    old = pa.Table.from_pylist([stored_row(records["c"][0], 0)[0]], schema=SCHEMAS[CALLS])
    Output.from_uri(str(path)).write_shard(CALLS, "0000-old", old.drop_columns(["role", "role_reason"]))
    table = shard_dataset(str(path)).to_table()
    assert table.schema.equals(SCHEMAS[CALLS]) and table.column("role").to_pylist() == [None, None, None, None]
    assert shard_dataset(str(path), REWARDS).to_table().column("reward_id").to_pylist() == ["r-late"]


def test_records_are_whole_and_ordered_by_session_then_seq(store) -> None:
    path, records = store
    expected = [records["a"][0], *records["b"], records["c"][0]]
    got = read_records(str(path))
    assert [(r.session_id, r.seq) for r in got] == [("a", 0), ("b", 0), ("b", 1), ("b", 2), ("c", 0)]
    for record, sent in zip(got, expected):
        assert (record.record_id, record.prompt_ids, record.response_ids) == (
            sent.record_id,
            sent.prompt_ids,
            sent.response_ids,
        )
        assert record.messages_json == sent.messages_json and record.logprobs == sent.logprobs
    assert [r.record_id for r in iter_records(str(path))] == [r.record_id for r in expected]
    ok = list(iter_records(str(path), include_failed=False))
    assert [(r.session_id, r.seq) for r in ok] == [("b", 0), ("b", 1), ("b", 2), ("c", 0)]
    assert [(r.session_id, r.seq) for r in read_records(str(path), session_ids=["c", "a"])] == [("a", 0), ("c", 0)]
    assert read_records(str(path), session_ids=["a"], include_failed=False) == []
    assert read_records(str(path), session_ids=["zzz"]) == []


def test_single_call_sessions_at_either_end_are_each_their_own_group(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    sent = [make_record(sid, [1, 2], [3], []) for sid in ("a", "b", "b", "c")]
    rows = [stored_row(r, seq)[0] for r, seq in zip(sent, (0, 0, 1, 0))]
    out.write_shard(CALLS, "0001", _rows(CALLS, rows[::-1]))
    got = read_records(str(tmp_path))
    assert [(r.session_id, r.seq, r.record_id) for r in got] == [
        (r.session_id, seq, r.record_id) for r, seq in zip(sent, (0, 0, 1, 0))
    ]


def test_rewards_are_oldest_first_with_no_time_counting_as_zero(store) -> None:
    path, _ = store
    rewards = read_rewards(str(path))
    assert [(r.reward_id, r.value, r.created_at) for r in rewards] == [("r-none", 0.0, None), ("r-late", 1.0, 0.5)]


def test_sessions_merge_updates_oldest_first_and_count_tokens_of_ok_calls(store) -> None:
    path, records = store
    sessions = {s.session_id: s for s in read_sessions(str(path))}
    assert sorted(sessions) == ["a", "b", "c"]
    b = sessions["b"]
    # The update without a time counts as older than the one at 0.5 (read before it): "late" wins.
    assert (b.harness, b.status, b.reward, b.calls, b.failed_calls) == ("late", "completed", 1.0, 3, 0)
    assert b.prompt_tokens == sum(len(r.prompt_ids) for r in records["b"])
    assert b.response_tokens == sum(len(r.response_ids) for r in records["b"]) == 18
    a, c = sessions["a"], sessions["c"]
    assert (a.calls, a.failed_calls, a.prompt_tokens, a.response_tokens) == (1, 1, 0, 0)
    assert (c.calls, c.prompt_tokens, c.response_tokens, c.harness) == (1, 2, 1, "test-agent/1.0")


def test_a_remote_stores_shards_are_read_through_its_own_filesystem(tmp_path: Path, monkeypatch) -> None:
    """Shard paths of an object store mean nothing locally: every read goes through the store's filesystem."""
    import pyarrow.fs as pafs

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    fs = pafs.SubTreeFileSystem(str(bucket), pafs.LocalFileSystem())
    monkeypatch.setattr(Output, "from_uri", classmethod(lambda cls, uri: cls(uri, fs, "traces", False)))
    monkeypatch.setenv("POLAR_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.chdir(tmp_path)  # "traces/calls/..." is no local path from here
    record = make_record("s", [1, 2], [3], [])
    out = Output.from_uri("mem://traces")
    out.write_shard(CALLS, "0001", _rows(CALLS, [stored_row(record, 0)[0]]))
    out.write_shard(REWARDS, "0001", _rows(REWARDS, [{"reward_id": "r", "session_id": "s", "value": 1.0}]))
    assert [r.record_id for r in read_records("mem://traces")] == [record.record_id]
    assert read_table("mem://traces", CALLS, session_ids=["s"]).num_rows == 1
    assert shard_dataset("mem://traces", REWARDS).to_table().column("reward_id").to_pylist() == ["r"]
    assert require_store("mem://traces").root == "traces"
