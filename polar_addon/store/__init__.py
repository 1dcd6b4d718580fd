"""The durable trace store: a local write-ahead journal in front of compact, zstd Parquet shards.

Layout of a store (a local directory or a pyarrow filesystem URI such as ``s3://bucket/prefix``)::

    calls/<segment>.parquet      one row per model call (shards.CALLS_SCHEMA), prompts as prefix references
    sessions/<segment>.parquet   one row per session_update (shards.SESSIONS_SCHEMA)
    rewards/<segment>.parquet    one row per reward event (shards.REWARDS_SCHEMA)
    _journal/w-<writer>/*.wal    local stores only: the write-ahead journal (remote stores keep it in
                                 ~/.cache/polar/journal/<hash of uri>, or $POLAR_JOURNAL_DIR, or journal_dir=)

``<segment>`` is ``<creation time ns>-<writer id>-<counter>``: each journal segment becomes exactly one shard
of each kind it holds, so names sort chronologically and a replay never duplicates. Names starting with
``.`` or ``_`` are not shards (temporary files, the journal); load call shards with e.g.
``datasets.load_dataset("parquet", data_files="DIR/calls/*.parquet")`` or ``pyarrow.dataset``.

Guarantees:
- ``await store.append(record)`` returns only after the record is in the journal and fsync'd; many concurrent
  appends share one fsync. A shard appears only when complete (hidden temp name + fsync + rename locally,
  a completed upload remotely). After a crash (kill -9) the next store opened on the same journal replays
  the dead writer's segments into shards; a torn last entry was never acknowledged and is dropped.
- When the journal or the output cannot be written, appends raise StorageUnavailable instead of
  acknowledging; the store probes in the background and accepts appends again once it can write.
- Nothing is truncated. Within a session a prompt is stored as (reference to an earlier call, prefix length,
  tail), messages likewise (see compaction.py); readers always return full records.
"""

from polar_addon.store.compaction import ShardIntegrityError
from polar_addon.store.reader import iter_records, read_records, read_rewards, read_sessions, read_table, shard_dataset
from polar_addon.store.rewards import RewardRecord
from polar_addon.store.sessions import SessionRecord
from polar_addon.store.shards import CALLS, REWARDS, SESSIONS
from polar_addon.store.status import SessionStatus
from polar_addon.store.trace_store import SESSION_STATUSES, StorageUnavailable, TraceStore
from polar_addon.store.validate import validate_store

__all__ = [
    "CALLS",
    "REWARDS",
    "SESSIONS",
    "SESSION_STATUSES",
    "RewardRecord",
    "SessionRecord",
    "SessionStatus",
    "ShardIntegrityError",
    "StorageUnavailable",
    "TraceStore",
    "iter_records",
    "read_records",
    "read_rewards",
    "read_sessions",
    "read_table",
    "shard_dataset",
    "validate_store",
]
