"""Checks that a store's shards (and the journal rows not in shards yet) are what the writer promises;
``polar shards validate`` prints the result."""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from polar_addon.store.compaction import ShardIntegrityError, expand_session
from polar_addon.store.pending import pending_table, read_pending
from polar_addon.store.sessions import row_metadata
from polar_addon.store.shards import CALLS, KINDS, LATER_COLUMNS, REWARDS, SCHEMAS, SESSIONS, Output
from polar_addon.store.trace_store import SESSION_STATUSES, default_journal_dir


def _check_schemas(out: Output) -> tuple[list[str], dict[str, list[str]]]:
    problems: list[str] = []
    readable: dict[str, list[str]] = {}
    for kind in KINDS:
        readable[kind] = []
        for path in out.list_shards(kind):
            name = path[len(out.root) + 1 :]
            try:
                schema = pq.read_schema(path, filesystem=out.fs)
            except Exception as exc:  # a truncated or foreign file
                problems.append(f"{name}: unreadable Parquet ({exc})")
                continue
            bad = False
            for f in SCHEMAS[kind]:
                if f.name not in schema.names:
                    if f.name in LATER_COLUMNS:
                        continue
                    problems.append(f"{name}: missing column {f.name}")
                    bad = True
                elif not schema.field(f.name).type.equals(f.type):
                    problems.append(f"{name}: column {f.name} is {schema.field(f.name).type}, expected {f.type}")
                    bad = True
                elif not f.nullable and schema.field(f.name).nullable:
                    # A hand-made (or foreign) shard may declare a key column nullable; a null there has no row to
                    # be, and reading it under the store's schema would stop every reader with a cast error.
                    nulls = pq.read_table(path, columns=[f.name], filesystem=out.fs).column(0).null_count
                    if nulls:
                        problems.append(f"{name}: column {f.name} holds {nulls} null(s); it may hold none")
                        bad = True
            if not bad:
                readable[kind].append(path)
    return problems, readable


def _read(out: Output, kind: str, paths: list[str], segments: list[tuple[str, list[bytes]]]) -> list[dict[str, Any]]:
    """Rows of the readable shards, then the journal's rows that no shard (readable or not) holds yet."""
    # Through a dataset with the current schema: a shard from before a LATER_COLUMNS column reads as nulls there.
    tables = [ds.dataset(p, schema=SCHEMAS[kind], format="parquet", filesystem=out.fs).to_table() for p in paths]
    names = {os.path.basename(p).removesuffix(".parquet") for p in out.list_shards(kind)}
    tables.append(pending_table(segments, kind, names).select(SCHEMAS[kind].names))
    return pa.concat_tables([t.cast(tables[-1].schema) for t in tables]).to_pylist()


def _check_call_row(row: dict[str, Any]) -> list[str]:
    problems = []
    where = f"call {row['record_id']} (session {row['session_id']}, seq {row['seq']})"
    tail = row["prompt_tail"] or []
    response = row["response_ids"] or []
    logprobs = row["logprobs"] or []
    if row["status"] not in ("ok", "failed"):
        problems.append(f"{where}: status {row['status']!r} is neither ok nor failed")
    if row["status"] == "failed":
        if row["prompt_len"] or response or logprobs:
            problems.append(f"{where}: a failed call has tokens")
        if not row["error"]:
            problems.append(f"{where}: a failed call has no error")
    elif len(logprobs) != len(response):
        problems.append(f"{where}: {len(logprobs)} logprobs for {len(response)} response tokens")
    if row["prompt_len"] != (row["prompt_prefix_len"] or 0) + len(tail):
        problems.append(
            f"{where}: prompt_len {row['prompt_len']} != prefix {row['prompt_prefix_len']} + tail {len(tail)}"
        )
    if (row["prompt_ref"] is None) != (not row["prompt_prefix_len"]):
        problems.append(f"{where}: prompt_ref and prompt_prefix_len disagree")
    if (row["messages_ref"] is None) != (not row["messages_prefix_len"]):
        problems.append(f"{where}: messages_ref and messages_prefix_len disagree")
    return problems


