"""TraceStore in-process: lossless round trips, prefix references, sequence numbers, sessions and rewards."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import orjson
import pyarrow.dataset as ds
import pytest

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store import (
    StorageUnavailable,
    TraceStore,
    read_records,
    read_rewards,
    read_sessions,
    read_table,
)
from polar_addon.store.validate import validate_store


def make_record(
    session_id: str,
    prompt: list[int],
    response: list[int],
    messages: list[dict],
    *,
    status: str = "ok",
    content: str = "done",
) -> CaptureRecord:
    ok = status == "ok"
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=session_id,
        seq=-1,
        api="openai_chat",
        status=status,
        harness="test-agent/1.0",
        started_at=1000.0,
        finished_at=1001.0,
        temperature=1.0,
        prompt_ids=list(prompt) if ok else [],
        response_ids=list(response) if ok else [],
        logprobs=[-0.25 - i / 1000 for i in range(len(response))] if ok else [],
        finish_reason="stop" if ok else None,
        messages_json=orjson.dumps(messages).decode(),
        tools_json=orjson.dumps([{"type": "function", "function": {"name": "sh"}}]).decode(),
        response_json=orjson.dumps({"content": content, "reasoning": None, "tool_calls": []}).decode()
        if ok
        else "null",
        error=None if ok else "engine down",
    )


class Agent:
    """A synthetic agent session: each call re-sends the previous prompt + response, then new tokens."""

    def __init__(self, session_id: str, rng: random.Random, system_tokens: int = 40) -> None:
        self.session_id = session_id
        self.rng = rng
        self.prompt = [rng.randrange(50_000) for _ in range(system_tokens)]
        self.messages: list[dict] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]

    def next_call(self, response_len: int = 6, tail_len: int = 9) -> CaptureRecord:
        response = [self.rng.randrange(50_000) for _ in range(response_len)]
        content = f"step {len(self.messages)}"
        record = make_record(self.session_id, self.prompt, response, self.messages, content=content)
        self.prompt = self.prompt + response + [self.rng.randrange(50_000) for _ in range(tail_len)]
        self.messages = self.messages + [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"result {len(self.messages)}"},
        ]
        return record


def run(coro):
    return asyncio.run(coro)


def assert_same(stored: list[CaptureRecord], sent: list[CaptureRecord]) -> None:
    by_id = {r.record_id: r for r in stored}
    assert len(by_id) == len(stored) == len(sent)
    for record in sent:
        assert by_id[record.record_id].to_dict() == record.to_dict()


def test_concurrent_sessions_round_trip_exactly_and_compactly(tmp_path: Path) -> None:
    rng = random.Random(1)
    agents = [Agent(f"s{i}", rng) for i in range(8)]
    sent: list[CaptureRecord] = []

    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_records=13) as store:

            async def drive(agent: Agent) -> None:
                for _ in range(12):
                    record = agent.next_call()
                    await store.append(record)
                    sent.append(record)

            await asyncio.gather(*(drive(a) for a in agents))

    run(main())
    stored = read_records(str(tmp_path))
    assert_same(stored, sent)
    assert [(r.session_id, r.seq) for r in stored] == sorted((f"s{i}", k) for i in range(8) for k in range(12))
    # Per session: the seq order is the append order.
    for agent in agents:
        mine = [r for r in sent if r.session_id == agent.session_id]
        assert [r.seq for r in mine] == list(range(12))

    table = read_table(str(tmp_path))
    total = sum(table.column("prompt_len").to_pylist())
    stored_tokens = sum(len(t) for t in table.column("prompt_tail").to_pylist())
    assert stored_tokens < total / 5, (stored_tokens, total)
    # Every call after the first references an earlier one, for tokens and for messages.
    refs = {(r["session_id"], r["seq"]): r for r in table.to_pylist()}
    for (_, seq), row in refs.items():
        if seq > 0:
            assert row["prompt_ref"] is not None and row["messages_ref"] is not None
            # The previous response message is recognised in the next call's history.
            assert row["messages_prefix_len"] == row["messages_count"] - 1
    # A segment is sealed once it reaches 13 entries; one group commit (<= 8 here) may overshoot.
    shards = list(tmp_path.joinpath("calls").glob("*.parquet"))
    assert len(shards) >= 96 // (13 + 7)
    assert all(ds.dataset(str(p)).count_rows() < 13 + 8 for p in shards)
    assert validate_store(str(tmp_path)) == []


def test_seq_continues_after_reopen_and_first_call_after_restart_is_whole(tmp_path: Path) -> None:
    rng = random.Random(2)
    agent = Agent("s", rng)
    sent = []

    async def session(n: int) -> None:
        async with TraceStore(str(tmp_path)) as store:
            for _ in range(n):
                record = agent.next_call()
                await store.append(record)
                sent.append(record)

    run(session(3))
    run(session(2))
    assert [r.seq for r in sent] == [0, 1, 2, 3, 4]
    assert_same(read_records(str(tmp_path)), sent)
    assert validate_store(str(tmp_path)) == []


def test_nothing_is_truncated(tmp_path: Path) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(150_000) for _ in range(100_000)]
    big_text = "x" * (3 << 20)  # 3 MiB in one message: Polar cut fields at 1 MiB
    messages = [{"role": "user", "content": big_text}]
    first = make_record("big", prompt, [5] * 4000, messages)
    second = make_record(
        "big",
        prompt + [5] * 4000 + [7, 8, 9],
        [1, 2],
        messages + [{"role": "assistant", "content": "done"}, {"role": "user", "content": big_text[:10]}],
    )

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            await store.append(first)
            await store.append(second)

    run(main())
    stored = read_records(str(tmp_path))
    assert_same(stored, [first, second])
    assert len(stored[0].prompt_ids) == 100_000 and len(stored[1].prompt_ids) == 104_003
    assert len(stored[1].messages_json) > 3 << 20


def test_logprobs_are_bit_exact_including_non_finite(tmp_path: Path) -> None:
    record = make_record("lp", [1, 2, 3], [4, 5, 6, 7], [{"role": "user", "content": "hi"}])
    record.logprobs = [-1e-300, -math.inf, -0.1 - 2**-40, 0.0]

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            await store.append(record)

    run(main())
    (stored,) = read_records(str(tmp_path))
    assert stored.logprobs == record.logprobs


def test_side_calls_and_divergent_histories_keep_references_exact(tmp_path: Path) -> None:
    """A side call in between, a rewritten history (thinking dropped), non-canonical JSON: all exact."""
    rng = random.Random(4)
    main_agent = Agent("m", rng, system_tokens=500)
    sent = []
    sent.append(main_agent.next_call())
    sent.append(make_record("m", [9, 9, 9] + main_agent.prompt[:5], [1], [{"role": "user", "content": "title?"}]))
    sent.append(main_agent.next_call())
    # Rewritten history: the last 20 prompt tokens and the last message change.
    rewritten = main_agent.prompt[:-20] + [rng.randrange(50_000) for _ in range(30)]
    messages = main_agent.messages[:-1] + [{"role": "user", "content": "rewritten"}]
    sent.append(make_record("m", rewritten, [3, 4], messages))
    odd = make_record("m", rewritten + [3, 4, 11], [5], messages)
    odd.messages_json = orjson.dumps(messages, option=orjson.OPT_INDENT_2).decode()  # not orjson-canonical
    sent.append(odd)
    sent.append(make_record("m", rewritten + [3, 4, 12], [6], messages, status="failed"))
    sent.append(make_record("m", rewritten + [3, 4, 13, 14], [7], messages + [{"role": "user", "content": "z"}]))

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            for record in sent:
                await store.append(record)

    run(main())
    assert_same(read_records(str(tmp_path)), sent)
    rows = sorted(read_table(str(tmp_path)).to_pylist(), key=lambda r: r["seq"])
    # Call 2 skips the side call and references call 0; call 3 shares all but the changed tail.
    assert rows[2]["prompt_ref"] == sent[0].record_id
    assert rows[3]["prompt_ref"] == sent[2].record_id
    assert rows[3]["prompt_prefix_len"] == len(sent[2].prompt_ids) + 6 + 9 - 20
    assert rows[4]["messages_ref"] is None  # stored verbatim
    assert rows[5]["prompt_len"] == 0 and rows[5]["response_ids"] == []
    assert validate_store(str(tmp_path)) == []
    ok_only = read_records(str(tmp_path), include_failed=False)
    assert [r.status for r in ok_only] == ["ok"] * 6
    assert [r.record_id for r in read_records(str(tmp_path), session_ids=["m"])] == [r.record_id for r in sent]
    assert read_records(str(tmp_path), session_ids=["nope"]) == []


def test_sessions_and_rewards(tmp_path: Path) -> None:
    rng = random.Random(5)
    a, b = Agent("a", rng), Agent("b", rng)

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            await store.session_update(
                "a",
                task_id="t1",
                group_id="g1",
                sample_index=0,
                harness="claude",
                status="running",
                started_at=10.0,
                metadata={"repo": "x"},
            )
            await store.append(a.next_call())
            await store.append(a.next_call())
            await store.append(b.next_call())
            await store.session_update("a", status="completed", ended_at=20.0, metadata={"turns": 2})
            await store.add_reward("a", 0.5)
            await store.add_reward("a", 1.0)
            await store.add_reward("a", 3.0, name="tests_passed", source="verifier")
            with pytest.raises(ValueError):
                await store.session_update("a", status="finished")
            with pytest.raises(TypeError):
                await store.session_update("a", colour="red")
            with pytest.raises(ValueError):
                await store.add_reward("a", math.nan)

    run(main())
    sessions = {s.session_id: s for s in read_sessions(str(tmp_path))}
    sa, sb = sessions["a"], sessions["b"]
    assert (sa.task_id, sa.group_id, sa.sample_index, sa.harness, sa.status) == ("t1", "g1", 0, "claude", "completed")
    assert (sa.started_at, sa.ended_at, sa.metadata) == (10.0, 20.0, {"repo": "x", "turns": 2})
    assert sa.rewards == {"reward": 1.0, "tests_passed": 3.0} and sa.reward == 1.0
    assert [r.value for r in sa.reward_history] == [0.5, 1.0, 3.0]
    assert sa.reward_history[2].source == "verifier"
    assert (sa.calls, sa.failed_calls) == (2, 0)
    # A session known only from its calls.
    assert (sb.status, sb.harness, sb.calls, sb.started_at, sb.reward) == (None, "test-agent/1.0", 1, 1000.0, None)
    assert sb.prompt_tokens == 40 and sb.response_tokens == 6
    assert len(read_rewards(str(tmp_path))) == 3


def test_closed_store_refuses(tmp_path: Path) -> None:
    store = TraceStore(str(tmp_path))
    store.close()
    with pytest.raises(StorageUnavailable):
        store.check_writable()
    with pytest.raises(StorageUnavailable):
        run(store.append(make_record("x", [1], [2], [])))


def test_bad_field_types_fail_the_append_not_the_shard(tmp_path: Path) -> None:
    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            bad = make_record("x", [1], [2], [])
            bad.top_k = "forty"  # type: ignore[assignment]
            with pytest.raises(TypeError):
                await store.append(bad)
            with pytest.raises(ValueError, match="int32"):
                await store.append(make_record("x", [1, 1 << 40], [2], []))
            with pytest.raises(TypeError, match="response_ids"):
                await store.append(make_record("x", [1], [2.5], []))  # type: ignore[list-item]
            await store.append(make_record("x", [1], [2], []))

    run(main())
    assert [r.seq for r in read_records(str(tmp_path))] == [0]


def test_time_based_shard_cut(tmp_path: Path) -> None:
    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_seconds=0.2) as store:
            await store.append(make_record("x", [1], [2], []))
            # No later append and no close: only the segment's age can cut this shard. (read_records alone
            # would pass without the cut: it also reads journaled calls.)
            await _shards(tmp_path, 1)
            assert len(read_records(str(tmp_path))) == 1

    run(main())


async def _shards(path: Path, count: int) -> None:
    for _ in range(100):
        if len(list(path.joinpath("calls").glob("*.parquet"))) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} call shards in {path}")


def test_inline_writes_when_idle_are_cut_by_time_and_slow_disks_go_to_the_writer_thread(
    tmp_path: Path, monkeypatch
) -> None:
    import polar_addon.store.trace_store as trace_store

    taken: list[bool] = []

    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_seconds=0.2) as store:
            write_inline = store._write_inline
            monkeypatch.setattr(store, "_write_inline", lambda item: taken.append(write_inline(item)) or taken[-1])
            await store.append(make_record("x", [1], [2], []))  # builds the seq index on the writer thread
            await _shards(tmp_path, 1)
            await store.append(make_record("x", [1, 2, 3], [4], []))  # idle: written inline
            await _shards(tmp_path, 2)  # and still cut by age, with no later append to trigger it
            await store.append(make_record("x", [1, 2, 3, 4, 5], [6], []))  # inline, opens a segment
            while not store._queue.empty():  # the writer thread takes the wake-up for that segment
                await asyncio.sleep(0.01)
            monkeypatch.setattr(trace_store, "_INLINE_MAX_S", -1.0)  # every inline write now counts as slow
            await store.append(make_record("x", [1, 2, 3, 4, 5, 6, 7], [8], []))  # inline, "slow"
            await store.append(make_record("x", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10], []))  # writer thread
            await asyncio.gather(*(store.append(make_record(f"s{i}", [i], [i], [])) for i in range(20)))

    run(main())
    assert taken[:6] == [False, True, True, True, False, False]
    stored = read_records(str(tmp_path), session_ids=["x"])
    assert [r.seq for r in stored] == [0, 1, 2, 3, 4] and stored[-1].prompt_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert len(read_records(str(tmp_path))) == 25 and validate_store(str(tmp_path)) == []


def test_shards_load_with_pyarrow_dataset_and_datasets(tmp_path: Path) -> None:
    rng = random.Random(6)
    agent = Agent("d", rng)

    async def main() -> None:
        async with TraceStore(str(tmp_path), shard_max_records=2) as store:
            for _ in range(5):
                await store.append(agent.next_call())
            await store.session_update("d", status="completed")
            await store.add_reward("d", 1.0)

    run(main())
    table = ds.dataset(str(tmp_path / "calls"), format="parquet").to_table()
    assert table.num_rows == 5 and sorted(table.column("seq").to_pylist()) == list(range(5))

    import datasets

    calls = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "calls" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert len(calls) == 5 and set(calls["session_id"]) == {"d"}
    rewards = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "rewards" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert rewards[0]["value"] == 1.0


def test_round_trip_after_a_sessions_tips_were_evicted(tmp_path: Path) -> None:
    """With room for one session's tips, interleaved sessions push each other's tips out: a call whose
    session was evicted is stored whole (it cannot reference what the store forgot), later calls of
    it reference it again, and every record reads back exactly."""
    rng = random.Random(9)
    a, b = Agent("a", rng, system_tokens=300), Agent("b", rng, system_tokens=300)
    sent = [a.next_call(), b.next_call(), a.next_call(), a.next_call(), b.next_call()]

    async def main() -> None:
        # One record per shard: every conversion commits its tips before the next call is encoded.
        async with TraceStore(str(tmp_path), shard_max_records=1, max_cached_sessions=1) as store:
            for record in sent:
                await store.append(record)
                while store.pending_segments:
                    await asyncio.sleep(0.01)

    run(main())
    assert_same(read_records(str(tmp_path)), sent)
    rows = {r["record_id"]: r for r in read_table(str(tmp_path)).to_pylist()}
    a0, b0, a1, a2, b1 = (rows[r.record_id] for r in sent)
    assert a0["prompt_ref"] is None and b0["prompt_ref"] is None
    assert a1["prompt_ref"] is None and a1["prompt_tail"] == sent[2].prompt_ids  # a's tips were evicted by b
    assert a2["prompt_ref"] == sent[2].record_id
    assert a2["prompt_prefix_len"] == len(sent[2].prompt_ids) + len(sent[2].response_ids)  # its tip: prompt + answer
    assert b1["prompt_ref"] is None  # evicted by a
    assert validate_store(str(tmp_path)) == []


def test_parse_failures_round_trip_and_older_shards_without_the_column_read_as_null(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    rng = random.Random(9)
    agent = Agent("p", rng)
    sent = [agent.next_call() for _ in range(3)]
    sent[0].parse_failures, sent[1].parse_failures = 2, 0  # the third: parsed by the engine (null)

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            for record in sent:
                await store.append(record)

    run(main())
    stored = read_records(str(tmp_path))
    assert [r.parse_failures for r in sorted(stored, key=lambda r: r.seq)] == [2, 0, None]
    assert_same(stored, sent)
    # A shard written before the column existed: every reader sees null there, and the store still validates.
    for path in (tmp_path / "calls").glob("*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(["parse_failures"]), path)
    assert [r.parse_failures for r in read_records(str(tmp_path))] == [None] * 3
    assert validate_store(str(tmp_path)) == []


def test_tool_call_parser_round_trips_and_older_shards_without_the_column_read_as_null(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    agent = Agent("p", random.Random(4))
    sent = [agent.next_call() for _ in range(3)]
    sent[0].tool_call_parser, sent[1].tool_call_parser = "fenced_json", "engine"  # the third: no tool call

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            for record in sent:
                await store.append(record)

    run(main())
    stored = read_records(str(tmp_path))
    assert [r.tool_call_parser for r in sorted(stored, key=lambda r: r.seq)] == ["fenced_json", "engine", None]
    assert_same(stored, sent)
    for path in (tmp_path / "calls").glob("*.parquet"):
        pq.write_table(pq.read_table(path).drop_columns(["tool_call_parser"]), path)
    assert [r.tool_call_parser for r in read_records(str(tmp_path))] == [None] * 3
    assert validate_store(str(tmp_path)) == []
