"""TraceStore: the writer. Appends go to the local journal (durable when acknowledged), shards follow.

Two threads do the work, so the event loop blocks on the disk for at most one fast fsync:
- the journal writer takes every queued append, encodes it whole (entries.py), writes the batch with one
  writev() + fdatasync() (group commit) and only then resolves the callers' futures; it seals the current
  segment when it holds ``shard_max_records`` entries or is ``shard_max_seconds`` old. When nothing else
  is being written and fsyncs are fast, an append is written the same way on the caller's own thread
  (``_write_inline``: cheaper than waking the writer);
- the shard writer turns each sealed segment into one shard per kind, named after the segment (so a replay
  after a crash rewrites the same names and never duplicates), compacting prompts and messages into
  prefix references on the way (compaction.py), then deletes the segment.
When the output or the journal fails, the store says so (StorageUnavailable) instead of acknowledging, and
keeps probing until it works again.

``durability``: ``fsync`` (the default) acknowledges an append once it is fdatasync'd, so it survives a power cut;
``write`` acknowledges it once it is written to the segment (the kernel holds it: it survives the proxy's death,
SIGKILL included, but a power cut or kernel crash may drop the last few milliseconds of answered calls) and a third
thread fdatasyncs behind the appends. ``write`` takes the fsync (~0.5-3 ms a call on a VM disk) off every answer.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds

from polar_addon.capture import CaptureRecord
from polar_addon.store import journal
from polar_addon.store.compaction import SessionTips, StagedTips, encode_segment
from polar_addon.store.entries import call_entry, entry_header, row_entry
from polar_addon.store.rewards import check_reward
from polar_addon.store.shards import CALLS, REWARDS, SCHEMAS, SESSIONS, Output
from polar_addon.store.status import STORED_STATUSES, SessionStatus

log = logging.getLogger("polar.store")

SESSION_STATUSES: tuple[str, ...] = tuple(s.value for s in STORED_STATUSES)  # plain strings: messages list them
_SESSION_FIELDS = ("task_id", "group_id", "sample_index", "harness", "status", "started_at", "ended_at", "metadata")
_RETRY_INTERVAL_S = 0.5


class StorageUnavailable(Exception):
    """The store cannot persist right now; ``reason`` says why. Callers answer 503 and retry later."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def default_journal_dir(out: Output) -> str:
    """Next to the shards for a local store (same disk, same fate); a local cache dir for a remote one."""
    if out.local:
        return os.path.join(out.root, "_journal")
    base = os.environ.get("POLAR_JOURNAL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "polar", "journal"
    )
    return os.path.join(base, hashlib.sha256(out.uri.encode()).hexdigest()[:16])


def segment_tables(payloads: list[bytes], tips: StagedTips) -> dict[str, pa.Table]:
    rows = encode_segment(payloads, tips)
    return {k: pa.Table.from_pylist(r, schema=SCHEMAS[k]) for k, r in rows.items() if r}


def entry_problem(payload: bytes) -> str | None:
    """Why this one journal entry cannot become a row (None when it can), checked on its own."""
    try:
        segment_tables([payload], SessionTips(1).staged())
    except Exception as exc:  # whatever the entry holds, the answer is "this one cannot be stored"
        return f"{type(exc).__name__}: {exc}"[:2000]
    return None


def split_segment(payloads: list[bytes]) -> tuple[list[bytes], list[tuple[int, bytes, str]]]:
    """The entries that can become rows, and the others as (index, entry, reason)."""
    good: list[bytes] = []
    bad: list[tuple[int, bytes, str]] = []
    for index, payload in enumerate(payloads):
        problem = entry_problem(payload)
        if problem is None:
            good.append(payload)
        else:
            bad.append((index, payload, problem))
    return good, bad


def quarantine_lines(segment: str, bad: list[tuple[int, bytes, str]]) -> bytes:
    return b"".join(
        orjson.dumps(
            {"segment": segment, "entry": index, "reason": reason, "payload_b64": base64.b64encode(payload).decode()}
        )
        + b"\n"
        for index, payload, reason in bad
    )


# ---- the store ---------------------------------------------------------------------------------------------


@dataclass
class _Item:
    kind: str
    payload: Any  # CaptureRecord for calls, a row dict otherwise
    loop: asyncio.AbstractEventLoop | None  # None: written inline, on the caller's own thread
    future: asyncio.Future | None


