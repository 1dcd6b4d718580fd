"""What `polar shards inspect` shows: counts over a store's shards, computed from stored (compact) rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pyarrow.compute as pc
import pyarrow.fs as pafs

from polar_addon.store import journal
from polar_addon.store.entries import entry_header
from polar_addon.store.pending import journal_segments
from polar_addon.store.reader import read_sessions, read_table
from polar_addon.store.sessions import SessionRecord
from polar_addon.store.shards import CALLS, KINDS, Output
from polar_addon.store.trace_store import default_journal_dir


@dataclass
class RewardStats:
    name: str
    sessions: int
    mean: float
    minimum: float
    maximum: float


@dataclass
class StoreSummary:
    uri: str
    sessions: list[SessionRecord]
    calls_ok: int = 0
    calls_failed: int = 0
    prompt_tokens: int = 0
    stored_prompt_tokens: int = 0  # what prefix references leave on disk
    response_tokens: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    shard_bytes: int = 0
    harnesses: Counter = field(default_factory=Counter)  # harness -> calls
    statuses: Counter = field(default_factory=Counter)  # session status -> sessions
    failures: Counter = field(default_factory=Counter)  # error -> calls
    rewards: list[RewardStats] = field(default_factory=list)
    journal_segments: int = 0  # segments not yet in shards (a live or killed writer); their rows are counted


def summarize(uri: str) -> StoreSummary:
    out = Output.from_uri(uri)
    summary = StoreSummary(uri=uri, sessions=read_sessions(uri))
    for kind in KINDS:
        paths = out.list_shards(kind)
        summary.shards[kind] = len(paths)
        summary.shard_bytes += sum(i.size for i in out.fs.get_file_info(paths) if i.type == pafs.FileType.File)
    calls = read_table(uri, CALLS, columns=["status", "harness", "error", "prompt_len", "prompt_tail", "response_ids"])
    if calls.num_rows:
        ok = pc.equal(calls.column("status"), "ok")
        summary.calls_ok = pc.sum(ok.cast("int64")).as_py() or 0
        summary.calls_failed = calls.num_rows - summary.calls_ok
        summary.prompt_tokens = pc.sum(calls.column("prompt_len")).as_py() or 0
        summary.stored_prompt_tokens = pc.sum(pc.list_value_length(calls.column("prompt_tail"))).as_py() or 0
        summary.response_tokens = pc.sum(pc.list_value_length(calls.column("response_ids"))).as_py() or 0
        summary.harnesses.update(h or "(unknown)" for h in calls.column("harness").to_pylist())
        failed = calls.filter(pc.invert(ok))
        summary.failures.update(e or "(no reason)" for e in failed.column("error").to_pylist())
    summary.statuses.update(s.status or "(not reported)" for s in summary.sessions)
    by_name: dict[str, list[float]] = {}
    for session in summary.sessions:
        for name, value in session.rewards.items():
            by_name.setdefault(name, []).append(value)
    summary.rewards = [
        RewardStats(name, len(v), sum(v) / len(v), min(v), max(v)) for name, v in sorted(by_name.items())
    ]
    summary.journal_segments = len(journal_segments(default_journal_dir(out)))
    return summary


def journal_session_ids(journal_root: str) -> set[str]:
    """Sessions mentioned in journal segments not yet in shards (read-only: safe next to a live writer)."""
    sessions: set[str] = set()
    for path in journal_segments(journal_root):
        try:
            payloads = journal.read_segment(path)
        except FileNotFoundError:
            continue  # converted meanwhile: its sessions are in the shards now
        for payload in payloads:
            sessions.add(entry_header(payload)[1]["session_id"])
    return sessions
