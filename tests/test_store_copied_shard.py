"""A shard stored twice (copied under a second name: a backup, an `aws s3 sync` of a renamed file, a user's `cp`) is
read once: every call, reward and session count as written, never doubled into the training set; two different rows
under one record id are refused, since only one of them can be the call."""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_addon.store import TraceStore, read_records, read_rewards, read_sessions
from polar_addon.store.compaction import ShardIntegrityError
from polar_addon.store.reader import once_each
from polar_addon.store.validate import validate_store
from tests.test_store_basic import Agent


def _store(tmp_path: Path) -> tuple[Path, list]:
    """Two sessions of three calls each, a reward and a status: one shard of each kind."""

    async def write() -> list:
        agents = [Agent("s1", random.Random(1)), Agent("s2", random.Random(2))]
        records = []
        async with TraceStore(str(tmp_path)) as store:
            for _ in range(3):
                for agent in agents:
                    record = agent.next_call()
                    records.append(record)
                    await store.append(record)
            await store.add_reward("s1", 0.75)
            await store.session_update("s1", status="completed")
        return records

    return tmp_path, asyncio.run(write())


def _copy_every_shard(store: Path, suffix: str = "-copy") -> list[Path]:
    copies = []
    for shard in sorted(store.glob("*/*.parquet")):
        copy = shard.with_name(shard.stem + suffix + ".parquet")
        shutil.copy(shard, copy)
        copies.append(copy)
    return copies


def _key(record) -> tuple:
    return (record.session_id, record.seq, record.record_id, record.prompt_ids, record.response_ids)


def test_a_copied_shard_is_read_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, written = _store(tmp_path)
    before = read_records(str(store))
    sessions_before = {
        s.session_id: (s.calls, s.prompt_tokens, s.response_tokens, s.reward, s.status)
        for s in read_sessions(str(store))
    }
    assert [_key(r) for r in before] == sorted(_key(r) for r in written)
    assert len(_copy_every_shard(store)) == 3  # calls, sessions, rewards

    with caplog.at_level(logging.WARNING, logger="polar_addon.store.reader"):
        after = read_records(str(store))
    assert [_key(r) for r in after] == [_key(r) for r in before]
    assert [r.logprobs for r in after] == [r.logprobs for r in before]
    assert f"{store}: 6 call rows are stored more than once" in caplog.text
    assert [(r.session_id, r.value) for r in read_rewards(str(store))] == [("s1", 0.75)]
    sessions_after = {
        s.session_id: (s.calls, s.prompt_tokens, s.response_tokens, s.reward, s.status)
        for s in read_sessions(str(store))
    }
    assert sessions_after == sessions_before
    assert sessions_after["s1"][0] == 3
    # The validator still names the copies: the store is not clean, only readable.
    assert any("appears 2 times" in p for p in validate_store(str(store)))


def test_two_different_rows_under_one_record_id_are_refused(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    shard = next(store.glob("calls/*.parquet"))
    table = pq.read_table(shard)
    changed = table.set_column(table.schema.get_field_index("status"), "status", [["failed"] * table.num_rows]).cast(
        table.schema
    )
    pq.write_table(changed, shard.with_name(shard.stem + "-forged.parquet"))
    with pytest.raises(ShardIntegrityError, match=r"call \S+ is stored twice with different contents"):
        read_records(str(store))


def test_once_each_keeps_the_first_of_equal_rows_in_order() -> None:
    rows = [{"record_id": "a", "x": 1}, {"record_id": "b", "x": 2}, {"record_id": "a", "x": 1}]
    kept, dropped = once_each(rows)
    assert kept == rows[:2] and kept[0] is rows[0]
    assert dropped == 1
    assert once_each([]) == ([], 0)
    with pytest.raises(ShardIntegrityError, match="^call a is stored twice with different contents$"):
        once_each([*rows, {"record_id": "a", "x": 3}])


def test_a_shard_with_nulls_in_a_key_column_is_reported_not_read(tmp_path: Path) -> None:
    """A hand-made shard that declares seq nullable and holds a null: validate names the column and the count and
    checks the rest of the store, instead of stopping with pyarrow's cast error."""
    import pyarrow as pa

    store, _ = _store(tmp_path)
    shard = next(store.glob("calls/*.parquet"))
    table = pq.read_table(shard)
    index = table.schema.get_field_index("seq")
    nullable = table.schema.set(index, pa.field("seq", pa.int64(), nullable=True))
    seqs = table.column("seq").to_pylist()
    forged = table.cast(nullable).set_column(index, nullable.field(index), pa.array([None, *seqs[1:]], pa.int64()))
    forged_path = shard.with_name("9999-forged.parquet")
    pq.write_table(forged, forged_path)
    problems = validate_store(str(store))
    assert f"calls/{forged_path.name}: column seq holds 1 null(s); it may hold none" in problems
    # A nullable declaration with no null in it is the store's own column: nothing to report.
    pq.write_table(table.cast(nullable), forged_path)
    assert not [p for p in validate_store(str(store)) if "null" in p]


def test_the_null_check_reads_through_the_stores_own_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an object store a shard's path is the store's, not a local one: the column is read through the store's
    filesystem (here a sub-tree filesystem, whose paths mean nothing to the local one)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    from polar_addon.store import validate
    from polar_addon.store.shards import Output

    store, _ = _store(tmp_path / "base" / "store")
    shard = next(store.glob("calls/*.parquet"))
    table = pq.read_table(shard)
    index = table.schema.get_field_index("record_id")
    nullable = table.schema.set(index, pa.field("record_id", pa.string(), nullable=True))
    ids = table.column("record_id").to_pylist()
    pq.write_table(
        table.cast(nullable).set_column(index, nullable.field(index), pa.array([*ids[:-1], None], pa.string())),
        shard,
    )
    remote = Output(
        "mem://store", pafs.SubTreeFileSystem(str(tmp_path / "base"), pafs.LocalFileSystem()), "store", False
    )
    monkeypatch.setattr(validate.Output, "from_uri", classmethod(lambda cls, uri: remote))
    monkeypatch.chdir(tmp_path)  # "store/calls/..." is no local path from here
    problems = validate.validate_store("mem://store")
    assert f"calls/{shard.name}: column record_id holds 1 null(s); it may hold none" in problems
