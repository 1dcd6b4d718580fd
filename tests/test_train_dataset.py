"""Traces -> training rows: temperature check, causal-prefix clipping, filtering, partitions (pure)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from polar_cli.trace import Trace, traces_to_table
from polar_cli.train.dataset import (
    TemperatureMismatch,
    clip_to_length,
    is_trace_dataset,
    partition_rows,
    prepare_rows,
    read_trace_dataset,
    resolve_temperature,
)


def trace(session: str, group: str, reward: float, *, prompt=(1, 2, 3), n=4, mask=None, t=1.0, trainable=True):
    mask = list(mask) if mask is not None else [1] * n
    return Trace(
        trace_id=f"{session}-t",
        session_id=session,
        group_id=group,
        prompt_ids=list(prompt),
        completion_ids=list(range(10, 10 + len(mask))),
        loss_mask=mask,
        behavior_logprobs=[-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)],
        reward=reward,
        temperature=t,
        trainable=trainable,
    )


def test_temperature_is_read_from_traces_and_mismatch_refused() -> None:
    traces = [trace("a", "g", 1.0, t=0.7), trace("b", "g", 0.0, t=0.7)]
    assert resolve_temperature(traces, None) == 0.7
    assert resolve_temperature(traces, 0.7) == 0.7
    with pytest.raises(TemperatureMismatch, match="differs from the capture temperature 0.7"):
        resolve_temperature(traces, 1.0)
    with pytest.raises(TemperatureMismatch, match="several temperatures"):
        resolve_temperature(traces + [trace("c", "g", 1.0, t=1.0)], None)
    with pytest.raises(TemperatureMismatch, match="greedily"):
        resolve_temperature([trace("a", "g", 1.0, t=0.0)], None)
    # untrainable traces do not vote on the temperature
    assert resolve_temperature(traces + [trace("c", "g", 1.0, t=1.0, trainable=False)], None) == 0.7


def test_overlong_completion_is_clipped_as_causal_prefix_prompt_untouched() -> None:
    t = trace("a", "g", 1.0, prompt=(1, 2, 3, 4), mask=[1, 1, 0, 0, 1, 1])
    ids, mask, lps, clipped = clip_to_length(t, 7)
    assert clipped
    assert ids == t.completion_ids[:3] and mask == [1, 1, 0] and lps == t.behavior_logprobs[:3]
    assert clip_to_length(t, 10)[3] is False
    assert clip_to_length(t, 4) is None  # the prompt alone fills max_length: never left-trimmed

    data = prepare_rows([t, trace("b", "g", 0.0, prompt=tuple(range(50)))], max_length=7, drop_zero_advantage=False)
    assert data.stats["overlong_prompt"] == 1 and data.stats["clipped"] == 1
    (row,) = data.rows
    assert row.prompt_ids == [1, 2, 3, 4] and len(row.completion_ids) == 3 and row.clipped


def test_rows_drop_untrainable_maskless_and_zero_advantage() -> None:
    traces = [
        trace("a", "g", 1.0),
        trace("b", "g", 0.0),
        trace("c", "g", 0.0, trainable=False),
        trace("d", "g", 1.0, mask=[0, 0, 0]),  # no trainable token: nothing to learn from it
        trace("e", "h", 1.0),
        trace("f", "h", 1.0),  # group h: identical rewards
    ]
    data = prepare_rows(traces, max_length=100)
    assert {r.session_id for r in data.rows} == {"a", "b"}
    assert data.stats["untrainable"] == 1
    assert data.stats["no_trainable_tokens"] == 1
    assert data.stats["zero_advantage"] == 2
    kept = prepare_rows(traces, max_length=100, drop_zero_advantage=False)
    assert {r.session_id for r in kept.rows} == {"a", "b", "e", "f"}
    assert [kept.group_keys[i] for i in range(len(kept.groups))] == ["g", "h"]
    assert all(kept.rows[i].advantage == 0.0 for i in kept.groups[1])


def test_session_weights_count_each_session_once() -> None:
    a1, a2 = trace("a", "g", 1.0), trace("a", "g", 1.0)
    a2.trace_id = "a-t2"
    data = prepare_rows([a1, a2, trace("b", "g", 0.0)], max_length=100)
    assert sum(r.session_weight for r in data.rows) == pytest.approx(2.0)
    # Computed, not compared row with row: session rewards a=1, b=0, LOO over std(1, 0) + 1e-6.
    expected = 1.0 / (statistics.stdev([1.0, 0.0]) + 1e-6)
    by_session = {}
    for row in data.rows:
        by_session.setdefault(row.session_id, []).append((row.advantage, row.session_weight))
    assert by_session["a"] == [(pytest.approx(expected), pytest.approx(0.5))] * 2
    assert by_session["b"] == [(pytest.approx(-expected), pytest.approx(1.0))]


def test_missing_behaviour_logprob_on_a_trainable_token_is_refused() -> None:
    bad = trace("a", "g", 1.0)
    bad.behavior_logprobs[1] = float("nan")
    with pytest.raises(ValueError, match="trainable token 1"):
        prepare_rows([bad, trace("b", "g", 0.0)], max_length=100)


def test_partition_is_deterministic_and_balanced() -> None:
    lengths = [50, 10, 40, 30, 20, 5]
    bins = partition_rows(lengths, 2)
    assert bins == partition_rows(lengths, 2)
    assert sorted(i for b in bins for i in b) == list(range(6))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert abs(loads[0] - loads[1]) <= 5
    assert sorted(len(b) for b in partition_rows(lengths, 4)) == [1, 1, 2, 2]  # at most ceil(6/4) each
    assert partition_rows([7], 3) == [[0], [], []]


def test_trace_dataset_round_trip_and_detection(tmp_path: Path) -> None:
    traces = [trace("a", "g", 1.0), trace("b", "g", 0.0)]
    pq.write_table(traces_to_table(traces), tmp_path / "traces.parquet")
    assert is_trace_dataset([tmp_path])
    assert [t.session_id for t in read_trace_dataset([tmp_path])] == ["a", "b"]
    import pyarrow as pa

    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"record_id": ["x"], "prompt_ids": [[1]]}), raw / "calls.parquet")
    assert not is_trace_dataset([raw])
    with pytest.raises(ValueError, match="mix"):
        is_trace_dataset([tmp_path / "traces.parquet", raw / "calls.parquet"])


# --- refusals and their messages ---------------------------------------------------------------------


def test_truncated_sampling_is_refused_only_for_trainable_traces() -> None:
    from polar_cli.train.dataset import TruncatedSampling, check_untruncated

    plain = trace("a", "g", 1.0)
    untrained = trace("b", "g", 0.0, trainable=False)
    untrained.top_p = 0.9
    check_untruncated([plain, untrained])
    first, second = trace("c", "g", 1.0), trace("d", "g", 0.0)
    first.top_k, second.top_p, second.trace_id = 20, 0.95, "d-t"
    with pytest.raises(TruncatedSampling) as refused:
        check_untruncated([plain, untrained, first, second])
    assert str(refused.value) == (
        "2 trainable traces (of 3, 2 sessions) were sampled with truncation (e.g. c-t: top_p=None, top_k=20, "
        "min_p=None); the trainer recomputes the untruncated softmax, so their importance ratios would be wrong. "
        "Capture them again with top_p=1, top_k=0 and min_p=0: leave them unset in the client (polar's defaults "
        "polar_top_p=1, polar_top_k=0, polar_min_p=0 apply) or set them so."
    )


def test_nothing_to_train_explains_each_reason_with_its_count() -> None:
    from polar_cli.train.dataset import explain_nothing_to_train

    def untrainable(session: str, status: str) -> Trace:
        t = trace(session, "g", 0.0, trainable=False)
        t.status = status
        return t

    traces = [
        untrainable("r1", "running"),
        untrainable("r1", "running"),
        untrainable("r2", "running"),
        untrainable("e1", "error"),
        untrainable("n1", "completed"),
        untrainable("n2", "unknown"),
        trace("a", "g", 1.0),
        trace("b", "g", 1.0),
        trace("c", "h", 0.0),
        trace("d", "h", 1.0),
        trace("e", "k", 0.5),
        trace("f", "k", 0.5),
    ]
    stats = {"zero_advantage": 4, "overlong_prompt": 3, "no_trainable_tokens": 4}
    assert explain_nothing_to_train(traces, stats) == "; ".join(
        [
            "2 sessions still running: post a reward (`polar reward STORE --session S --value V`, which marks the "
            "session completed) or a status (`--status completed|timeout|agent_error|error`)",
            "1 sessions ended in an infrastructure error (status error): never training data",
            "2 sessions have no outcome reward (or no session row): post one with `polar reward STORE --session S "
            "--value V`",
            "4 traces in 2 groups have zero advantage: all sessions of the group got the same reward; GRPO needs "
            "several sessions per group (the same group id in their credentials) with different rewards",
            "3 traces have a prompt of --max-length tokens or more: raise --max-length",
            "4 traces have no sampled token left to train on",
        ]
    )
    assert explain_nothing_to_train(traces[4:6], {}, unrewarded_per_request=True) == (
        "2 sessions give per_request traces without a reward: pass --broadcast-rewards"
    )
    assert explain_nothing_to_train([], {}) == "the input holds no trace (no ok call was captured)"
    assert explain_nothing_to_train([trace("a", "g", 1.0)], {"rows": 0}) == "every trace was dropped ({'rows': 0})"


def test_no_trainable_trace_is_nothing_to_train_with_the_reason() -> None:
    from polar_cli.train.dataset import NothingToTrain

    running = trace("a", "g", 0.0, trainable=False)
    running.status = "running"
    with pytest.raises(NothingToTrain, match=r"^no trainable traces: 1 sessions still running: post a reward"):
        resolve_temperature([running], None)
    with pytest.raises(NothingToTrain, match=r"^no trainable traces: the input holds no trace"):
        prepare_rows([], max_length=10)


def test_temperature_refusals_say_what_to_do() -> None:
    with pytest.raises(TemperatureMismatch, match=r"so train each temperature's traces separately$"):
        resolve_temperature([trace("a", "g", 1.0, t=0.7), trace("b", "g", 1.0, t=1.0)], None)
    with pytest.raises(TemperatureMismatch, match=r"no usable behaviour logprobs for importance sampling$"):
        resolve_temperature([trace("a", "g", 1.0, t=0.0)], None)
    with pytest.raises(TemperatureMismatch, match=r"Drop --temperature or pass the capture value\.$"):
        resolve_temperature([trace("a", "g", 1.0, t=0.7)], 0.7 + 1e-6)
    # the tolerance is absolute and tiny: float noise passes, a relative 1e-9 of a large value does not
    assert resolve_temperature([trace("a", "g", 1.0, t=0.7)], 0.7 + 1e-12) == 0.7
    with pytest.raises(TemperatureMismatch):
        resolve_temperature([trace("a", "g", 1.0, t=1e4)], 1e4 + 1e-6)


def test_trainable_tokens_need_a_finite_logprob_at_most_a_hair_above_zero() -> None:
    from polar_cli.train.dataset import _check_logprobs

    ok = trace("a", "g", 1.0, mask=[1, 1, 0, 1])
    ok.behavior_logprobs = [0.0, 1e-4, float("nan"), -3.0]  # mask-0 tokens are not checked
    _check_logprobs(ok)
    for bad in (2e-4, float("inf"), None):
        t = trace("a", "g", 1.0, mask=[1, 1])
        t.behavior_logprobs = [-0.1, bad]
        with pytest.raises(
            ValueError,
            match=r"^trace a-t: trainable token 1 has behaviour logprob .*; every "
            r"loss-mask-1 token needs the engine's finite logprob$",
        ):
            _check_logprobs(t)
    short = trace("a", "g", 1.0, mask=[1, 1])
    short.behavior_logprobs = [-0.1]
    with pytest.raises(ValueError):
        _check_logprobs(short)  # a logprob missing at the end is refused too


def test_clip_boundaries() -> None:
    t = trace("a", "g", 1.0, prompt=(1, 2, 3), n=4)
    assert clip_to_length(t, 3) is None
    assert clip_to_length(t, 4) == ([10], [1], [-0.1], True)
    assert clip_to_length(t, 7) == ([10, 11, 12, 13], [1, 1, 1, 1], t.behavior_logprobs, False)


# --- the rows -------------------------------------------------------------------------------------------


def test_rows_are_sorted_grouped_and_counted() -> None:
    b = trace("b", "g2", 0.0, mask=[1, 0, 1], t=0.5)
    a1 = trace("a", "g2", 1.0, t=0.5)
    a1.chain_index, a1.trace_id = 1, "a-1"
    a0 = trace("a", "g2", 1.0, t=0.5, prompt=(1, 2, 3, 4, 5))  # clipped to 3 completion tokens
    z = trace("z", "g1", 0.5, t=0.5)
    overlong = [trace(s, "g1", 1.5, t=0.5, prompt=tuple(range(8))) for s in ("y", "w")]
    # the only sampled token is clipped away
    no_tokens = [trace(s, "g1", 0.0, t=0.5, prompt=(1, 2, 3, 4), mask=[0, 0, 0, 0, 1]) for s in ("x", "v")]
    untrainable = [trace(s, "g1", 0.0, t=0.5, trainable=False) for s in ("u", "t")]
    data = prepare_rows(
        [b, a1, a0, z, *overlong, *no_tokens, *untrainable],
        max_length=8,
        scale_rewards="none",
        drop_zero_advantage=False,
    )
    assert [(r.session_id, r.trace_id) for r in data.rows] == [("z", "z-t"), ("a", "a-t"), ("a", "a-1"), ("b", "b-t")]
    assert data.groups == [[0], [1, 2, 3]] and data.group_keys == ["g1", "g2"] and data.temperature == 0.5
    assert data.stats == dict(
        traces=10,
        untrainable=2,
        overlong_prompt=2,
        no_trainable_tokens=2,
        zero_advantage=0,
        clipped=1,
        rows=4,
        groups=2,
        sessions=3,
    )
    assert [r.clipped for r in data.rows] == [False, True, False, False] and len(data.rows[1].completion_ids) == 3
    row = data.rows[3]
    assert (row.group_id, row.loss_mask, row.behavior_logprobs) == ("g2", [1, 0, 1], b.behavior_logprobs)
    assert (row.advantage, row.session_reward, row.session_weight) == (-1.0, 0.0, 1.0)  # unscaled: 0 - 1
    assert (data.rows[1].advantage, data.rows[1].session_reward, data.rows[1].session_weight) == (1.0, 1.0, 0.5)
    assert data.rows[0].num_tokens == 3 + 4 and data.rows[0].num_trainable == 4 and data.max_completion_length == 4


def test_a_certain_sampled_token_is_still_a_trainable_token() -> None:
    """A logprob of exactly 0 (probability 1) is a sampled token like any other: the mask decides."""
    certain = trace("a", "g", 1.0, mask=[0, 1])
    certain.behavior_logprobs = [0.0, 0.0]
    data = prepare_rows([certain, trace("b", "g", 0.0)], max_length=100)
    assert [r.session_id for r in data.rows] == ["a", "b"] and data.stats["no_trainable_tokens"] == 0


def test_zero_advantage_rows_are_counted_one_by_one() -> None:
    same = [trace(s, "g", 1.0) for s in ("a", "b", "c")] + [trace("d", "h", 1.0), trace("e", "h", 0.0)]
    data = prepare_rows(same, max_length=100)
    assert data.stats["zero_advantage"] == 3 and [r.session_id for r in data.rows] == ["d", "e"]


def test_a_temperature_passed_to_prepare_rows_is_checked() -> None:
    with pytest.raises(TemperatureMismatch):
        prepare_rows([trace("a", "g", 1.0, t=0.7), trace("b", "g", 0.0, t=0.7)], max_length=10, temperature=1.0)


# --- step partitions and padding buckets ------------------------------------------------------------


def test_partition_exact_split() -> None:
    assert partition_rows([50, 10, 40, 30, 20, 5], 2) == [[0, 1, 4], [2, 3, 5]]
    assert partition_rows([0, 0], 2) == [[0], [1]]  # one row per bin even when a bin weighs nothing
    assert partition_rows([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert partition_rows([9, 1, 1, 1], 2) == [[0, 3], [1, 2]]  # equal sizes, not equal loads
    assert partition_rows([], 2) == [[], []]


def test_length_buckets_exact_groups_and_the_waste_boundary() -> None:
    from polar_cli.train.dataset import length_buckets

    assert length_buckets([]) == []
    assert length_buckets([10, 8]) == [[0], [1]]  # by default at most 10% padding
    assert length_buckets([10, 9], 0.1) == [[0, 1]]  # waste 1 <= 0.1 * 19
    assert length_buckets([10, 8], 0.1) == [[0], [1]]  # waste 2 > 0.1 * 18
    assert length_buckets([10, 10, 5], 0.2) == [[0, 1, 2]]  # waste 5 <= 0.2 * 25: the boundary is inclusive
    assert length_buckets([10, 10, 5], 0.19) == [[0, 1], [2]]
    assert length_buckets([3, 10, 8, 10], 0.0) == [[1, 3], [2], [0]]


# --- input detection ------------------------------------------------------------------------------------


def test_parquet_files_of_directories_and_files(tmp_path: Path) -> None:
    from polar_cli.train.dataset import parquet_files

    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.parquet", "d/sub/a.parquet", "d/notes.txt", "one.parquet"):
        (tmp_path / name).write_bytes(b"")
    assert parquet_files([tmp_path / "d", tmp_path / "one.parquet"]) == [
        tmp_path / "d/b.parquet",
        tmp_path / "d/sub/a.parquet",
        tmp_path / "one.parquet",
    ]
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'gone'} does not exist$"):
        parquet_files([tmp_path / "gone"])
    (tmp_path / "empty").mkdir()
    assert not is_trace_dataset([tmp_path / "empty"])


def test_trace_columns_decide_the_kind(tmp_path: Path) -> None:
    import pyarrow as pa

    exact = pa.table(
        {n: [[1]] for n in ("prompt_ids", "completion_ids", "loss_mask")}
        | {"trace_id": ["t"], "behavior_logprobs": [[-0.5]]}
    )
    pq.write_table(exact, tmp_path / "exact.parquet")
    assert is_trace_dataset([tmp_path / "exact.parquet"])  # exactly the trace columns is enough
    pq.write_table(pa.table({"record_id": ["x"]}), tmp_path / "raw.parquet")
    with pytest.raises(ValueError, match="^inputs mix built traces and raw capture shards; pass one kind$"):
        is_trace_dataset([tmp_path])


def test_reading_traces_written_before_the_sampling_columns(tmp_path: Path) -> None:
    from polar_cli.trace import LATER_TRACE_COLUMNS

    t = trace("a", "g", 1.0)
    t.top_p = 0.5
    table = traces_to_table([t])
    pq.write_table(table.drop_columns(list(LATER_TRACE_COLUMNS)), tmp_path / "old.parquet")
    [back] = read_trace_dataset([tmp_path / "old.parquet"])
    assert (back.top_p, back.top_k, back.min_p) == (None, None, None) and back.completion_ids == t.completion_ids
    pq.write_table(table.drop_columns(["reward", "top_k"]), tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match=r"broken.parquet: trace dataset lacks columns \['reward'\]$"):
        read_trace_dataset([tmp_path / "broken.parquet"])


# --- load_traces: a raw trace store is built on the fly, with `polar build`'s options ---------------------


@pytest.fixture(scope="module")
def raw_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A session with a re-tokenized turn (store "retok"), the same calls with no natural stop ("capped"),
    and the tiny tokenizer saved where `--tokenizer` can load it."""
    import asyncio

    from build_helpers import AgentSim, coding_turns, tiny_tokenizer, tool_loop

    from polar_addon.store import TraceStore

    sim = AgentSim("s1")
    turns = coding_turns(3)
    turns[0].retokenize = True
    tool_loop(sim, [{"role": "system", "content": "agent"}, {"role": "user", "content": "fix it"}], turns)
    for record in sim.records:
        record.served_model = None  # no tokenizer is found on its own
    capped = [replace(r, record_id=f"c{r.seq}", finish_reason="length") for r in sim.records]
    root = tmp_path_factory.mktemp("raw")

    async def write(path: Path, records: list) -> None:
        async with TraceStore(str(path)) as store:
            for record in records:
                await store.append(record)
            await store.session_update("s1", status="completed", group_id="g")
            await store.add_reward("s1", 1.0)

    asyncio.run(write(root / "retok", sim.records))
    asyncio.run(write(root / "capped", capped))
    tiny_tokenizer().save_pretrained(root / "tok")
    return {"root": root, "records": sim.records, "capped": capped, "tok": root / "tok"}


