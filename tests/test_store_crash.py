"""Crash safety: a writer process SIGKILLed at random moments loses nothing it acknowledged and duplicates nothing.

Run as a script, this file is the writer: it appends records from concurrent sessions and prints one line per
acknowledged record (flushed before the next append of that session), so the test knows exactly what was
acknowledged when the kill landed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store import TraceStore, journal, read_records
from polar_addon.store.entries import call_entry
from polar_addon.store.shards import Output
from polar_addon.store.validate import validate_store

ROOT = Path(__file__).resolve().parents[1]


def record_digest(record: CaptureRecord) -> str:
    data = dict(vars(record))  # dataclasses.asdict deep-copies every token: far too slow here
    data.pop("seq")
    return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _record(rng: random.Random, session_id: str, prompt: list[int], turn: int) -> CaptureRecord:
    response = [rng.randrange(100_000) for _ in range(rng.randrange(1, 40))]
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=session_id,
        seq=-1,
        api="anthropic_messages",
        status="ok",
        prompt_ids=list(prompt),
        response_ids=response,
        logprobs=[-rng.random() for _ in response],
        finish_reason="stop",
        messages_json=orjson.dumps([{"role": "user", "content": f"turn {t}"} for t in range(turn + 1)]).decode(),
        response_json=orjson.dumps({"content": f"turn {turn}", "reasoning": None, "tool_calls": []}).decode(),
    )


async def _writer(out: str, sessions: int, turns: int, seed: int, shard_max_records: int, durability: str) -> None:
    rng = random.Random(seed)
    store = TraceStore(out, shard_max_records=shard_max_records, durability=durability)
    print("ready", flush=True)

    async def session(i: int) -> None:
        sid = f"s{i}"
        prompt = [rng.randrange(100_000) for _ in range(rng.randrange(50, 3000))]
        for turn in range(turns):
            record = _record(rng, sid, prompt, turn)
            await store.append(record)
            sys.stdout.write(f"ack {record.record_id} {sid} {record.seq} {record_digest(record)}\n")
            sys.stdout.flush()
            prompt = prompt + record.response_ids + [rng.randrange(100_000) for _ in range(rng.randrange(5, 200))]

    await asyncio.gather(*(session(i) for i in range(sessions)))
    await store.aclose()
    print("done", flush=True)


def _start(out: Path, seed: int, turns: int, sessions: int = 16, durability: str = "fsync") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, __file__, str(out), str(sessions), str(turns), str(seed), durability],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _acks(stdout: str) -> list[tuple[str, str, int, str]]:
    acks = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] == "ack":
            acks.append((parts[1], parts[2], int(parts[3]), parts[4]))
    return acks


def _shards_are_whole(out: Path) -> None:
    for path in out.rglob("*.parquet"):
        if not path.name.startswith("."):
            import pyarrow.parquet as pq

            pq.read_metadata(path)  # raises on a truncated file


@pytest.mark.timeout(300)
@pytest.mark.parametrize("durability", ["fsync", "write"])
def test_sigkill_at_random_moments_loses_and_duplicates_nothing(durability: str, tmp_path: Path) -> None:
    """Either durability: SIGKILL is the proxy's death, which ``write`` survives as ``fsync`` does (the kernel holds
    what was written); only a power cut tells them apart."""
    rng = random.Random(20261129)
    acknowledged: dict[str, tuple[str, int, str]] = {}
    for round_ in range(5):
        proc = _start(tmp_path, seed=round_, turns=150, durability=durability)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        # The kill lands after a random number of acknowledgements, not after a random time: a fast machine (and
        # durability=write, which waits for no fdatasync) can write all 2,400 records within any fixed sleep. The
        # writer may run up to a pipe's worth (~600 lines) ahead of this reader, so 1,600 leaves it mid-flight.
        seen = [proc.stdout.readline() for _ in range(rng.randrange(1, 1600))]
        proc.send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
        stdout = "".join(seen) + stdout
        assert "done" not in stdout, "the writer finished before the kill: give it more work"
        acks = _acks(stdout)
        assert acks, f"round {round_}: nothing acknowledged before the kill\n{stderr}"
        for rid, sid, seq, digest in acks:
            assert rid not in acknowledged
            acknowledged[rid] = (sid, seq, digest)
        _shards_are_whole(tmp_path)
        assert not validate_store_schema_problems(tmp_path)

    # A last writer runs to completion: it replays the dead writers' journals first.
    proc = _start(tmp_path, seed=99, turns=5, durability=durability)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    for rid, sid, seq, digest in _acks(stdout):
        acknowledged[rid] = (sid, seq, digest)
    assert not list((tmp_path / "_journal").glob("w-*/*.wal")), "journal segments left after a clean close"

    stored = read_records(str(tmp_path))
    by_id = {r.record_id: r for r in stored}
    assert len(by_id) == len(stored), "duplicated records"
    lost = [rid for rid in acknowledged if rid not in by_id]
    assert lost == []
    for rid, (sid, seq, digest) in acknowledged.items():
        record = by_id[rid]
        assert (record.session_id, record.seq, record_digest(record)) == (sid, seq, digest)
    # What is stored but was never acknowledged can only be calls in flight at a kill: at most one per session.
    unacknowledged = len(stored) - len(acknowledged)
    assert 0 <= unacknowledged <= 5 * 16
    assert validate_store(str(tmp_path)) == []


def validate_store_schema_problems(out: Path) -> list[str]:
    # Before the replay, seqs may have holes (records still in the dead writer's journal); files must be whole.
    return [p for p in validate_store(str(out)) if "unreadable" in p or "missing column" in p]


def _orphan_segment(journal_root: Path, entries: list[bytes], torn: bytes = b"") -> Path:
    """A dead writer's directory: a segment with whole entries, maybe a torn last one, and no lock held."""
    writer = journal_root / "w-deadbeef"
    writer.mkdir(parents=True)
    (writer / "lock").touch()
    name = journal.new_segment_name("deadbeef", 1)
    path = writer / f"{name}{journal.SEGMENT_SUFFIX}"
    path.write_bytes(journal.MAGIC + b"".join(journal.frame(e) for e in entries) + torn)
    return path


