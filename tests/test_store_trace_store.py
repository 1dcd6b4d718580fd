"""TraceStore's own paths that whole-store round trips do not reach: refusing and recovering after a journal or
output failure (faults injected in-process: the disk-full and read-only tests run stores in child processes),
a group commit's sequence numbers, the inline-write policy, the rows of session updates and rewards, and the
quarantine helpers."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import logging
import os
import re
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

import polar_addon.store.trace_store as trace_store
from polar_addon.store import SESSION_STATUSES, StorageUnavailable, TraceStore, read_records, read_rewards, read_table
from polar_addon.store.entries import row_entry
from polar_addon.store.journal import SEGMENT_SUFFIX
from polar_addon.store.shards import SESSIONS, Output
from polar_addon.store.trace_store import default_journal_dir, entry_problem, quarantine_lines, split_segment
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


def test_a_failed_journal_write_refuses_until_a_write_or_the_probe_succeeds(
    tmp_path: Path, monkeypatch, caplog
) -> None:
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
                assert (
                    caught.value.reason
                    == f"cannot write the trace journal in {root}: [Errno 28] No space left on device"
                )
                assert caplog.records[-1].getMessage() == caught.value.reason
                # The write's reason, or the failing probe's once the shard writer (woken by the failure) ran it.
                assert _refused(store) in (caught.value.reason, probe_failed)
                assert _refused(store, journal_too=False) is None  # writes still try: the write is the probe
                with pytest.raises(StorageUnavailable):
                    store.check_writable()  # the journal counts unless the caller says otherwise

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


def test_a_failed_shard_write_refuses_until_the_output_probe_succeeds(tmp_path: Path, monkeypatch, caplog) -> None:
    out = str(tmp_path / "out")
    caplog.set_level(logging.INFO, logger="polar.store")
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
            assert f"cannot write shards to {out}: [Errno 30] Read-only file system" in [
                r.getMessage() for r in caplog.records if r.name == "polar.store"
            ]
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
            assert [r.getMessage() for r in caplog.records if "writable again" in r.getMessage()] == [
                f"output {out} is writable again"
            ]
            await store.append(make_record("s", [1, 2, 3], [4], []))

    asyncio.run(main())
    assert [(r.seq, r.prompt_ids) for r in read_records(out)] == [(0, [1]), (1, [1, 2, 3])]


def test_an_unexpected_error_in_a_write_reaches_the_caller_inline_or_queued(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Whatever a journal write raises goes to the waiting caller (never a caller left waiting forever)."""
    from polar_addon.store import journal

    taken: list[bool] = []
    append = journal.Segment.append
    bug = {"on": False}

    def buggy_append(self, payloads, **kwargs):
        if bug["on"]:
            raise RuntimeError("a bug in the journal")
        return append(self, payloads, **kwargs)

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
    bad = make_record("a", [1], [2], [])
    bad.top_k = "forty"  # type: ignore[assignment]

    async def main() -> None:
        async with TraceStore(str(tmp_path / "out")) as store:
            await store.append(make_record("a", [9], [9], []))
            # While something else writes, appends queue up and the writer thread commits them as one batch;
            # the event loop itself never waits for that lock.
            store._write_lock.acquire()
            tasks = [asyncio.create_task(store.append(r)) for r in [*sent[:3], bad, *sent[3:]]]
            await asyncio.sleep(0)  # every append is queued
            assert not any(t.done() for t in tasks)
            store._write_lock.release()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            # The bad record fails alone: the ones after it in the batch are still written.
            assert [type(r).__name__ for r in results] == ["NoneType"] * 3 + ["TypeError"] + ["NoneType"] * 5

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


