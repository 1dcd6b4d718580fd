"""Waiting for a running proxy's captures to reach the shards, without sleeping a guessed time.

A call is acknowledged once its journal entry is durable; the shard follows when the segment is
sealed (``polar_shard_seconds``) and converted, and the segment file is deleted only then. So a
local store whose journal holds no segment has every acknowledged record in its shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from polar_addon.capture import CaptureRecord
from polar_addon.store import read_records


def pending_segments(out: str | Path) -> list[Path]:
    return sorted(Path(out, "_journal").glob("w-*/*.wal"))


def wait_for_shards(out: str | Path, timeout: float = 60.0, check: Callable[[], None] | None = None) -> None:
    """Return once every record acknowledged so far by the store at ``out`` is in its shards. ``check`` runs
    on every poll and once at the end (e.g. ``store.check_writable``: a store that stopped writing fails at
    once with its reason, not at the deadline)."""
    deadline = time.monotonic() + timeout
    while pending := pending_segments(out):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"journal segments still not in shards after {timeout:g} s: {pending}")
        time.sleep(0.02)
    if check is not None:
        check()


def session_records(
    out: str | Path, session: str, *, include_failed: bool = True, at_least: int = 0, timeout: float = 60.0
) -> list[CaptureRecord]:
    """The session's records, once everything acknowledged is in the shards; with ``at_least``, also
    once that many exist (a call still in the engine when the client went away is recorded later)."""
    deadline = time.monotonic() + timeout
    while True:
        wait_for_shards(out, max(0.0, deadline - time.monotonic()))
        records = read_records(str(out), [session], include_failed=include_failed)
        if len(records) >= at_least:
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"session {session}: {len(records)} records after {timeout:g} s, expected {at_least}")
        time.sleep(0.05)