def _call(session_id: str, seq: int) -> CaptureRecord:
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=session_id,
        seq=seq,
        api="openai_chat",
        status="ok",
        prompt_ids=[1, 2, seq],
        response_ids=[3],
        logprobs=[-0.5],
    )


def test_torn_last_entry_is_dropped_and_sequence_continues(tmp_path: Path) -> None:
    rows = [_call("s", i) for i in range(3)]
    torn_entry = journal.frame(call_entry(_call("s", 3), 3))[:-7]
    segment = _orphan_segment(tmp_path / "_journal", [call_entry(r, r.seq) for r in rows], torn_entry)

    async def main() -> CaptureRecord:
        async with TraceStore(str(tmp_path)) as store:
            assert not segment.exists()  # replayed on open
            record = CaptureRecord(
                record_id=new_record_id(),
                session_id="s",
                seq=-1,
                api="openai_chat",
                status="ok",
                prompt_ids=[1, 2, 9],
                response_ids=[4],
                logprobs=[-1.0],
            )
            await store.append(record)
            return record

    record = asyncio.run(main())
    assert record.seq == 3
    stored = read_records(str(tmp_path))
    assert [r.record_id for r in stored] == [r.record_id for r in rows] + [record.record_id]
    assert validate_store(str(tmp_path)) == []
    assert not (tmp_path / "_journal" / "w-deadbeef").exists()


def test_after_a_failed_replay_sequence_numbers_continue_past_the_unreplayed_segment(tmp_path: Path) -> None:
    """A dead writer's segment that cannot be replayed yet still holds seqs 0..2 of session s: the store
    refuses appends while it waits, and its sequence index counts that segment, so no seq repeats."""
    from polar_addon.store import StorageUnavailable

    segment = _orphan_segment(tmp_path / "_journal", [call_entry(_call("s", i), i) for i in range(3)])
    # Block the shard write (a directory where its temp file goes); listing shards still works.
    (tmp_path / "calls" / f".{journal.segment_name(str(segment))}.parquet.tmp").mkdir(parents=True)

    async def main() -> None:
        store = TraceStore(str(tmp_path))
        try:
            assert segment.exists() and store.pending_segments == 1
            with pytest.raises(StorageUnavailable, match="cannot write shards"):
                await store.append(_call("s", -1))
            store._ensure_seq_index()
            assert store._next_seq == {"s": 3}
        finally:
            await store.aclose()

    asyncio.run(main())
    assert segment.exists()  # still in the journal for the next store to replay


def test_replaying_a_segment_whose_shard_exists_does_not_duplicate(tmp_path: Path) -> None:
    from polar_addon.store.compaction import SessionTips
    from polar_addon.store.trace_store import segment_tables

    entries = [call_entry(_call("s", i), i) for i in range(4)]
    segment = _orphan_segment(tmp_path / "_journal", entries)
    # The dead writer had written the shard (and a stale temp file) but not yet deleted the segment.
    out = Output.from_uri(str(tmp_path))
    name = journal.segment_name(str(segment))
    out.write_shard("calls", name, segment_tables(entries, SessionTips().staged())["calls"])
    (tmp_path / "calls" / f".{name}.parquet.tmp").write_bytes(b"PAR1 half a file")

    TraceStore(str(tmp_path)).close()
    assert not segment.exists()
    assert not (tmp_path / "calls" / f".{name}.parquet.tmp").exists()
    assert [r.seq for r in read_records(str(tmp_path))] == [0, 1, 2, 3]
    assert validate_store(str(tmp_path)) == []