def _check_calls(rows: list[dict[str, Any]]) -> tuple[list[str], set[str]]:
    problems: list[str] = []
    ids = Counter(r["record_id"] for r in rows)
    problems += [f"record_id {rid} appears {n} times" for rid, n in ids.items() if n > 1]
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_session[row["session_id"]].append(row)
        problems += _check_call_row(row)
    for sid, session_rows in sorted(by_session.items()):
        session_rows.sort(key=lambda r: r["seq"])
        seqs = [r["seq"] for r in session_rows]
        if seqs != list(range(len(seqs))):
            dup = sorted(s for s, n in Counter(seqs).items() if n > 1)
            missing = sorted(set(range(max(seqs) + 1)) - set(seqs))
            problems.append(f"session {sid}: seq not contiguous from 0 (duplicated {dup[:10]}, missing {missing[:10]})")
        problems += _check_references(sid, session_rows)
        if ids and any(ids[r["record_id"]] > 1 for r in session_rows):
            continue  # expanding would only repeat the duplicate-id finding
        try:
            for record, row in zip(expand_session(session_rows), session_rows):
                if (
                    row["messages_count"] is not None
                    and len(orjson.loads(record.messages_json)) != row["messages_count"]
                ):
                    problems.append(f"call {record.record_id}: rebuilt messages count differs from messages_count")
                # The reader's prompt, not the row's arithmetic: a negative prefix length passes the latter.
                if row["prompt_len"] is not None and len(record.prompt_ids) != row["prompt_len"]:
                    problems.append(
                        f"call {record.record_id}: rebuilt prompt length {len(record.prompt_ids)} differs from "
                        f"prompt_len {row['prompt_len']}"
                    )
        except (ShardIntegrityError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append(f"session {sid}: cannot rebuild records ({exc})")
    return problems, set(by_session)


def _check_references(sid: str, rows: list[dict[str, Any]]) -> list[str]:
    problems = []
    seen: dict[str, dict[str, Any]] = {}
    for row in rows:
        where = f"call {row['record_id']} (session {sid}, seq {row['seq']})"
        for ref_col, len_col in (("prompt_ref", "prompt_prefix_len"), ("messages_ref", "messages_prefix_len")):
            ref = row[ref_col]
            if ref is None:
                continue
            base = seen.get(ref)
            if base is None:
                problems.append(f"{where}: {ref_col} {ref} does not resolve to an earlier call of the session")
                continue
            if ref_col == "prompt_ref":
                held = base["prompt_len"]
                limit = None if held is None else held + len(base["response_ids"] or [])
            else:
                limit = (base["messages_count"] or 0) + 1
            length = row[len_col]
            if length is None or limit is None:
                continue  # a length missing here or in the referenced call is _check_call_row's finding
            if length < 0:
                problems.append(f"{where}: {len_col} {length} is negative")
            elif length > limit:
                problems.append(f"{where}: {len_col} {length} exceeds what {ref} holds ({limit})")
        seen[row["record_id"]] = row
    return problems


def validate_store(uri: str) -> list[str]:
    """Every violation found, as readable lines; an empty list means the store is valid."""
    out = Output.from_uri(uri)
    segments = read_pending(default_journal_dir(out))  # before the shards are listed (pending.pending_table)
    problems, readable = _check_schemas(out)
    calls = _read(out, CALLS, readable[CALLS], segments)
    call_problems, call_sessions = _check_calls(calls)
    problems += call_problems
    sessions = _read(out, SESSIONS, readable[SESSIONS], segments)
    known = call_sessions | {s["session_id"] for s in sessions}
    for row in sessions:
        if row["status"] is not None and row["status"] not in SESSION_STATUSES:
            problems.append(f"session {row['session_id']}: status {row['status']!r} not in {SESSION_STATUSES}")
        try:
            row_metadata(row)
        except ValueError as exc:
            problems.append(f"session {row['session_id']}: {exc} (readers skip this row)")
    for path in out.list_quarantine():
        with out.fs.open_input_stream(path) as f:
            for line in f.read().splitlines():
                entry = orjson.loads(line)
                problems.append(
                    f"quarantined: segment {entry['segment']} entry {entry['entry']} could not become a row "
                    f"({entry['reason']}); kept in {path[len(out.root) + 1 :]}"
                )
    rewards = _read(out, REWARDS, readable[REWARDS], segments)
    reward_ids = Counter(r["reward_id"] for r in rewards)
    problems += [f"reward_id {rid} appears {n} times" for rid, n in reward_ids.items() if n > 1]
    for row in rewards:
        if row["value"] is None or not math.isfinite(row["value"]):
            problems.append(f"reward {row['reward_id']} (session {row['session_id']}): value {row['value']} not finite")
        if row["session_id"] not in known:
            problems.append(f"reward {row['reward_id']}: unknown session {row['session_id']}")
    return problems
