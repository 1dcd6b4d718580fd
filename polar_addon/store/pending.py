"""Rows still in the write-ahead journal, for readers: what a live (or killed) writer acknowledged but has not
sealed into shards yet.

Read-only: segments are only read, never adopted, locked or deleted, so this is safe next to a live writer
(its open segment's torn tail, if any, was never acknowledged and is skipped like on replay). A segment
becomes exactly one shard per kind under its own name, so a kind's journal rows are left out once a shard
of that kind and name exists; the journal is read before the shards are listed, so a conversion racing the
read leaves the rows in exactly one of the two.
"""

from __future__ import annotations

import os

import pyarrow as pa

from polar_addon.store import journal
from polar_addon.store.compaction import SessionTips
from polar_addon.store.shards import SCHEMAS, Output


def default_journal_root(out: Output) -> str:
    from polar_addon.store.trace_store import default_journal_dir

    return default_journal_dir(out)


def journal_segments(journal_root: str) -> list[str]:
    """Segment paths under every writer directory of a journal root, oldest first (names start with a time)."""
    try:
        writers = [os.path.join(journal_root, d) for d in os.listdir(journal_root) if d.startswith("w-")]
    except FileNotFoundError:
        return []
    segments = []
    for writer in writers:
        try:
            segments += [os.path.join(writer, n) for n in os.listdir(writer) if n.endswith(journal.SEGMENT_SUFFIX)]
        except FileNotFoundError:
            continue
    return sorted(segments, key=journal.segment_name)


def read_pending(journal_root: str) -> list[tuple[str, list[bytes]]]:
    """(segment name, payloads) of every segment still in the journal; one converted meanwhile is skipped."""
    found = []
    for path in journal_segments(journal_root):
        try:
            found.append((journal.segment_name(path), journal.read_segment(path)))
        except FileNotFoundError:
            continue  # converted meanwhile: its rows are in the shards now
    return found


def pending_table(segments: list[tuple[str, list[bytes]]], kind: str, shard_names: set[str]) -> pa.Table:
    """``kind``'s journal rows of the segments no shard in ``shard_names`` holds yet, in the stored schema.

    Read the journal (``read_pending``) before listing the shards that give ``shard_names``: a segment
    converted in between is then in the listing and left out here, never lost nor counted twice. Calls are
    compacted against each other only (never against shards), so their references resolve among themselves.
    """
    from polar_addon.store.trace_store import segment_tables, split_segment

    base = SessionTips(max_sessions=1 << 30)
    tables = []
    for name, payloads in segments:
        tips = base.staged()
        try:
            converted = segment_tables(payloads, tips)
        except Exception:
            # As the writer does: an entry that cannot become a row is left out (it goes to quarantine there),
            # and the segment is encoded again from the tips as they were before it.
            tips = base.staged()
            converted = segment_tables(split_segment(payloads)[0], tips)
        base.commit(tips)
        table = converted.get(kind)
        if table is not None and name not in shard_names:
            tables.append(table)
    return pa.concat_tables(tables) if tables else SCHEMAS[kind].empty_table()
