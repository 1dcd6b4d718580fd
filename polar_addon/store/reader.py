"""The one reader API: full records, sessions and rewards from a store's shards.

Only complete shards are read (hidden temporary names are skipped), plus what the journal holds that no shard
holds yet (a live writer's unsealed segment, a killed writer's segments before the next start replays them):
a record is visible as soon as the harness got its answer. Reading never takes the journal over.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from polar_addon.capture import CaptureRecord
from polar_addon.store.compaction import ShardIntegrityError, expand_session
from polar_addon.store.pending import default_journal_root, pending_table, read_pending
from polar_addon.store.rewards import RewardRecord
from polar_addon.store.sessions import SessionRecord, merge_sessions
from polar_addon.store.shards import CALLS, KINDS, REWARDS, SCHEMAS, SESSIONS, Output

log = logging.getLogger(__name__)


class StoreNotFound(FileNotFoundError):
    """A read was pointed at a path that holds no trace store (a typo would otherwise read as empty)."""


def require_store(uri: str) -> Output:
    """The store's Output, or StoreNotFound saying why ``uri`` is not a store."""
    out = Output.from_uri(uri)
    if any(out.exists(out.kind_dir(kind)) for kind in KINDS) or os.path.isdir(default_journal_root(out)):
        return out
    if not out.exists(out.root):
        raise StoreNotFound(f"no trace store at {uri}: it does not exist (give the proxy's polar_out)")
    raise StoreNotFound(
        f"no trace store at {uri}: it holds none of calls/, sessions/, rewards/ or a journal "
        "(give the proxy's polar_out directory)"
    )


def shard_dataset(uri: str, kind: str = CALLS) -> ds.Dataset:
    """A pyarrow dataset over one kind of shard (rows in stored, compact form)."""
    out = Output.from_uri(uri)
    return ds.dataset(out.list_shards(kind), schema=SCHEMAS[kind], format="parquet", filesystem=out.fs)


def read_table(
    uri: str, kind: str = CALLS, columns: list[str] | None = None, session_ids: Iterable[str] | None = None
) -> pa.Table:
    """Stored rows of one kind, in shard order (oldest first) then row order."""
    out = Output.from_uri(uri)
    segments = read_pending(default_journal_root(out))  # before listing shards: see pending.pending_table
    paths = out.list_shards(kind)
    dataset = ds.dataset(paths, schema=SCHEMAS[kind], format="parquet", filesystem=out.fs)
    where = None
    if session_ids is not None:
        where = pc.field("session_id").isin(pa.array(sorted(set(session_ids)), pa.string()))
    table = dataset.to_table(columns=columns, filter=where)
    if not segments:
        return table
    names = {os.path.basename(p).removesuffix(".parquet") for p in paths}
    pending = pending_table(segments, kind, names)
    if where is not None:
        pending = pending.filter(where)
    if columns is not None:
        pending = pending.select(columns)
    return pa.concat_tables([table, pending.cast(table.schema)])


def iter_records(
    uri: str, session_ids: Iterable[str] | None = None, include_failed: bool = True
) -> Iterator[CaptureRecord]:
    """Full records, one session at a time, sorted by (session_id, seq); memory stays per session."""
    table = read_table(uri, CALLS, session_ids=session_ids)
    if table.num_rows == 0:
        return
    table = table.sort_by([("session_id", "ascending"), ("seq", "ascending")])
    sids = table.column("session_id").to_pylist()
    start, copies = 0, 0
    for end in range(1, len(sids) + 1):
        if end < len(sids) and sids[end] == sids[start]:
            continue
        rows, dropped = once_each(table.slice(start, end - start).to_pylist())
        copies += dropped
        for record in expand_session(rows):
            if include_failed or record.status == "ok":
                yield record
        start = end
    if copies:
        log.warning(
            "%s: %d call rows are stored more than once (a shard copied under a second name?); each is read once",
            uri,
            copies,
        )


def once_each(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """One session's rows with each call once, and how many identical copies were dropped. A shard copied under a
    second name would otherwise train on every call of its sessions twice; two different rows under one record id
    cannot both be the call, so that is refused."""
    kept: dict[str, dict[str, Any]] = {}
    for row in rows:
        first = kept.setdefault(row["record_id"], row)
        if first is not row and first != row:
            raise ShardIntegrityError(f"call {row['record_id']} is stored twice with different contents")
    return list(kept.values()), len(rows) - len(kept)


def read_records(
    uri: str, session_ids: Iterable[str] | None = None, include_failed: bool = True
) -> list[CaptureRecord]:
    """Every record with full prompt_ids / messages_json, sorted by (session_id, seq)."""
    return list(iter_records(uri, session_ids, include_failed))


def read_rewards(uri: str) -> list[RewardRecord]:
    """Reward events, oldest first."""
    rows = list({r["reward_id"]: r for r in read_table(uri, REWARDS).to_pylist()}.values())  # a copied shard's once
    rows.sort(key=lambda r: r["created_at"] or 0.0)
    return [RewardRecord(**r) for r in rows]


def read_sessions(uri: str) -> list[SessionRecord]:
    """One record per session seen in sessions, rewards or calls shards, rewards merged in."""
    updates = read_table(uri, SESSIONS).to_pylist()
    updates.sort(key=lambda r: r["updated_at"] or 0.0)  # stable: ties keep shard and row order
    calls = read_table(
        uri,
        CALLS,
        columns=[
            "record_id",
            "session_id",
            "seq",
            "status",
            "task_id",
            "group_id",
            "sample_index",
            "harness",
            "started_at",
            "prompt_len",
            "response_ids",
        ],
    )
    calls = calls.append_column("response_len", pc.list_value_length(calls.column("response_ids")))
    calls = calls.drop_columns(["response_ids"])
    once = {row.pop("record_id"): row for row in calls.to_pylist()}  # a copied shard's calls counted once
    return merge_sessions(updates, read_rewards(uri), list(once.values()))
