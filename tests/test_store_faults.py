"""Disk full and read-only output: appends fail loudly (StorageUnavailable), recover by themselves, lose nothing.

Run as a script, this file is a store worker driven line by line over stdin (used to run the store as an
unprivileged user, since root ignores permission bits).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pytest

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store import StorageUnavailable, TraceStore, read_records
from polar_addon.store.validate import validate_store

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


def _record(rng: random.Random, session_id: str, prompt_tokens: int) -> CaptureRecord:
    response = [rng.randrange(100_000) for _ in range(20)]
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=session_id,
        seq=-1,
        api="openai_chat",
        status="ok",
        prompt_ids=[rng.randrange(100_000) for _ in range(prompt_tokens)],
        response_ids=response,
        logprobs=[-0.5] * len(response),
        finish_reason="stop",
        messages_json=orjson.dumps([{"role": "user", "content": "q" * prompt_tokens}]).decode(),
    )


async def _wait_writable(store: TraceStore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.check_writable()
            return
        except StorageUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _wait_converted(store: TraceStore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.pending_segments:
        assert time.monotonic() < deadline, f"{store.pending_segments} journal segments never became shards"
        await asyncio.sleep(0.05)


def _cannot_run(reason: str) -> None:
    # CI runs as root and can mount: there a missing tmpfs is a broken setup, not a reason to skip.
    if os.environ.get("CI"):
        pytest.fail(f"the disk-full test must run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture
def small_tmpfs():
    if os.geteuid() != 0:
        _cannot_run("mounting a size-limited tmpfs needs root")
    mount_point = Path(tempfile.mkdtemp(prefix="polar-tmpfs-"))
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        mount_point.rmdir()
        _cannot_run(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
        mount_point.rmdir()


def _fill(path: Path, leave: int) -> None:
    """Grow ``path`` (created beforehand: on a full tmpfs even creating a file fails) until about ``leave``
    bytes of its filesystem remain."""
    stat = os.statvfs(path.parent)
    free = stat.f_bavail * stat.f_frsize
    # Unbuffered: a buffered file cut short by ENOSPC raises again when close() flushes the rest.
    with open(path, "ab", buffering=0) as f:
        try:
            f.write(b"\0" * max(0, free - leave))
        except OSError:
            pass


@pytest.mark.timeout(120)
def test_disk_full_refuses_then_recovers_with_nothing_lost(small_tmpfs: Path) -> None:
    out = small_tmpfs / "shards"
    filler, filler2 = small_tmpfs / "filler", small_tmpfs / "filler2"
    filler.touch()
    filler2.touch()
    rng = random.Random(7)
    acknowledged: list[CaptureRecord] = []
    refused = 0

    async def main() -> None:
        nonlocal refused
        async with TraceStore(str(out), shard_max_records=4) as store:
            for _ in range(6):
                record = _record(rng, "s", 300)
                await store.append(record)
                acknowledged.append(record)
            await _wait_writable(store)
            # Leave less room than one 200k-token entry: its write is cut short, then cut back.
            _fill(filler, leave=256 << 10)
            with pytest.raises(StorageUnavailable, match="No space left"):
                await store.append(_record(rng, "s", 200_000))
            refused += 1
            # The shard writer converts (then deletes) the segment that failure sealed: let it finish
            # before filling the rest, or the room it frees afterwards lets the journal probe succeed.
            await _wait_converted(store)
            _fill(filler2, leave=0)
            # Entries far larger than what the background shard writer can free meanwhile (it deletes
            # converted journal segments of a few KiB): a small one could still slip into that room.
            for _ in range(3):
                with pytest.raises(StorageUnavailable):
                    await store.append(_record(rng, "s", 50_000))
                refused += 1
            with pytest.raises(StorageUnavailable):
                store.check_writable()
            filler.unlink()
            filler2.unlink()
            await _wait_writable(store)
            for _ in range(6):
                record = _record(rng, "s", 300)
                await store.append(record)
                acknowledged.append(record)

    asyncio.run(main())
    assert refused == 4
    stored = read_records(str(out))
    assert [r.record_id for r in stored] == [r.record_id for r in acknowledged]
    assert [r.seq for r in stored] == list(range(12))
    assert all(s.prompt_ids == a.prompt_ids for s, a in zip(stored, acknowledged))
    assert validate_store(str(out)) == []


class Worker:
    """A TraceStore in a child process, optionally running as an unprivileged user."""

    def __init__(self, out: Path, as_nobody: bool) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        args = [sys.executable, __file__, str(out)] + (["--nobody"] if as_nobody else [])
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        assert self.ask("") == "ready", self.proc.stderr.read() if self.proc.stderr else ""

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        if not line:
            raise AssertionError(f"worker died: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return line

    def close(self) -> None:
        assert self.ask("close") == "closed"
        self.proc.wait(timeout=30)


def _chmod_tree(path: Path, writable: bool) -> None:
    for directory, _, _ in os.walk(path):
        os.chmod(directory, 0o755 if writable else 0o555)


@pytest.mark.timeout(120)
def test_read_only_output_refuses_then_recovers_with_nothing_lost() -> None:
    as_nobody = os.geteuid() == 0  # root ignores permission bits: run the store as nobody
    base = Path(tempfile.mkdtemp(prefix="polar-ro-"))
    out = base / "shards"
    try:
        out.mkdir()
        if as_nobody:
            os.chown(base, NOBODY, NOBODY)
            os.chown(out, NOBODY, NOBODY)
        worker = Worker(out, as_nobody)
        acknowledged: list[str] = []
        for _ in range(5):
            reply = worker.ask("append s")
            assert reply.startswith("ok "), reply
            acknowledged.append(reply.split()[2])
        assert worker.ask("wait-writable") == "ok"

        _chmod_tree(out, writable=False)
        # Appends may still land in the already open journal segment (durable: fine); once the segment
        # is full, neither a new segment nor a shard can be created, and the store refuses.
        replies = []
        for _ in range(12):
            reply = worker.ask("append s")
            replies.append(reply)
            if reply.startswith("ok "):
                acknowledged.append(reply.split()[2])
            else:
                break
        assert replies[-1].startswith("unavailable") and "Permission denied" in replies[-1], replies
        assert worker.ask("check").startswith("unavailable")

        _chmod_tree(out, writable=True)
        assert worker.ask("wait-writable") == "ok"
        for _ in range(5):
            reply = worker.ask("append s")
            assert reply.startswith("ok "), reply
            acknowledged.append(reply.split()[2])
        worker.close()

        stored = read_records(str(out))
        assert [r.record_id for r in stored] == acknowledged
        assert [r.seq for r in stored] == list(range(len(acknowledged)))
        assert validate_store(str(out)) == []
    finally:
        _chmod_tree(base, writable=True)
        shutil.rmtree(base)


async def _serve(out: str) -> None:
    rng = random.Random(1)
    store = TraceStore(out, shard_max_records=3)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "close":
            await store.aclose()
            print("closed", flush=True)
            return
        if line[0] == "append":
            record = _record(rng, line[1], 500)
            try:
                await store.append(record)
                print(f"ok {record.seq} {record.record_id}", flush=True)
            except StorageUnavailable as exc:
                print(f"unavailable {exc.reason}", flush=True)
        elif line[0] == "check":
            try:
                store.check_writable()
                print("ok", flush=True)
            except StorageUnavailable as exc:
                print(f"unavailable {exc.reason}", flush=True)
        elif line[0] == "wait-writable":
            await _wait_writable(store)
            print("ok", flush=True)


if __name__ == "__main__":
    if "--nobody" in sys.argv:
        # Everything the store needs is imported above, before giving up root's right to read /root.
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    asyncio.run(_serve(sys.argv[1]))
