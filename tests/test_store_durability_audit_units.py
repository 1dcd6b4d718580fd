"""The trace store's ``durability=write`` (issue 29 audit): appends acknowledged once written, a sync thread that
makes them durable just behind, a failed sync said and the segment still sealed, in-process (the SIGKILL test runs
the same mode in a child process, out of the fast selection)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from pathlib import Path

import pytest

from polar_addon.store import TraceStore, read_records
from polar_addon.store import journal as journal_module
from tests.test_store_basic import Agent


def test_an_unknown_durability_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        TraceStore(str(tmp_path), durability="never")
    assert str(caught.value) == "durability must be one of fsync, write, not 'never'"


def test_written_appends_are_made_durable_by_the_sync_thread_and_read_back(tmp_path: Path, monkeypatch) -> None:
    flushed: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (flushed.append(fd), real(fd)))
    agent = Agent("s", random.Random(3))
    records = [agent.next_call() for _ in range(3)]

    async def write() -> tuple[bool, int, int]:
        store = TraceStore(str(tmp_path), durability="write")
        assert store._syncer is not None and store._syncer.is_alive()
        for record in records:
            await store.append(record)
        segment = store._segment
        assert segment is not None
        deadline = time.monotonic() + 10
        while segment.unsynced and time.monotonic() < deadline:  # the sync thread runs just behind
            await asyncio.sleep(0.01)
        durable = not segment.unsynced and bool(flushed)
        await store.aclose()
        return durable, segment.synced, segment.size

    durable, synced, size = asyncio.run(write())
    assert durable and synced == size > 0
    assert [r.record_id for r in read_records(str(tmp_path))] == [r.record_id for r in records]


def test_a_fsync_store_runs_no_sync_thread(tmp_path: Path) -> None:
    store = TraceStore(str(tmp_path))
    assert store.durability == "fsync" and store._syncer is None
    store.close()


def test_a_failed_sync_at_the_seal_is_logged_and_the_segment_still_reaches_the_shards(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing(self: journal_module.Segment) -> None:
        raise OSError(5, "EIO")

    agent = Agent("s", random.Random(4))
    record = agent.next_call()

    async def write() -> str:
        store = TraceStore(str(tmp_path), durability="write")
        await store.append(record)
        path = store._segment.path  # type: ignore[union-attr]
        monkeypatch.setattr(journal_module.Segment, "sync", failing)
        with caplog.at_level(logging.ERROR, logger="polar_addon.store.trace_store"):
            await store.aclose()
        return path

    path = asyncio.run(write())
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert said and set(said) == {f"cannot fdatasync the trace journal segment {path}: [Errno 5] EIO"}
    assert [r.record_id for r in read_records(str(tmp_path))] == [record.record_id]
    assert list((tmp_path / "calls").glob("*.parquet"))  # sealed into a shard, not left in the journal


def test_a_failed_sync_on_the_sync_thread_is_logged_exactly(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing(self: journal_module.Segment) -> None:
        raise OSError(5, "EIO")

    monkeypatch.setattr(journal_module.Segment, "sync", failing)
    record = Agent("s", random.Random(5)).next_call()

    async def write() -> tuple[str, list[str]]:
        store = TraceStore(str(tmp_path), durability="write")
        with caplog.at_level(logging.ERROR, logger="polar_addon.store.trace_store"):
            await store.append(record)
            path = store._segment.path  # type: ignore[union-attr]
            deadline = time.monotonic() + 10
            while not caplog.records and time.monotonic() < deadline:  # the sync thread's attempt, before any seal
                await asyncio.sleep(0.01)
            before_close = [r.getMessage() for r in caplog.records]
            await store.aclose()
        return path, before_close

    path, before_close = asyncio.run(write())
    assert before_close == [f"cannot fdatasync the trace journal segment {path}: [Errno 5] EIO"]


def test_the_sync_thread_outlives_a_wake_with_no_open_segment(tmp_path: Path) -> None:
    agent = Agent("s", random.Random(6))

    async def write() -> bool:
        store = TraceStore(str(tmp_path), durability="write", shard_max_records=1)  # sealed after every call
        for _ in range(3):
            await store.append(agent.next_call())
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        alive = store._syncer is not None and store._syncer.is_alive()
        await store.aclose()
        return alive

    assert asyncio.run(write())
