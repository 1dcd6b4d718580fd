"""The write-ahead journal: what makes "acknowledged" mean "persisted".

Layout of a journal root (a local directory, never an object store: appends must be fsync-able)::

    <root>/w-<writer_id>/lock          flock'd by the live writer for as long as it runs
    <root>/w-<writer_id>/<segment>.wal append-only segments

A segment starts with MAGIC, then entries framed as ``<u32 length><u64 xxh3 of payload><payload>`` (xxh3,
not crc32: ~20x faster, and a 32k-token call is ~300 KB to check on the latency path). A batch of entries
is written with one writev() and made durable with one fdatasync() (group commit; with ``sync=False`` the
fdatasync is left to :meth:`Segment.sync`, which another thread may run beside later appends). Reading stops at the
first entry that is incomplete or fails its checksum: a torn tail is an entry whose write never completed, hence
never acknowledged. After a failed write the segment is truncated back and closed, so nothing valid ever
follows a torn entry.

A writer directory whose lock nobody holds belongs to a dead process: the next store opened on the same
journal root adopts it and replays its segments.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field

import xxhash

from polar_addon.store.shards import fsync_dir

MAGIC = b"PLRJ2\n"  # 2: xxh3 frames; calls are binary entries (entries.py), compacted only in shards
_HEADER = struct.Struct("<IQ")
_IOV_MAX = 1024  # Linux's limit on buffers per writev
SEGMENT_SUFFIX = ".wal"
PROBE_FILE = ".probe"  # written and removed by a store checking that its journal is writable again


def frame_header(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), xxhash.xxh3_64_intdigest(payload))


def frame(payload: bytes) -> bytes:
    return frame_header(payload) + payload


def parse_segment(data: bytes) -> list[bytes]:
    """The payloads of the valid prefix of a segment's bytes."""
    if not data.startswith(MAGIC):
        if len(data) >= len(MAGIC) and data.startswith(MAGIC[:4]):
            # Another format version: refuse rather than treat it as empty (its conversion would delete it).
            raise ValueError(f"journal segment in format {data[: len(MAGIC)]!r}, this polar reads {MAGIC!r}")
        return []
    payloads = []
    pos = len(MAGIC)
    size = len(data)
    while pos + _HEADER.size <= size:
        length, digest = _HEADER.unpack_from(data, pos)
        start = pos + _HEADER.size
        end = start + length
        if end > size:
            break
        payload = data[start:end]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            break
        payloads.append(payload)
        pos = end
    return payloads


def read_segment(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return parse_segment(f.read())


def segment_name(path: str) -> str:
    return os.path.basename(path).removesuffix(SEGMENT_SUFFIX)


class Segment:
    """One open, append-only segment file."""

    def __init__(self, directory: str, name: str) -> None:
        self.name = name
        self.path = os.path.join(directory, name + SEGMENT_SUFFIX)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.size = 0
        self.count = 0
        self.synced = 0  # bytes known durable; appends with sync=False leave size ahead of it until sync()
        self.opened_at = time.monotonic()
        # Held by sync() and close(): a sync on another thread must never fdatasync a closed (or reused) fd.
        self._fd_lock = threading.Lock()
        try:
            # The file's directory entry must be durable too, or a power cut could drop the whole segment.
            fsync_dir(directory)
        except OSError:
            self.close()
            raise

    def append(self, payloads: list[bytes], *, sync: bool = True) -> None:
        """Write and fdatasync a batch (``sync=False``: only write it; the kernel has it, so it survives this
        process's death but not the machine's until :meth:`sync`); on any error the file is cut back to its last
        good size."""
        # writev: a 32k-token call is ~300 KB, and joining frames would copy it twice on the latency path.
        parts = [MAGIC] if self.size == 0 else []
        for payload in payloads:
            parts += (frame_header(payload), payload)
        total = sum(map(len, parts))
        try:
            for i in range(0, len(parts), _IOV_MAX):
                chunk = parts[i : i + _IOV_MAX]
                written = os.writev(self.fd, chunk)
                if written < sum(map(len, chunk)):  # a short write (rare on a regular file): finish it
                    view = memoryview(b"".join(chunk))[written:]
                    while view:
                        view = view[os.write(self.fd, view) :]
            if sync:
                os.fdatasync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass
            raise
        self.size += total
        self.count += len(payloads)
        if sync:
            self.synced = self.size

    @property
    def unsynced(self) -> bool:
        return self.size > self.synced

    def sync(self) -> None:
        """fdatasync what was written so far, unless the segment is closed; safe beside appends on another
        thread (an append racing it is made durable by the next sync)."""
        with self._fd_lock:
            target = self.size
            if self.fd < 0 or target <= self.synced:
                return
            os.fdatasync(self.fd)
            self.synced = max(self.synced, target)

    def close(self) -> None:
        with self._fd_lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


@dataclass
class WriterDir:
    """A journal directory owned (flock'd) by one live writer, or adopted from a dead one."""

    path: str
    lock_fd: int
    adopted: bool = False
    segments: list[str] = field(default_factory=list)

    def release(self, remove: bool) -> None:
        """Remove the directory when it holds no segment left, then drop the lock."""
        if remove:
            try:
                leftovers = [n for n in os.listdir(self.path) if n.endswith(SEGMENT_SUFFIX)]
                if not leftovers:
                    os.unlink(os.path.join(self.path, "lock"))
                    # A writer killed inside its journal probe (TraceStore._probe_journal) left its probe file: no
                    # data, but it would keep the directory (lockless, so never adopted again) forever.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.path, PROBE_FILE))
                    os.rmdir(self.path)
            except OSError:
                pass
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def create_writer_dir(root: str) -> tuple[str, WriterDir]:
    """Make and lock a fresh writer directory; it appears under its final name only once locked."""
    os.makedirs(root, exist_ok=True)
    writer_id = uuid.uuid4().hex[:8]
    tmp = os.path.join(root, f".new-{writer_id}")
    os.makedirs(tmp)
    lock_fd = os.open(os.path.join(tmp, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    final = os.path.join(root, f"w-{writer_id}")
    os.rename(tmp, final)
    fsync_dir(root)
    return writer_id, WriterDir(final, lock_fd)


def adopt_orphans(root: str, own: str) -> list[WriterDir]:
    """Lock every writer directory whose writer is gone; return them with their segments, oldest first."""
    adopted: list[WriterDir] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return adopted
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith("w-") or path == own:
            continue
        try:
            lock_fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # being removed by whoever finished it
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            continue  # a live writer
        try:
            segments = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(SEGMENT_SUFFIX))
        except FileNotFoundError:
            os.close(lock_fd)
            continue
        adopted.append(WriterDir(path, lock_fd, adopted=True, segments=segments))
    return adopted


def new_segment_name(writer_id: str, counter: int) -> str:
    # Creation time first, so shard names sort chronologically; writer id and counter make it unique.
    return f"{time.time_ns():019d}-{writer_id}-{counter:06d}"
