"""TraceStore beyond its durability code (issue 29 audit, section L): what ``close()`` keeps and removes of a store
that really crashed (a child process SIGKILLed with a segment open), and the paths the earlier rounds' tests left
unchecked."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polar_addon.store import TraceStore, read_records
from polar_addon.store.journal import SEGMENT_SUFFIX
from polar_addon.store.shards import Output
from tests.test_store_basic import make_record

ROOT = Path(__file__).resolve().parents[1]

# The dead writer: three calls acknowledged (written, not sealed: the shard cut is far away), then SIGKILL.
_CRASHING_WRITER = """
import asyncio, os, signal, sys
from polar_addon.store import TraceStore
from tests.test_store_basic import make_record

async def main(out):
    store = TraceStore(out, shard_max_records=10_000, shard_max_seconds=3600, durability="write")
    for i in range(3):
        record = make_record("s", list(range(i + 1)), [7], [])
        await store.append(record)
        print(record.record_id, record.seq, store._own_dir.path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main(sys.argv[1]))
"""


# A writer that returns without closing its store (an exception before close, a CLI that forgets it): its threads
# must not hold the interpreter open, and the call it acknowledged stays in the journal for the next store.
_UNCLOSED_WRITER = """
import asyncio, sys
from polar_addon.store import TraceStore
from tests.test_store_basic import make_record

async def main(out):
    store = TraceStore(out, shard_max_records=10_000, shard_max_seconds=3600, durability="write")
    record = make_record("s", [1, 2], [7], [])
    await store.append(record)
    print(record.record_id, flush=True)

asyncio.run(main(sys.argv[1]))
"""


def _child(script: str, out: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, out],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _crash_a_writer(out: str) -> tuple[str, list[tuple[str, int]]]:
    """A writer process killed with its segment open: its directory and the calls it acknowledged."""
    done = _child(_CRASHING_WRITER, out)
    assert done.returncode == -signal.SIGKILL, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 3 and len({line[2] for line in lines}) == 1, done.stdout
    return lines[0][2], [(rid, int(seq)) for rid, seq, _ in lines]


def _lock_is_free(directory: str) -> bool:
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_closing_after_a_real_crash_keeps_the_dead_writers_segment_until_it_is_in_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "out")
    journal_root = Path(out) / "_journal"
    dead, acked = _crash_a_writer(out)
    [segment] = [name for name in os.listdir(dead) if name.endswith(SEGMENT_SUFFIX)]
    assert sorted(os.listdir(dead)) == sorted(["lock", segment])
    assert _lock_is_free(dead)

    # The output refuses shards: the store adopts the dead writer's directory but cannot replay it.
    def read_only(self: Output, *args: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    write_shard = Output.write_shard
    monkeypatch.setattr(Output, "write_shard", read_only)
    store = TraceStore(out)
    own = store._own_dir.path
    assert store.pending_segments == 1
    assert not _lock_is_free(dead)  # adopted: held while this store may still convert it
    store.close()
    # Close keeps the dead writer's segment and lock file, removes only its own directory, and lets go of the lock,
    # so the next store can adopt the directory.
    assert sorted(p.name for p in journal_root.iterdir()) == [os.path.basename(dead)]
    assert sorted(os.listdir(dead)) == sorted(["lock", segment])
    assert not os.path.exists(own)
    assert _lock_is_free(dead)
    assert list(Path(out).glob("*/*.parquet")) == []  # no shard yet (read_records would read the journal too)

    # With the output back, the next store replays the acknowledged calls at open; closing it leaves no journal.
    monkeypatch.setattr(Output, "write_shard", write_shard)
    store = TraceStore(out)
    assert store.pending_segments == 0 and not os.path.exists(dead)
    store.close()
    assert list(journal_root.iterdir()) == []
    assert [(r.record_id, r.seq) for r in read_records(out)] == acked
    assert [seq for _, seq in acked] == [0, 1, 2]


@pytest.mark.parametrize("durability", ["fsync", "write"])
def test_only_fsync_durability_makes_the_answer_wait_for_an_fdatasync(
    durability: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fsync``: each append is fdatasync'd on the path of its answer (the caller's thread or the journal writer);
    ``write``: never there, only on the sync thread behind it."""
    synced_on: list[threading.Thread] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced_on.append(threading.current_thread()), real(fd))[1])

    async def main() -> tuple[set[str], int, int]:
        store = TraceStore(str(tmp_path), durability=durability)
        roles = {threading.main_thread(): "caller", store._writer: "writer", store._syncer: "sync thread"}
        for i in range(3):
            await store.append(make_record("s", list(range(i + 1)), [7], []))
        segment = store._segment
        assert segment is not None
        deadline = time.monotonic() + 10
        while segment.unsynced and time.monotonic() < deadline:  # the sync thread runs just behind
            await asyncio.sleep(0.01)
        where = {roles.get(thread, thread.name) for thread in synced_on}
        await store.aclose()
        return where, segment.synced, segment.size

    where, synced, size = asyncio.run(main())
    assert synced == size > 0
    if durability == "fsync":
        assert where and where <= {"caller", "writer"}
    else:
        assert where == {"sync thread"}


def test_a_store_left_open_never_keeps_its_process_from_exiting(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    try:
        done = _child(_UNCLOSED_WRITER, out, timeout_s=30)  # it exits in about 2 s
    except subprocess.TimeoutExpired:
        pytest.fail("a store that was not closed kept its process alive past 30 s (a non-daemon thread)")
    assert done.returncode == 0, done.stderr
    [record_id] = done.stdout.split()
    with TraceStore(out):
        pass  # replays the dead writer's segment
    assert [(r.record_id, r.seq) for r in read_records(out)] == [(record_id, 0)]
    assert list((Path(out) / "_journal").iterdir()) == []


def test_a_writer_directory_left_with_a_probe_file_is_still_removed(tmp_path: Path) -> None:
    from polar_addon.store import journal

    _, writer = journal.create_writer_dir(str(tmp_path / "journal"))
    Path(writer.path, journal.PROBE_FILE).write_bytes(b"\0" * 16)  # a writer killed inside its journal probe
    writer.release(remove=True)
    assert not Path(writer.path).exists()
    _, kept = journal.create_writer_dir(str(tmp_path / "journal"))
    Path(kept.path, "seg-1" + journal.SEGMENT_SUFFIX).write_bytes(b"data")
    Path(kept.path, journal.PROBE_FILE).write_bytes(b"")
    kept.release(remove=True)
    assert sorted(p.name for p in Path(kept.path).iterdir()) == [journal.PROBE_FILE, "lock", "seg-1.wal"]
