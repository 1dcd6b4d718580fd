"""The journal rows a reader sees before they reach shards (polar_addon.store.pending), on planted journals:
which files are segments and in what order, segments that vanish mid-read, segments already in shards, and a
segment holding an entry that cannot become a row."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store import journal
from polar_addon.store.compaction import expand_session
from polar_addon.store.entries import call_entry, row_entry
from polar_addon.store.pending import default_journal_root, journal_segments, pending_table, read_pending
from polar_addon.store.shards import CALLS, REWARDS, SCHEMAS, SESSIONS, Output

TOO_BIG = 2**63 + 5  # journaled by an older polar; the int64 column refuses it


def _call(session_id: str, prompt: list[int], response: list[int]) -> CaptureRecord:
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=session_id,
        seq=-1,
        api="openai_chat",
        status="ok",
        prompt_ids=prompt,
        response_ids=response,
        logprobs=[-0.5] * len(response),
        messages_json=orjson.dumps([{"role": "user", "content": "q"}]).decode(),
    )


def _segment(writer: Path, name: str, payloads: list[bytes]) -> Path:
    writer.mkdir(parents=True, exist_ok=True)
    path = writer / f"{name}{journal.SEGMENT_SUFFIX}"
    path.write_bytes(journal.MAGIC + b"".join(journal.frame(p) for p in payloads))
    return path


def test_the_journal_root_of_a_local_store_is_its_journal_directory(tmp_path: Path) -> None:
    assert default_journal_root(Output.from_uri(str(tmp_path))) == str(tmp_path / "_journal")


def test_segments_are_the_wal_files_of_writer_directories_ordered_by_name_across_writers(tmp_path: Path) -> None:
    assert journal_segments(str(tmp_path / "absent")) == []
    root = tmp_path / "_journal"
    late = _segment(root / "w-a", "0002-a-000001", [])
    early = _segment(root / "w-b", "0001-b-000001", [])
    latest = _segment(root / "w-a", "0003-a-000002", [])
    (root / "w-a" / "lock").touch()
    (root / "w-a" / ".0004-a-000003.wal.tmp").touch()
    _segment(root / "x-other", "0000-x-000001", [])  # not a writer's directory
    _segment(root, "0000-root-000001", [])  # a segment outside any writer directory
    # By segment name (its creation time), not by path: w-a sorts before w-b but its first segment is later.
    assert journal_segments(str(root)) == [str(early), str(late), str(latest)]


def test_a_writer_directory_or_segment_that_vanishes_mid_read_is_skipped(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "_journal"
    kept = _segment(root / "w-a", "0002-a-000001", [row_entry(SESSIONS, {"session_id": "s", "status": "running"})])
    # A writer removed (its directory listed, then gone: listed first here) and a segment converted and deleted
    # meanwhile.
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: ["w-gone", *listdir(path)] if path == str(root) else listdir(path))
    os.symlink(root / "w-a" / "0001-gone.wal", root / "w-a" / "0001-a-000000.wal")
    assert journal_segments(str(root)) == [str(root / "w-a" / "0001-a-000000.wal"), str(kept)]
    assert read_pending(str(root)) == [
        ("0002-a-000001", [row_entry(SESSIONS, {"session_id": "s", "status": "running"})])
    ]


def test_no_segments_give_an_empty_table_in_the_stored_schema() -> None:
    for kind in (CALLS, SESSIONS, REWARDS):
        table = pending_table([], kind, set())
        assert table.num_rows == 0 and table.schema.equals(SCHEMAS[kind], check_metadata=True)


def test_only_the_segments_without_a_shard_of_that_kind_are_read_and_calls_compact_across_segments() -> None:
    first = _call("s", [1, 2, 3], [4, 5])
    second = _call("s", [1, 2, 3, 4, 5, 6], [7])
    segments = [
        ("0001-a-000001", [call_entry(first, 0), row_entry(SESSIONS, {"session_id": "s", "status": "running"})]),
        ("0002-a-000002", [call_entry(second, 1), row_entry(REWARDS, {"reward_id": "r", "session_id": "s"})]),
    ]
    calls = pending_table(segments, CALLS, set()).to_pylist()
    assert [r["record_id"] for r in calls] == [first.record_id, second.record_id]
    # The shard of the first segment holds its calls: only the second's are pending, and they still reference
    # the first segment's call, as the writer's shard of that segment will.
    pending = pending_table(segments, CALLS, {"0001-a-000001"}).to_pylist()
    assert [(r["record_id"], r["prompt_ref"], r["prompt_prefix_len"], r["prompt_tail"]) for r in pending] == [
        (second.record_id, first.record_id, 5, [6])
    ]
    # Each kind's rows, in that kind's schema.
    sessions = pending_table(segments, SESSIONS, {"0002-a-000002"})
    assert [r["session_id"] for r in sessions.to_pylist()] == ["s"] and sessions.schema.equals(SCHEMAS[SESSIONS])
    assert pending_table(segments, SESSIONS, {"0001-a-000001"}).num_rows == 0
    assert [r["reward_id"] for r in pending_table(segments, REWARDS, {"0001-a-000001"}).to_pylist()] == ["r"]
    assert pending_table(segments, REWARDS, {"0001-a-000001", "0002-a-000002"}).num_rows == 0


def test_an_entry_that_cannot_become_a_row_is_left_out_and_the_rest_encoded_from_the_tips_before_it() -> None:
    first = _call("s", [1, 2, 3], [4])
    second = _call("s", [1, 2, 3, 4, 9], [8])
    bad = b"J" + orjson.dumps({"k": SESSIONS, "r": {"session_id": "t", "sample_index": TOO_BIG}})
    segments = [
        ("0001-a-000001", [call_entry(first, 0)]),
        ("0002-a-000002", [call_entry(second, 1), bad, row_entry(SESSIONS, {"session_id": "u"})]),
    ]
    rows = pending_table(segments, CALLS, set()).to_pylist()
    # The second call references the first (tips committed before the failed attempt), never itself (tips of
    # the failed attempt are dropped).
    assert [(r["record_id"], r["prompt_ref"], r["prompt_prefix_len"]) for r in rows] == [
        (first.record_id, None, 0),
        (second.record_id, first.record_id, 4),
    ]
    assert [r.prompt_ids for r in expand_session(rows)] == [[1, 2, 3], [1, 2, 3, 4, 9]]
    assert [r["session_id"] for r in pending_table(segments, SESSIONS, set()).to_pylist()] == ["u"]