def test_a_live_writers_journal_is_left_alone(tmp_path: Path) -> None:
    """Two stores on one journal root (the proxy and `polar reward`): neither replays the other's journal."""

    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_records=1000) as proxy:
            record = CaptureRecord(
                record_id=new_record_id(),
                session_id="s",
                seq=-1,
                api="openai_chat",
                status="ok",
                prompt_ids=[1],
                response_ids=[2],
                logprobs=[-1.0],
            )
            await proxy.append(record)
            async with TraceStore(str(tmp_path)) as cli:
                await cli.add_reward("s", 1.0)
            # The proxy's open segment is untouched and it keeps appending to it.
            assert len(list((tmp_path / "_journal").glob("w-*/*.wal"))) == 1
            await proxy.append(
                CaptureRecord(
                    record_id=new_record_id(),
                    session_id="s",
                    seq=-1,
                    api="openai_chat",
                    status="ok",
                    prompt_ids=[1, 2, 3],
                    response_ids=[4],
                    logprobs=[-1.0],
                )
            )

    asyncio.run(main())
    assert [r.seq for r in read_records(str(tmp_path))] == [0, 1]
    assert validate_store(str(tmp_path)) == []


if __name__ == "__main__":
    out_dir, n_sessions, n_turns, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    asyncio.run(_writer(out_dir, n_sessions, n_turns, seed, shard_max_records=25, durability=sys.argv[5]))


def test_a_batch_larger_than_one_writev_is_written_whole(tmp_path: Path) -> None:
    """Group commit of thousands of entries: more buffers than one writev() takes, every entry back intact."""
    segment = journal.Segment(str(tmp_path), "0001")
    payloads = [os.urandom(i % 97) + str(i).encode() for i in range(3000)]
    segment.append(payloads[:1])
    segment.append(payloads[1:])
    segment.close()
    assert journal.read_segment(segment.path) == payloads
    assert segment.size == os.path.getsize(segment.path)


def test_an_unsynced_append_is_in_the_file_and_sync_makes_it_durable(tmp_path: Path) -> None:
    segment = journal.Segment(str(tmp_path), "0001")
    segment.append([b"one"])
    assert (segment.synced, segment.unsynced) == (segment.size, False)
    segment.append([b"two", b"three"], sync=False)
    assert segment.unsynced and segment.synced < segment.size == os.path.getsize(segment.path)
    assert journal.read_segment(segment.path) == [b"one", b"two", b"three"]  # written: another process reads it
    segment.sync()
    assert (segment.synced, segment.unsynced) == (segment.size, False)
    segment.append([b"four"], sync=False)
    segment.close()
    segment.sync()  # closed: nothing to sync, and never an fdatasync of a closed (maybe reused) fd
    assert segment.fd == -1 and journal.read_segment(segment.path)[-1] == b"four"


def test_durability_write_acknowledges_before_the_fsync_and_syncs_behind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="durability must be one of fsync, write"):
        TraceStore(str(tmp_path / "bad"), durability="none")

    async def main() -> TraceStore:
        store = TraceStore(str(tmp_path), durability="write")
        for _ in range(20):
            await store.append(_call("s", -1))
        segment = store._segment
        assert segment is not None and segment.count == 20
        for _ in range(200):  # the sync thread catches up behind the appends
            if not segment.unsynced:
                break
            await asyncio.sleep(0.01)
        assert not segment.unsynced
        await store.aclose()
        return store

    store = asyncio.run(main())
    assert store._syncer is not None and not store._syncer.is_alive()
    assert [r.seq for r in read_records(str(tmp_path))] == list(range(20))
    assert not list((tmp_path / "_journal").glob("w-*/*.wal"))


def _with_prompt(prompt: list[int], seq: int) -> CaptureRecord:
    return CaptureRecord(
        record_id=f"r{seq}",
        session_id="s",
        seq=seq,
        api="openai_chat",
        status="ok",
        prompt_ids=prompt,
        response_ids=[7, 8],
        logprobs=[-0.5, -0.25],
    )


def test_a_conversion_retried_after_a_failed_write_never_references_itself() -> None:
    """Tips are staged and committed only once the shards are written: a retry sees the same tips."""
    from polar_addon.store.compaction import SessionTips, encode_segment, expand_session

    tips = SessionTips()
    first = [call_entry(_with_prompt([1, 2, 3], 0), 0)]
    staged = tips.staged()
    encode_segment(first, staged)
    tips.commit(staged)
    second = [
        call_entry(_with_prompt([1, 2, 3, 7, 8, 4], 1), 1),
        call_entry(_with_prompt([1, 2, 3, 7, 8, 4, 7, 8, 5], 2), 2),
    ]
    attempt = encode_segment(second, tips.staged())["calls"]  # its shard write "fails": nothing committed
    retry = encode_segment(second, tips.staged())["calls"]
    assert retry == attempt
    assert [r["prompt_ref"] for r in retry] == ["r0", "r1"]
    rows = encode_segment(first, SessionTips().staged())["calls"] + retry
    assert [list(r.prompt_ids) for r in expand_session(rows)] == [
        [1, 2, 3],
        [1, 2, 3, 7, 8, 4],
        [1, 2, 3, 7, 8, 4, 7, 8, 5],
    ]
