"""TraceStore's own paths that whole-store round trips do not reach: refusing and recovering after a journal or
output failure (faults injected in-process: the disk-full and read-only tests run stores in child processes),
a group commit's sequence numbers, the inline-write policy, the rows of session updates and rewards, and the
quarantine helpers."""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import time
from pathlib import Path

import orjson
import pytest

import polar_addon.store.trace_store as trace_store
from polar_addon.store import SESSION_STATUSES, StorageUnavailable, TraceStore, read_records, read_rewards, read_table
from polar_addon.store.entries import row_entry
from polar_addon.store.shards import SESSIONS, Output
from polar_addon.store.trace_store import entry_problem, quarantine_lines, split_segment
from tests.test_store_basic import make_record

DEADLINE_S = 10.0


def _idle(store: TraceStore) -> bool:
    """Nothing queued and the writer thread not writing: the next append may be written inline."""
    return store._queue.empty() and not store._write_lock.locked()


async def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _refused(store: TraceStore, journal_too: bool = True) -> str | None:
    try:
        store.check_writable(journal_too=journal_too)
    except StorageUnavailable as exc:
        assert exc.reason == str(exc)
        return exc.reason
    return None


class Fault:
    """``os.fdatasync`` (what a journal append ends with) failing with ENOSPC while ``on``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        real = os.fdatasync

        def fdatasync(fd: int) -> None:
            if self.on:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)


def test_a_failed_journal_write_refuses_until_a_write_or_the_probe_succeeds(tmp_path: Path, monkeypatch) -> None:
    fault = Fault(monkeypatch)

    async def main() -> None:
        async with TraceStore(str(tmp_path / "out"), shard_max_records=1) as store:
            root = store.journal_root
            probe = Path(store._own_dir.path) / ".probe"
            probe.mkdir()  # the journal probe cannot create its file (EISDIR): only a real write clears the error
            probe_failed = f"cannot write the trace journal in {root}: [Errno 21] Is a directory: '{probe}'"
            await store.append(make_record("s", [1], [2], []))

            async def fail_once() -> None:
                fault.on = True
                with pytest.raises(StorageUnavailable) as caught:
                    await store.append(make_record("s", [1, 2, 3], [4], []))
                fault.on = False
                assert caught.value.reason == f"cannot write the trace journal in {root}: [Errno 28] No space left on device"
                # The write's reason, or the failing probe's once the shard writer (woken by the failure) ran it.
                assert _refused(store) in (caught.value.reason, probe_failed)
                assert _refused(store, journal_too=False) is None  # writes still try: the write is the probe

            # Each kind of write is attempted while the journal error stands, and its success clears it.
            await fail_once()
            await store.session_update("s", status="running")
            assert _refused(store) is None
            await fail_once()
            await store.add_reward("s", 1.0)
            assert _refused(store) is None
            await fail_once()
            await store.append(make_record("s", [1, 2, 3], [4], []))
            assert _refused(store) is None

            # With no write at all, the shard writer's probe finds the journal writable again.
            await fail_once()
            await _until(lambda: "[Errno 21]" in (_refused(store) or ""), "the failing probe's reason")
            assert _refused(store) == probe_failed
            probe.rmdir()
            await _until(lambda: _refused(store) is None, "the probe to clear the journal error")
            assert not probe.exists()  # the probe removes its file
            await _until(lambda: store.pending_segments == 0, "the shards")

    asyncio.run(main())
    assert [r.seq for r in read_records(str(tmp_path / "out"))] == [0, 1]  # a refused call takes no seq
    assert [r.value for r in read_rewards(str(tmp_path / "out"))] == [1.0]


def test_a_failed_shard_write_refuses_until_the_output_probe_succeeds(tmp_path: Path, monkeypatch) -> None:
    out = str(tmp_path / "out")
    broken = {"write": True, "probe": True}

    async def main() -> None:
        async with TraceStore(out, shard_max_records=1) as store:
            write_shard, probe = Output.write_shard, Output.probe
            probes: list[bool] = []

            def failing_write(self, *args):
                if broken["write"]:
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS))
                return write_shard(self, *args)

            def failing_probe(self) -> None:
                probes.append(broken["probe"])
                if broken["probe"]:
                    raise OSError(errno.EACCES, os.strerror(errno.EACCES))
                probe(self)

            monkeypatch.setattr(Output, "write_shard", failing_write)
            monkeypatch.setattr(Output, "probe", failing_probe)
            await store.append(make_record("s", [1], [2], []))  # durable in the journal; its shard fails
            await _until(lambda: _refused(store, journal_too=False) is not None, "the output error")
            assert _refused(store) == f"cannot write shards to {out}: [Errno 30] Read-only file system"
            with pytest.raises(StorageUnavailable):
                await store.append(make_record("s", [1, 2, 3], [4], []))
            assert store.pending_segments == 1
            # The segment reaches its shard, but only a successful probe of the output lifts the refusal.
            broken["write"] = False
            await _until(lambda: "[Errno 13]" in (_refused(store) or ""), "the failing probe's reason")
            assert _refused(store) == f"cannot write shards to {out}: [Errno 13] Permission denied"
            assert store.pending_segments == 0
            broken["probe"] = False
            await _until(lambda: _refused(store) is None, "the probe to clear the output error")
            assert store.pending_segments == 0 and probes and probes[-1] is False
            await store.append(make_record("s", [1, 2, 3], [4], []))

    asyncio.run(main())
    assert [(r.seq, r.prompt_ids) for r in read_records(out)] == [(0, [1]), (1, [1, 2, 3])]


def test_an_unexpected_error_in_a_write_reaches_the_caller_inline_or_queued(tmp_path: Path, monkeypatch, caplog) -> None:
    """Whatever a journal write raises goes to the waiting caller (never a caller left waiting forever)."""
    from polar_addon.store import journal

    taken: list[bool] = []
    append = journal.Segment.append
    bug = {"on": False}

    def buggy_append(self, payloads):
        if bug["on"]:
            raise RuntimeError("a bug in the journal")
        return append(self, payloads)

    monkeypatch.setattr(journal.Segment, "append", buggy_append)

    async def main() -> None:
        async with TraceStore(str(tmp_path / "out")) as store:
            write_inline = store._write_inline
            monkeypatch.setattr(store, "_write_inline", lambda item: taken.append(write_inline(item)) or taken[-1])
            await store.append(make_record("s", [1], [2], []))  # the writer thread builds the seq index
            await _until(lambda: _idle(store), "the writer thread to go idle")
            bug["on"] = True
            for _ in range(5):  # idle: inline, unless the writer thread happened to hold its lock
                with pytest.raises(RuntimeError, match="a bug in the journal"):
                    await store.append(make_record("s", [1, 2], [3], []))
                if taken[-1]:
                    break
                await _until(lambda: _idle(store), "the writer thread to go idle")
            store._inline_after = time.monotonic() + 60  # as after a slow write: to the writer thread
            with pytest.raises(RuntimeError, match="a bug in the journal"):
                await store.append(make_record("s", [1, 2], [3], []))
            bug["on"] = False
            await store.append(make_record("s", [1, 2], [3], []))

    asyncio.run(main())
    assert taken[0] is False and taken[-3:] == [True, False, False]
    logged = [r.message for r in caplog.records if r.name == "polar.store"]
    assert logged == ["journal write failed" if inline else "journal batch failed" for inline in taken[1:-1]]
    assert [r.seq for r in read_records(str(tmp_path / "out"))] == [0, 1]


def test_a_group_commit_numbers_each_sessions_calls_in_order(tmp_path: Path) -> None:
    sent = [make_record(sid, [i], [i], []) for i in range(4) for sid in ("a", "b")]

    async def main() -> None:
        async with TraceStore(str(tmp_path / "out")) as store:
            await store.append(make_record("a", [9], [9], []))
            # While something else writes, appends queue up and the writer thread commits them as one batch;
            # the event loop itself never waits for that lock.
            store._write_lock.acquire()
            tasks = [asyncio.create_task(store.append(r)) for r in sent]
            await asyncio.sleep(0)  # every append is queued
            assert not any(t.done() for t in tasks)
            store._write_lock.release()
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert [(r.session_id, r.seq) for r in sent] == [(sid, i + (sid == "a")) for i in range(4) for sid in "ab"]
    stored = sorted((r.session_id, r.seq, r.prompt_ids[0]) for r in read_records(str(tmp_path / "out")))
    assert stored == [("a", 0, 9)] + [("a", i + 1, i) for i in range(4)] + [("b", i, i) for i in range(4)]


def test_fast_inline_writes_stay_inline(tmp_path: Path, monkeypatch) -> None:
    """Only a write slower than _INLINE_MAX_S sends later appends to the writer thread (a fast disk keeps the
    cheaper inline path for every idle append)."""
    monkeypatch.setattr(trace_store, "_INLINE_MAX_S", 60.0)  # no real write is this slow
    taken: list[bool] = []

    async def main() -> None:
        async with TraceStore(str(tmp_path / "out")) as store:
            write_inline = store._write_inline
            monkeypatch.setattr(store, "_write_inline", lambda item: taken.append(write_inline(item)) or taken[-1])
            for i in range(5):
                await store.append(make_record("s", list(range(i + 1)), [7], []))
                await _until(lambda: _idle(store), "the writer thread to go idle")
            assert store._inline_after == 0.0

    asyncio.run(main())
    assert taken[0] is False and any(taken[1:])  # the first builds the seq index on the writer thread


def test_session_and_reward_rows_as_stored(tmp_path: Path) -> None:
    out = str(tmp_path / "out")

    async def main() -> tuple[float, float]:
        async with TraceStore(out) as store:
            with pytest.raises(TypeError) as unknown:
                await store.session_update("s", size=1, colour="red")
            assert str(unknown.value) == "unknown session fields: ['colour', 'size']"
            with pytest.raises(ValueError) as status:
                await store.session_update("s", status="finished")
            assert str(status.value) == f"status must be one of {SESSION_STATUSES}, got 'finished'"
            with pytest.raises(TypeError) as metadata:
                await store.session_update("s", metadata=["a"])
            assert str(metadata.value) == "session metadata must be a dict, got list"
            before = time.time()
            await store.session_update("s", status="running")
            await store.session_update("s", metadata={"k": 1})
            await store.add_reward("s", 0.5)
            return before, time.time()

    before, after = asyncio.run(main())
    rows = read_table(out, SESSIONS).to_pylist()
    assert [(r["status"], r["metadata_json"]) for r in rows] == [("running", None), (None, '{"k":1}')]
    assert all(before <= r["updated_at"] <= after for r in rows)
    [reward] = read_rewards(out)
    assert (reward.session_id, reward.name, reward.value, reward.source) == ("s", "reward", 0.5, "api")
    assert len(reward.reward_id) == 32 and int(reward.reward_id, 16) >= 0
    assert before <= reward.created_at <= after


def test_quarantine_helpers() -> None:
    good = row_entry(SESSIONS, {"session_id": "s", "updated_at": 1.0, "status": "running"})
    # An entry of a kind no shard has: the reason is the exception, type first, cut at 2000 characters.
    unknown = b"J" + orjson.dumps({"k": "x" * 3000, "r": {}})
    assert entry_problem(good) is None
    problem = entry_problem(unknown)
    assert problem is not None and problem.startswith("KeyError: 'xxx") and len(problem) == 2000
    assert split_segment([unknown, good, unknown]) == ([good], [(0, unknown, problem), (2, unknown, problem)])
    lines = quarantine_lines("seg-1", [(1, b"ab", "why"), (3, b"", "bad")])
    assert lines == (
        b'{"segment":"seg-1","entry":1,"reason":"why","payload_b64":"' + base64.b64encode(b"ab") + b'"}\n'
        b'{"segment":"seg-1","entry":3,"reason":"bad","payload_b64":""}\n'
    )
