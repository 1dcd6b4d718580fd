"""Where shards live and what they hold: the output filesystem, the three shard schemas, atomic writes.

The output is a local directory or any pyarrow filesystem URI (``s3://bucket/prefix?endpoint_override=...``).
A shard becomes visible to readers only once complete: locally it is written under a hidden temporary
name, fsync'd and renamed; on an object store the upload itself is atomic (an unfinished multipart upload
never appears as an object), so it is written straight to its final key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

CALLS = "calls"
SESSIONS = "sessions"
REWARDS = "rewards"
KINDS = (CALLS, SESSIONS, REWARDS)
# Journal entries that could not become rows (one JSON line each: segment, entry index, reason, entry bytes).
QUARANTINE_DIR = "_quarantine"

_TOKENS = pa.list_(pa.int32())

# Columns added after the first release: older shards lack them, and readers see nulls there.
LATER_COLUMNS = frozenset(
    {
        "min_p", "prompt_source", "prompt_reason", "parse_failures", "tool_call_parser", "role", "role_reason",
        "weight_versions_json",
    }
)  # fmt: skip

CALLS_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("api", pa.string()),
        pa.field("status", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("harness", pa.string()),
        pa.field("requested_model", pa.string()),
        pa.field("served_model", pa.string()),
        pa.field("engine", pa.string()),
        pa.field("started_at", pa.float64()),
        pa.field("engine_latency_s", pa.float64()),
        pa.field("finished_at", pa.float64()),
        pa.field("temperature", pa.float64()),
        pa.field("top_p", pa.float64()),
        pa.field("top_k", pa.int64()),
        pa.field("min_p", pa.float64()),
        pa.field("max_tokens", pa.int64()),
        # The prompt is prompt_ids[:prompt_prefix_len] of the call `prompt_ref` (its prompt followed by its
        # response, same session) plus prompt_tail; prompt_ref is null when the tail is the whole prompt.
        pa.field("prompt_len", pa.int64()),
        pa.field("prompt_ref", pa.string()),
        pa.field("prompt_prefix_len", pa.int64()),
        pa.field("prompt_tail", _TOKENS),
        pa.field("response_ids", _TOKENS),
        pa.field("logprobs", pa.list_(pa.float64())),
        pa.field("finish_reason", pa.string()),
        pa.field("matched_stop", pa.string()),
        pa.field("weight_version", pa.string()),
        # The messages are the first messages_prefix_len messages of `messages_ref` (its messages followed by
        # its response as an OpenAI assistant message) plus the JSON array messages_tail_json.
        pa.field("messages_count", pa.int64()),
        pa.field("messages_ref", pa.string()),
        pa.field("messages_prefix_len", pa.int64()),
        pa.field("messages_tail_json", pa.string()),
        pa.field("tools_json", pa.string()),
        pa.field("tool_choice_json", pa.string()),
        pa.field("response_json", pa.string()),
        pa.field("error", pa.string()),
        pa.field("prompt_source", pa.string()),
        pa.field("prompt_reason", pa.string()),
        # Tool-call blocks polar's parser could not read; null: not parsed by polar.
        pa.field("parse_failures", pa.int64()),
        # Who produced the tool calls: engine, a polar_tool_parser name, or fenced_json; null: no calls.
        pa.field("tool_call_parser", pa.string()),
        # What the call is for: agent, auxiliary or discarded (polar_addon.call_roles), and which side job or why.
        pa.field("role", pa.string()),
        pa.field("role_reason", pa.string()),
        # Which weight version sampled which response tokens, as the engine reported it (vLLM's scale-out
        # generate: a push during the call, polar loop --drain keep): a JSON array of {"version", "start", "end"}
        # over response token indexes. Null: the engine reported no per-token versions (weight_version holds all).
        pa.field("weight_versions_json", pa.string()),
    ]
)

# One row per session_update call; a null column means "not changed by this update".
SESSIONS_SCHEMA = pa.schema(
    [
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("updated_at", pa.float64()),
        pa.field("task_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("harness", pa.string()),
        pa.field("status", pa.string()),
        pa.field("started_at", pa.float64()),
        pa.field("ended_at", pa.float64()),
        pa.field("metadata_json", pa.string()),  # a JSON object merged into the session's metadata
    ]
)

REWARDS_SCHEMA = pa.schema(
    [
        pa.field("reward_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("source", pa.string()),
        pa.field("created_at", pa.float64()),
    ]
)

# Stamped into every shard, so a later layout can tell old shards apart.
FORMAT = {b"polar.store.format": b"1"}
CALLS_SCHEMA = CALLS_SCHEMA.with_metadata(FORMAT)
SESSIONS_SCHEMA = SESSIONS_SCHEMA.with_metadata(FORMAT)
REWARDS_SCHEMA = REWARDS_SCHEMA.with_metadata(FORMAT)
SCHEMAS = {CALLS: CALLS_SCHEMA, SESSIONS: SESSIONS_SCHEMA, REWARDS: REWARDS_SCHEMA}

# Dictionary-encode the strings that repeat (a harness's tool list is the same on every call); ids, token
# arrays and per-call texts are unique, and a dictionary page would only cost time there.
_UNIQUE = {"record_id", "reward_id", "prompt_ref", "messages_ref", "messages_tail_json", "response_json"}
_DICT_COLUMNS = sorted(
    {f.name for s in SCHEMAS.values() for f in s if pa.types.is_string(f.type) and f.name not in _UNIQUE}
)


@dataclass(frozen=True)
class Output:
    """The root of a store: a filesystem and a path in it."""

    uri: str
    fs: pafs.FileSystem
    root: str
    local: bool

    @staticmethod
    def local_root(uri: str) -> str | None:
        """The directory of a local store's URI; None for a remote one (no filesystem is contacted)."""
        if "://" not in uri or uri.startswith("file://"):
            return os.path.abspath(os.path.expanduser(uri.removeprefix("file://")))
        return None

    @classmethod
    def from_uri(cls, uri: str) -> Output:
        path = cls.local_root(uri)
        if path is not None:
            return cls(uri, pafs.LocalFileSystem(), path, True)
        fs, path = pafs.FileSystem.from_uri(uri)
        return cls(uri, fs, path.rstrip("/"), False)

    def kind_dir(self, kind: str) -> str:
        return f"{self.root}/{kind}"

    def shard_path(self, kind: str, name: str) -> str:
        return f"{self.root}/{kind}/{name}.parquet"

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def list_shards(self, kind: str) -> list[str]:
        """Complete shards of one kind, oldest first (names start with the segment's creation time)."""
        selector = pafs.FileSelector(self.kind_dir(kind), allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return sorted(
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and i.base_name.endswith(".parquet")
            and not i.base_name.startswith((".", "_"))
        )

    def write_shard(self, kind: str, name: str, table: pa.Table) -> str:
        final = self.shard_path(kind, name)
        if not self.local:
            self.fs.create_dir(self.kind_dir(kind), recursive=True)
            with self.fs.open_output_stream(final) as sink:
                _write_parquet(table, sink)
            return final
        directory = self.kind_dir(kind)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{name}.parquet.tmp")
        with open(tmp, "wb") as f:
            _write_parquet(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(directory)
        return final

    def remove_stale_tmp(self, kind: str, name: str) -> None:
        """A crash between write and rename leaves a hidden temp file; readers ignore it, this removes it."""
        if self.local:
            try:
                os.unlink(os.path.join(self.kind_dir(kind), f".{name}.parquet.tmp"))
            except FileNotFoundError:
                pass

    def quarantine_path(self, name: str) -> str:
        return f"{self.root}/{QUARANTINE_DIR}/{name}.jsonl"

    def write_quarantine(self, name: str, data: bytes) -> None:
        """Journal entries of segment ``name`` that cannot become rows: kept whole, beside the shards."""
        final = self.quarantine_path(name)
        if not self.local:
            self.fs.create_dir(f"{self.root}/{QUARANTINE_DIR}", recursive=True)
            with self.fs.open_output_stream(final) as sink:
                sink.write(data)
            return
        directory = os.path.dirname(final)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{name}.jsonl.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(directory)

    def list_quarantine(self) -> list[str]:
        selector = pafs.FileSelector(f"{self.root}/{QUARANTINE_DIR}", allow_not_found=True)
        return sorted(
            i.path
            for i in self.fs.get_file_info(selector)
            if i.type == pafs.FileType.File and i.base_name.endswith(".jsonl") and not i.base_name.startswith(".")
        )

    def probe(self) -> None:
        """Raise OSError unless a file can be created in the output right now."""
        path = f"{self.root}/.probe-{os.getpid()}-{id(self):x}"
        if self.local:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(path)
            return
        self.fs.create_dir(self.root, recursive=True)
        with self.fs.open_output_stream(path) as sink:
            sink.write(b"probe")
        self.fs.delete_file(path)


def _write_parquet(table: pa.Table, sink: object) -> None:
    pq.write_table(
        table,
        sink,
        compression="zstd",
        compression_level=3,
        use_dictionary=[c for c in _DICT_COLUMNS if c in table.column_names],
        write_statistics=["session_id", "seq", "record_id"],
    )


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