def test_the_journal_of_a_remote_store_lives_in_a_local_cache_named_after_its_uri(monkeypatch) -> None:
    remote = Output(uri="s3://bucket/traces", fs=None, root="bucket/traces", local=False)  # type: ignore[arg-type]
    digest = hashlib.sha256(b"s3://bucket/traces").hexdigest()[:16]
    monkeypatch.setenv("POLAR_JOURNAL_DIR", "/j")
    assert default_journal_dir(remote) == f"/j/{digest}"
    monkeypatch.delenv("POLAR_JOURNAL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert default_journal_dir(remote) == f"/cache/polar/journal/{digest}"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert default_journal_dir(remote) == f"/home/u/.cache/polar/journal/{digest}"
    local = Output.from_uri("/data/out")
    assert default_journal_dir(local) == "/data/out/_journal"


def test_a_journal_that_cannot_be_created_is_storage_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    journal_dir = tmp_path / "file" / "journal"
    with pytest.raises(StorageUnavailable) as caught:
        TraceStore(str(tmp_path / "out"), journal_dir=str(journal_dir))
    assert caught.value.reason.startswith(
        f"cannot create the trace journal in {journal_dir}: [Errno 20] Not a directory"
    )


def test_a_closed_store_says_so(tmp_path: Path) -> None:
    store = TraceStore(str(tmp_path / "out"))
    store.close()
    assert _refused(store, journal_too=False) == "the trace store is closed"


def test_segments_are_cut_at_shard_max_records_and_named_by_writer_and_counter(tmp_path: Path) -> None:
    out = tmp_path / "out"

    async def main() -> str:
        async with TraceStore(str(out), shard_max_records=2) as store:
            for i in range(5):
                await store.append(make_record("s", list(range(i + 1)), [7], []))
            return store.writer_id

    writer = asyncio.run(main())
    shards = sorted((out / "calls").glob("*.parquet"))
    names = [re.fullmatch(r"\d{19}-(.+)-(\d{6})\.parquet", p.name) for p in shards]
    assert [(m.group(1), m.group(2)) for m in names if m] == [
        (writer, "000001"),
        (writer, "000002"),
        (writer, "000003"),
    ]
    assert [pq.read_metadata(p).num_rows for p in shards] == [2, 2, 1]  # the last one cut by close


def _crash(store: TraceStore) -> None:
    """The writer dies: no seal, no conversion, its journal directory stays behind unlocked."""
    store._closed = True
    store._own_dir.release(remove=False)


def test_a_dead_writers_journal_is_kept_until_its_segments_reach_shards(tmp_path: Path, monkeypatch, caplog) -> None:
    out = str(tmp_path / "out")
    journal_root = Path(out) / "_journal"

    async def dead_writer(records: int) -> str:
        store = TraceStore(out, shard_max_records=10_000, shard_max_seconds=3600)
        for i in range(records):
            await store.append(make_record("s", list(range(i + 1)), [7], []))
        _crash(store)
        return store._own_dir.path

    # A dead writer that wrote nothing: its directory is removed when the next store opens.
    empty = asyncio.run(dead_writer(0))
    store = TraceStore(out)
    assert not os.path.exists(empty)  # at open, not only at close
    store.close()
    assert list(journal_root.iterdir()) == []

    # One that wrote two calls, while the output cannot take shards: replay fails, the store refuses, and
    # closing it keeps the dead writer's directory with its segment.
    dead = asyncio.run(dead_writer(2))
    [segment] = [p for p in Path(dead).iterdir() if p.name.endswith(SEGMENT_SUFFIX)]

    def read_only(self, *args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    write_shard = Output.write_shard
    monkeypatch.setattr(Output, "write_shard", read_only)
    caplog.set_level(logging.INFO, logger="polar.store")
    store = TraceStore(out)
    reason = f"cannot write shards to {out}: [Errno 30] Read-only file system"
    assert _refused(store, journal_too=False) == reason
    store.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "polar.store"]
    assert logged[:2] == [
        f"replay of {segment} failed: [Errno 30] Read-only file system",
        "1 journal segments wait for the output",
    ]
    assert logged[-1] == (f"trace store closed with 1 journal segments not in shards yet ({reason}): {journal_root}")
    assert segment.exists()

    # With the output back, the next store replays it and removes the directory; a clean close leaves nothing.
    monkeypatch.setattr(Output, "write_shard", write_shard)
    store = TraceStore(out)
    assert not os.path.exists(dead)  # removed once its last segment is in shards, not only at close
    store.close()
    assert list(journal_root.iterdir()) == []
    assert [(r.seq, r.prompt_ids) for r in read_records(out)] == [(0, [0]), (1, [0, 1])]


def test_an_error_session_stays_error_with_its_first_reason(tmp_path: Path) -> None:
    """What a status post is answered with (ControlPlane): an ``error`` this store recorded stands against a
    later status, with the reason of the first error (its metadata's ``error``, else ``reason``, else
    ``error``); any other session's posted status is its final one."""

    async def main() -> list[tuple[str, str | None]]:
        async with TraceStore(str(tmp_path / "out")) as store:
            await store.session_update("lost", status="error", metadata={"error": "engine e1 taken out", "reason": "r"})
            await store.session_update("lost", status="error", metadata={"error": "a second error"})
            await store.session_update("why", status="error", metadata={"reason": "harness crashed"})
            await store.session_update("bare", status="error", metadata={"error": ""})
            await store.session_update("plain", status="error")
            await store.session_update("fine", status="running", metadata={"error": "not an error status"})
            await store.session_update("fine", status="completed")
            return [
                store.final_status("lost", "completed"),
                store.final_status("lost", "error"),
                store.final_status("why", "timeout"),
                store.final_status("bare", "agent_error"),
                store.final_status("plain", "completed"),
                store.final_status("fine", "completed"),
                store.final_status("never", "timeout"),
            ]

    assert asyncio.run(main()) == [
        ("error", "engine e1 taken out"),
        ("error", None),
        ("error", "harness crashed"),
        ("error", "error"),
        ("error", "error"),
        ("completed", None),
        ("timeout", None),
    ]


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every TraceStore opens ``traces`` on a filesystem of its own (as an s3:// store's is): a sub-tree rooted at the
    returned directory, whose relative paths mean nothing on the local one. Its journal stays local."""
    import pyarrow.fs as pafs

    root = tmp_path / "bucket"
    root.mkdir()
    fs = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
    monkeypatch.setattr(
        trace_store.Output, "from_uri", classmethod(lambda cls, uri: cls(uri=uri, fs=fs, root="traces", local=False))
    )
    monkeypatch.setenv("POLAR_JOURNAL_DIR", str(tmp_path / "journal"))
    return root


def _write_one(record) -> None:
    """One store's run: open, append ``record``, close (sealing it into a shard)."""

    async def main() -> None:
        async with TraceStore("mem://traces") as store:
            await store.append(record)

    asyncio.run(main())


def test_a_remote_store_continues_seqs_from_the_shards_on_its_own_filesystem(bucket: Path, monkeypatch) -> None:
    """The seq scan reads the existing shards through the store's filesystem (read locally, the scan would fail and
    the store refuse the call)."""
    monkeypatch.chdir(bucket.parent)  # "traces/calls/..." is not a local path from here either
    first, second = make_record("s", [1], [2], []), make_record("s", [3], [4], [])
    _write_one(first)
    assert list((bucket / "traces" / "calls").iterdir())  # sealed into a shard on close
    _write_one(second)
    assert (first.seq, second.seq) == (0, 1)


def test_unreadable_existing_shards_refuse_the_call_and_say_why(bucket: Path) -> None:
    _write_one(make_record("s", [1], [2], []))
    for shard in (bucket / "traces" / "calls").iterdir():
        shard.write_bytes(b"not parquet")
    with pytest.raises(StorageUnavailable, match=r"^cannot read existing shards in mem://traces: "):
        _write_one(make_record("s", [3], [4], []))
