"""The journal segment's deferred sync (polar_durability=write; issue 29 audit): what is written but not yet durable,
one fdatasync per sync that has something to make durable and none otherwise, none on a closed segment, and the
segment's opening time (its age decides when the trace store seals it)."""

from __future__ import annotations

import os
import time

import pytest

from polar_addon.store import journal


def test_a_deferred_append_is_made_durable_by_one_sync_and_a_second_sync_flushes_nothing(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segment = journal.Segment(str(tmp_path), "0001")
    flushed: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (flushed.append(fd), real(fd)))
    assert not segment.unsynced
    segment.append([b"written"], sync=False)
    assert flushed == [] and segment.unsynced and segment.synced == 0
    segment.sync()
    assert flushed == [segment.fd] and not segment.unsynced and segment.synced == segment.size
    segment.sync()  # nothing new since: no second flush of the disk
    assert len(flushed) == 1
    segment.append([b"durable"])  # sync=True flushes in the append itself
    assert len(flushed) == 2 and segment.synced == segment.size
    segment.sync()
    assert len(flushed) == 2
    segment.append([b"late"], sync=False)
    segment.close()
    segment.sync()  # closed: its fd may already belong to another file
    assert len(flushed) == 2
    assert journal.read_segment(segment.path) == [b"written", b"durable", b"late"]


def test_a_segment_knows_when_it_was_opened(tmp_path) -> None:
    before = time.monotonic()
    segment = journal.Segment(str(tmp_path), "0001")
    after = time.monotonic()
    assert before <= segment.opened_at <= after
    segment.close()