DURABILITY = ("fsync", "write")

_STOP = object()
_WAKE = object()  # makes the writer thread re-read the segment's age (an inline write opened one)
# An inline write that took longer than this (a slow disk) sends appends to the writer thread for a while.
_INLINE_MAX_S = 0.002
_INLINE_BACKOFF_S = 10.0


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class TraceStore:
    """Durable, compact capture store. See polar_addon.store for the layout and the guarantees."""

    def __init__(
        self,
        uri: str,
        *,
        shard_max_records: int = 512,
        shard_max_seconds: float = 30.0,
        journal_dir: str | None = None,
        max_cached_sessions: int = 1024,
        durability: str = "fsync",
    ) -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY)}, not {durability!r}")
        self.durability = durability
        self.output = Output.from_uri(uri)
        self.uri = uri
        self.journal_root = os.path.abspath(os.path.expanduser(journal_dir or default_journal_dir(self.output)))
        self.shard_max_records = shard_max_records
        self.shard_max_seconds = shard_max_seconds

        self._closed = False
        self._output_error: str | None = None
        self._journal_error: str | None = None
        # Writer-thread state.
        self._segment: journal.Segment | None = None
        self._segment_counter = 0
        self._next_seq: dict[str, int] | None = None  # built from what is persisted on the first call
        # Shard-writer state (under _convert_lock): what later calls of a session may reference.
        self._tips = SessionTips(max_cached_sessions)
        # Shared with the shard writer: segments sealed but not yet in shards (guarded by _pending_lock);
        # _convert_lock keeps the one-time seq scan from racing a conversion.
        self._pending_lock = threading.Lock()
        self._convert_lock = threading.Lock()
        # Journal state (_segment, _segment_counter, _next_seq) belongs to whoever holds _write_lock: the
        # writer thread, or an append written inline.
        self._write_lock = threading.Lock()
        self._inline_after = 0.0
        self._unconverted: dict[str, journal.WriterDir | None] = {}
        # Sessions this process stored as error, with why: error is final for every reader (merge_sessions), so a
        # later status post is answered with it (ControlPlane), and the poster's own summary can agree with the store.
        self._errored: dict[str, str] = {}

        try:
            self.writer_id, self._own_dir = journal.create_writer_dir(self.journal_root)
            self._adopted = journal.adopt_orphans(self.journal_root, self._own_dir.path)
        except OSError as exc:
            raise StorageUnavailable(f"cannot create the trace journal in {self.journal_root}: {exc}") from exc
        for wd in self._adopted:
            for path in wd.segments:
                self._unconverted[path] = wd
            if not wd.segments:
                wd.release(remove=True)
        self._replay()

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._flush_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._writer_loop, name="polar-journal", daemon=True)
        self._flusher = threading.Thread(target=self._flusher_loop, name="polar-shards", daemon=True)
        self._writer.start()
        self._flusher.start()
        # durability=write: the journal's fdatasyncs, off the appends' path (the answer does not wait for them).
        self._sync_wanted = threading.Event()
        self._syncer: threading.Thread | None = None
        if durability == "write":
            self._syncer = threading.Thread(target=self._sync_loop, name="polar-journal-sync", daemon=True)
            self._syncer.start()

    # -- public API ------------------------------------------------------------------------------------------

    async def append(self, record: CaptureRecord) -> None:
        """Assign ``record.seq`` and return once the record is durable; StorageUnavailable if it cannot be."""
        self.check_writable(journal_too=False)
        await self._submit(CALLS, record)

    def check_writable(self, journal_too: bool = True) -> None:
        """Raise StorageUnavailable when the store currently cannot persist (a flag read, no I/O)."""
        if self._closed:
            raise StorageUnavailable("the trace store is closed")
        if self._output_error:
            raise StorageUnavailable(self._output_error)
        if journal_too and self._journal_error:
            raise StorageUnavailable(self._journal_error)

    async def session_update(self, session_id: str, **fields: Any) -> None:
        """Record session fields (task_id, group_id, sample_index, harness, status, started_at, ended_at,
        metadata); later updates win field by field, metadata dicts are merged."""
        unknown = set(fields) - set(_SESSION_FIELDS)
        if unknown:
            raise TypeError(f"unknown session fields: {sorted(unknown)}")
        status = fields.get("status")
        if status is not None and status not in SESSION_STATUSES:
            raise ValueError(f"status must be one of {SESSION_STATUSES}, got {status!r}")
        row: dict[str, Any] = {"session_id": session_id, "updated_at": time.time()}
        for name in _SESSION_FIELDS:
            if name == "metadata":
                metadata = fields.get("metadata")
                if metadata is not None and not isinstance(metadata, dict):
                    raise TypeError(f"session metadata must be a dict, got {type(metadata).__name__}")
                row["metadata_json"] = None if metadata is None else orjson.dumps(metadata).decode()
            else:
                row[name] = fields.get(name)
        self.check_writable(journal_too=False)
        await self._submit(SESSIONS, row)
        if status == SessionStatus.ERROR and session_id not in self._errored:
            metadata = fields.get("metadata") or {}
            self._errored[session_id] = str(metadata.get("error") or metadata.get("reason") or "error")

    def final_status(self, session_id: str, posted: str) -> tuple[str, str | None]:
        """The status readers will see for ``session_id`` once ``posted`` is stored, and why when it is not
        ``posted``: an ``error`` this process stored earlier stands (the proxy ended the session, e.g. its engine
        was taken out mid-session)."""
        reason = self._errored.get(session_id)
        if reason is not None and posted != SessionStatus.ERROR:
            return SessionStatus.ERROR.value, reason
        return posted, None

    async def add_reward(self, session_id: str, value: float, name: str = "reward", source: str = "api") -> None:
        value, name = check_reward(value, name)
        row = {
            "reward_id": os.urandom(16).hex(),
            "session_id": session_id,
            "name": name,
            "value": value,
            "source": source,
            "created_at": time.time(),
        }
        self.check_writable(journal_too=False)
        await self._submit(REWARDS, row)

    def close(self) -> None:
        """Seal the journal and write every pending segment into shards (what cannot be written now stays in
        the journal and is replayed by the next store opened on it)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()  # seals the last segment, fdatasync'd first
        if self._syncer is not None:
            self._sync_wanted.set()
            self._syncer.join()
        self._flush_queue.put(_STOP)
        self._flusher.join()
        with self._pending_lock:
            left = list(self._unconverted)
        if left:
            log.warning(
                "trace store closed with %d journal segments not in shards yet (%s): %s",
                len(left),
                self._output_error,
                self.journal_root,
            )
        self._own_dir.release(remove=True)
        for wd in self._adopted:
            wd.release(remove=not wd.segments)

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> TraceStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def pending_segments(self) -> int:
        with self._pending_lock:
            return len(self._unconverted)

    # -- submission ------------------------------------------------------------------------------------------

    async def _submit(self, kind: str, payload: Any) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._write_inline(_Item(kind, payload, None, future)):
            self._queue.put(_Item(kind, payload, loop, future))
        await future

    def _write_inline(self, item: _Item) -> bool:
        """Write and fsync on the caller's thread when nothing else is being written.

        On an idle proxy (one agent waiting on each call) handing the write to the writer thread costs
        two cross-CPU wake-ups, ~0.2-0.3 ms on a VM; writing here blocks the event loop for one fsync
        instead. Under load the queue is rarely empty and appends group-commit on the writer thread; after
        a slow fsync (over _INLINE_MAX_S) they all go there for a while, so a slow disk never stalls the
        event loop for long.
        """
        if (
            self._closed
            or self._next_seq is None
            or not self._queue.empty()
            or time.monotonic() < self._inline_after
            or not self._write_lock.acquire(blocking=False)
        ):
            return False
        try:
            opened = self._segment is None
            start = time.monotonic()
            try:
                self._write_batch([item])
            except BaseException as exc:  # never leave the caller waiting forever
                self._resolve(item, exc)
                log.exception("journal write failed")
            # Opening a segment fsyncs its directory too: only plain appends tell the disk's speed.
            if not opened and time.monotonic() - start > _INLINE_MAX_S:
                self._inline_after = time.monotonic() + _INLINE_BACKOFF_S
            self._seal_if_due()
            if opened and self._segment is not None:
                self._queue.put(_WAKE)  # the writer thread seals it when it gets old
        finally:
            self._write_lock.release()
        return True

    @staticmethod
    def _resolve(item: _Item, error: BaseException | None) -> None:
        if item.future is None:
            return
        if item.loop is None:  # written inline: we are on the caller's loop
            _settle(item.future, error)
            return
        try:
            item.loop.call_soon_threadsafe(_settle, item.future, error)
        except RuntimeError:
            pass  # the caller's loop is gone; nobody is waiting

    # -- journal writer thread -------------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        while True:
            timeout = None
            with self._write_lock:
                if self._segment is not None and self._segment.count:
                    timeout = max(0.0, self.shard_max_seconds - (time.monotonic() - self._segment.opened_at))
            try:
                first = self._queue.get(timeout=timeout)
            except queue.Empty:
                with self._write_lock:
                    self._seal_if_due()
                continue
            items = [first]
            while len(items) < 4096:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(i is _STOP for i in items)
            items = [i for i in items if i is not _STOP and i is not _WAKE]
            with self._write_lock:
                if items:
                    try:
                        self._write_batch(items)
                    except BaseException as exc:  # never leave a caller waiting forever
                        for item in items:
                            self._resolve(item, exc)
                        log.exception("journal batch failed")
                self._seal_if_due()
                if stop:
                    self._seal()
                    return

    def _sync_loop(self) -> None:
        while not self._closed:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            segment = self._segment  # sealed meanwhile: _seal syncs it itself
            if segment is None:
                continue
            try:
                segment.sync()
            except OSError as exc:
                # Already acknowledged (durability=write's bargain): say so loudly; the next seal tries again.
                log.error("cannot fdatasync the trace journal segment %s: %s", segment.path, exc)

    def _seal_if_due(self) -> None:
        if self._segment is not None and (
            self._segment.count >= self.shard_max_records
            or time.monotonic() - self._segment.opened_at >= self.shard_max_seconds
        ):
            self._seal()

    def _write_batch(self, items: list[_Item]) -> None:
        payloads: list[bytes] = []
        accepted: list[tuple[_Item, int | None]] = []
        seq_overlay: dict[str, int] = {}
        for item in items:
            seq = None
            try:
                if item.kind == CALLS:
                    self._ensure_seq_index()
                    assert self._next_seq is not None
                    record: CaptureRecord = item.payload
                    sid = record.session_id
                    seq = seq_overlay.get(sid, self._next_seq.get(sid, 0))
                    payload = call_entry(record, seq)
                    seq_overlay[sid] = seq + 1
                else:
                    payload = row_entry(item.kind, item.payload)
            except Exception as exc:
                self._resolve(item, exc)
                continue
            payloads.append(payload)
            accepted.append((item, seq))
        if not payloads:
            return
        try:
            if self._segment is None:
                self._segment_counter += 1
                name = journal.new_segment_name(self.writer_id, self._segment_counter)
                self._segment = journal.Segment(self._own_dir.path, name)
            self._segment.append(payloads, sync=self.durability == "fsync")
        except OSError as exc:
            reason = f"cannot write the trace journal in {self.journal_root}: {exc}"
            self._journal_error = reason
            log.error("%s", reason)
            self._seal()  # never append after a failed write: nothing valid may follow a torn entry
            self._flush_queue.put(None)  # wake the shard writer: it probes until the journal works again
            error = StorageUnavailable(reason)
            for item, _ in accepted:
                self._resolve(item, error)
            return
        self._journal_error = None
        assert self._next_seq is not None or not seq_overlay
        if seq_overlay:
            self._next_seq.update(seq_overlay)  # type: ignore[union-attr]
        for item, seq in accepted:
            if seq is not None:
                item.payload.seq = seq
            self._resolve(item, None)
        if self._syncer is not None:
            self._sync_wanted.set()

    def _seal(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        try:
            segment.sync()  # durability=write: what was only written; a no-op otherwise
        except OSError as exc:
            log.error("cannot fdatasync the trace journal segment %s: %s", segment.path, exc)
        segment.close()
        if segment.count == 0:
            try:
                os.unlink(segment.path)
            except OSError:
                pass
            return
        with self._pending_lock:
            self._unconverted[segment.path] = None
        self._flush_queue.put(segment.path)

    def _ensure_seq_index(self) -> None:
        """Sequence numbers continue from what earlier runs persisted (shards and unreplayed segments)."""
        if self._next_seq is not None:
            return
        try:
            with self._convert_lock:
                next_seq: dict[str, int] = {}
                paths = self.output.list_shards(CALLS)
                if paths:
                    table = ds.dataset(paths, format="parquet", filesystem=self.output.fs).to_table(
                        columns=["session_id", "seq"]
                    )
                    grouped = table.group_by("session_id").aggregate([("seq", "max")])
                    for sid, top in zip(grouped["session_id"].to_pylist(), grouped["seq_max"].to_pylist()):
                        next_seq[sid] = top + 1
                with self._pending_lock:
                    pending = list(self._unconverted)
                for path in pending:
                    for payload in journal.read_segment(path):
                        kind, row = entry_header(payload)
                        if kind == CALLS:
                            sid = row["session_id"]
                            next_seq[sid] = max(next_seq.get(sid, 0), row["seq"] + 1)
        except (OSError, pa.ArrowInvalid) as exc:  # unreadable, or a shard that is not Parquet
            raise StorageUnavailable(f"cannot read existing shards in {self.uri}: {exc}") from exc
        self._next_seq = next_seq

    # -- shard writer thread ---------------------------------------------------------------------------------

    def _convert(self, path: str) -> None:
        """One sealed segment -> one shard per kind it holds, then the segment is deleted. Idempotent."""
        name = journal.segment_name(path)
        with self._convert_lock:
            # Tips are the entries' own tokens: a replayed segment already in shards still yields valid ones.
            payloads = journal.read_segment(path)
            tips = self._tips.staged()
            try:
                tables = segment_tables(payloads, tips)
            except Exception:
                # One entry that cannot become a row must not stop the store (nor this segment's other
                # entries): it is quarantined beside the shards and `polar shards validate` reports it.
                good, bad = split_segment(payloads)
                if not bad:
                    raise
                log.error("segment %s: %d entries quarantined (%s)", name, len(bad), bad[0][2])
                self.output.write_quarantine(name, quarantine_lines(name, bad))
                tips = self._tips.staged()
                tables = segment_tables(good, tips)
            for kind, table in tables.items():
                if not self.output.exists(self.output.shard_path(kind, name)):
                    self.output.write_shard(kind, name, table)
                self.output.remove_stale_tmp(kind, name)
            self._tips.commit(tips)
            with self._pending_lock:
                owner = self._unconverted.pop(path, None)
            os.unlink(path)
        if owner is not None:
            owner.segments.remove(path)
            if not owner.segments:
                owner.release(remove=True)

    def _replay(self) -> None:
        """Segments left by dead writers go into shards before this store accepts anything."""
        for path in sorted(self._unconverted):
            try:
                self._convert(path)
            except Exception as exc:
                self._output_error = f"cannot write shards to {self.uri}: {exc}"
                log.error("replay of %s failed: %s", path, exc)
                break
        if self._unconverted:
            log.info("%d journal segments wait for the output", len(self._unconverted))

    def _flusher_loop(self) -> None:
        stopping = False
        while True:
            with self._pending_lock:
                backlog = sorted(self._unconverted)
            trouble = self._output_error or self._journal_error
            try:
                item = self._flush_queue.get(timeout=_RETRY_INTERVAL_S if (trouble or backlog) else None)
                stopping = stopping or item is _STOP
            except queue.Empty:
                pass
            with self._pending_lock:
                backlog = sorted(self._unconverted)
            for path in backlog:
                try:
                    self._convert(path)
                except Exception as exc:
                    reason = f"cannot write shards to {self.uri}: {exc}"
                    log.error("%s", reason)  # logged before the refusals begin: whoever is refused finds why
                    self._output_error = reason
                    break
            else:
                if self._output_error:
                    self._probe_output()
            if self._journal_error:
                self._probe_journal()
            if stopping:
                return

    def _probe_output(self) -> None:
        try:
            self.output.probe()
        except Exception as exc:
            self._output_error = f"cannot write shards to {self.uri}: {exc}"
            return
        log.info("output %s is writable again", self.uri)
        self._output_error = None

    def _probe_journal(self) -> None:
        path = os.path.join(self._own_dir.path, journal.PROBE_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b"\0" * 65536)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError as exc:
            self._journal_error = f"cannot write the trace journal in {self.journal_root}: {exc}"
            return
        self._journal_error = None