def _shape(traces: list[Trace]) -> list[tuple]:
    return [(t.record_ids, t.reward, t.trainable, t.break_cause) for t in traces]


def test_load_traces_builds_a_raw_store_with_the_builds_options(raw_stores: dict[str, Any]) -> None:
    from build_helpers import decode, eot_id

    from polar_cli.build import SessionInfo, build_traces
    from polar_cli.train.dataset import load_traces

    store, records, tok = raw_stores["root"] / "retok", raw_stores["records"], raw_stores["tok"]
    info = [SessionInfo("s1", group_id="g", reward=1.0)]

    def built(strategy: str = "prefix_merging", **kw: Any) -> list[tuple]:
        return _shape(build_traces(records, info, strategy, **kw).traces)

    # without a tokenizer the re-tokenized turn breaks the chain; with one it is merged, or broken on request
    no_tok = _shape(load_traces([store], "prefix_merging"))
    assert no_tok == built() and len(no_tok) == 2 and no_tok[1][3] is None and no_tok[0][3] == "other"
    with_tok = _shape(load_traces([store], "prefix_merging", tokenizer=tok))
    assert with_tok == built(decode=decode) and len(with_tok) == 1
    assert (
        _shape(load_traces([store], "prefix_merging", tokenizer=str(tok), merge_retokenized=False))
        == built(decode=decode, merge_retokenized=False)
        != with_tok
    )
    per_request = _shape(load_traces([store], "per_request", tokenizer=tok))
    assert per_request == built("per_request") and [t[1:3] for t in per_request] == [(0.0, False)] * 3
    broadcast = _shape(load_traces([store], "per_request", broadcast_rewards=True))
    assert broadcast == built("per_request", broadcast_rewards=True)
    assert [t[1:3] for t in broadcast] == [(1.0, True)] * 3

    # no call stopped by itself: the end-of-turn token comes from the option, else from the tokenizer's eos
    capped, capped_records = raw_stores["root"] / "capped", raw_stores["capped"]
    unknown = _shape(load_traces([capped], "prefix_merging"))
    assert unknown == _shape(build_traces(capped_records, info).traces) and len(unknown) == 3
    given = _shape(load_traces([capped], "prefix_merging", eot_token_id=eot_id()))
    assert given == _shape(build_traces(capped_records, info, eot_token_id=eot_id()).traces) and len(given) == 2
    from_eos = _shape(load_traces([capped], "prefix_merging", tokenizer=tok))
    assert from_eos == _shape(build_traces(capped_records, info, eot_token_id=eot_id(), decode=decode).traces)
    assert len(from_eos) == 1


def test_load_traces_reads_a_built_dataset_and_refuses_what_is_no_store(tmp_path: Path, raw_stores: dict) -> None:
    from polar_addon.store.reader import StoreNotFound
    from polar_cli.train.dataset import load_traces

    pq.write_table(traces_to_table([trace("a", "g", 1.0), trace("b", "g", 0.0)]), tmp_path / "t.parquet")
    assert [t.session_id for t in load_traces([tmp_path], "prefix_merging")] == ["a", "b"]
    with pytest.raises(ValueError, match="^raw capture shards are read from one trace-store directory"):
        load_traces([raw_stores["root"] / "retok", raw_stores["root"] / "capped"], "prefix_merging")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(StoreNotFound):
        load_traces([tmp_path / "nothing"], "prefix_merging")
