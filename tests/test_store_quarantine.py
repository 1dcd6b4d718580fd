"""One record that cannot become a row never stops the store (issue 11, item 1).

Before the fix, a record with an integer past int64 (``max_tokens: 9223372036854775813`` from a client, or
``sample=2^63`` in the proxy credentials) was journaled, the int64 shard column then rejected it, and the shard
writer took that for an output outage: every later append got StorageUnavailable, the other calls of that
segment never reached shards, and a restart replayed into the same wall.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store import TraceStore, entries, read_records
from polar_addon.store.validate import validate_store

TOO_BIG = 9223372036854775813  # 2^63 + 5: orjson writes it, an int64 column cannot hold it


def _record(session_id: str, **fields) -> CaptureRecord:
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=session_id,
        seq=-1,
        api="openai_chat",
        status="ok",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        messages_json=orjson.dumps([{"role": "user", "content": "q"}]).decode(),
        **fields,
    )


async def _wait_converted(store: TraceStore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.pending_segments:
        assert time.monotonic() < deadline, f"{store.pending_segments} journal segments never became shards"
        await asyncio.sleep(0.05)


def test_an_integer_past_int64_is_refused_at_append_and_the_store_keeps_writing(tmp_path: Path) -> None:
    async def run() -> None:
        async with TraceStore(str(tmp_path / "out"), shard_max_records=4, shard_max_seconds=0.2) as store:
            with pytest.raises(ValueError, match="int64"):
                await store.append(_record("s1", max_tokens=TOO_BIG))
            with pytest.raises(ValueError, match="int64"):
                await store.session_update("s1", sample_index=2**63)
            for _ in range(5):
                await store.append(_record("s1"))
            await _wait_converted(store)
            store.check_writable()

    asyncio.run(run())
    assert [r.seq for r in read_records(str(tmp_path / "out"))] == [0, 1, 2, 3, 4]
    assert validate_store(str(tmp_path / "out")) == []


def test_a_journaled_bad_record_is_quarantined_and_replay_after_restart_heals(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """A journal written by a polar that still accepted such a record (forged here by skipping the append-time
    check) is replayed by the next store: the bad entry goes to quarantine, the rest of its segment to shards."""
    out = tmp_path / "out"

    async def write_poisoned() -> None:
        # A huge shard size keeps every entry in one unsealed segment until the process "dies".
        store = TraceStore(str(out), shard_max_records=10_000, shard_max_seconds=3600)
        check = entries.coerce_scalars
        monkeypatch.setattr(entries, "coerce_scalars", lambda kind, row: None)
        await store.append(_record("a"))
        await store.append(_record("b", max_tokens=TOO_BIG))
        await store.append(_record("a"))
        monkeypatch.setattr(entries, "coerce_scalars", check)
        # Crash: the writer dies without sealing or converting (its journal directory stays behind).
        store._closed = True
        store._own_dir.release(remove=False)

    asyncio.run(write_poisoned())
    # Read commands see journaled records before they reach shards: the bad one is skipped, not fatal.
    assert sorted((r.session_id, r.seq) for r in read_records(str(out))) == [("a", 0), ("a", 1)]

    async def reopen() -> None:
        async with TraceStore(str(out), shard_max_records=2, shard_max_seconds=0.2) as store:
            store.check_writable()  # replay did not leave the store refusing
            await store.append(_record("c"))
            await _wait_converted(store)
            store.check_writable()

    asyncio.run(reopen())
    stored = sorted((r.session_id, r.seq) for r in read_records(str(out)))
    assert stored == [("a", 0), ("a", 1), ("c", 0)]
    problems = validate_store(str(out))
    assert len(problems) == 1 and problems[0].startswith("quarantined:") and "entry 1" in problems[0], problems
    quarantined = list((out / "_quarantine").glob("*.jsonl"))
    assert len(quarantined) == 1
    line = orjson.loads(quarantined[0].read_bytes().splitlines()[0])
    assert line["entry"] == 1 and line["payload_b64"] and line["segment"] == quarantined[0].stem
    assert [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()] == [
        f"segment {quarantined[0].stem}: 1 entries quarantined ({line['reason']})"
    ]
