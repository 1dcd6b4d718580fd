"""polar as TRL's async rollout worker: TRL's own ``AsyncGRPOTrainer`` trains on polar rollouts of the toy agent
(examples/trl_async_grpo.py: the openai-SDK agent through a real mitmdump, the embedded engine on the tiny model,
bwrap), and what TRL receives is token for token what the engine sampled."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from polar_addon.store.reader import iter_records
from polar_cli.trace import Trace
from polar_cli.train.dataset import TrainRow
from polar_cli.trl_async.cpu_attention import flash_attn_varlen_func
from polar_cli.trl_async.samples import UntaggedCall, row_sample, rows_to_samples
from polar_cli.trl_async.weights import PolarWeightTransfer, write_checkpoint

REPO = Path(__file__).resolve().parent.parent


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal [a, b) runs of 1s."""
    runs, start = [], None
    for p, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = p
        elif not m and start is not None:
            runs.append((start, p))
            start = None
    return runs


def assert_captured(sample: Any, calls: list[Any]) -> None:
    """Every trained token of ``sample`` is a token a captured call sampled, right after that call's exact prompt,
    with that call's logprob; every other position carries logprob 0."""
    ids, mask, logprobs = sample.input_ids.tolist(), sample.completion_mask, sample.old_log_probs
    assert len(ids) == len(mask) == len(logprobs)
    assert not logprobs[mask == 0].any(), "a context position carries a behaviour logprob"
    assert mask.any(), "nothing to train"
    for a, b in _runs(mask):
        p = a
        while p < b:
            prompted = [c for c in calls if list(c.prompt_ids) == ids[:p] and c.response_ids]
            assert prompted, f"no captured call was prompted with the {p} tokens before trained position {p}"
            # Samples of one task share their prompt (and, on a tiny vocabulary, often a first token or more): the
            # run is one of those calls' sampled tokens, with that call's logprobs.
            sampled = [
                c for c in prompted if ids[p : p + min(b - p, len(c.response_ids))] == list(c.response_ids[: b - p])
            ]
            assert sampled, f"trained tokens at {p} are not the sampled ones of any call with that prompt"
            matched = [
                c
                for c in sampled
                if np.array_equal(
                    logprobs[p : p + min(b - p, len(c.response_ids))],
                    np.asarray(c.logprobs[: b - p], dtype=np.float32),
                )
            ]
            assert matched, f"behaviour logprobs at {p} are not the captured"
            p += min(b - p, len(matched[0].response_ids))


# -- pure parts --------------------------------------------------------------------------------------------------


def _row(**overrides: Any) -> TrainRow:
    fields = dict(
        trace_id="t1", session_id="s1", group_id="g", prompt_ids=[5, 6, 7], completion_ids=[8, 9, 10, 11],
        loss_mask=[1, 0, 1, 1], behavior_logprobs=[-0.5, -9.0, -0.25, -1.5], advantage=0.75, session_reward=1.0,
        session_weight=1.0,
    )  # fmt: skip
    fields.update(overrides)
    return TrainRow(**fields)  # type: ignore[arg-type]


def _trace(trace_id: str, versions: list[str]) -> Trace:
    return Trace(
        trace_id=trace_id, session_id="s1", chain_index=0, prompt_ids=[5, 6, 7], completion_ids=[8, 9, 10, 11],
        loss_mask=[1, 0, 1, 1], behavior_logprobs=[-0.5, 0.0, -0.25, -1.5], reward=1.0, weight_versions=versions,
    )  # fmt: skip


def test_row_sample_lays_tokens_out_as_trl_reads_them() -> None:
    s = row_sample(_row(), model_version=3, group_id=7)
    assert s.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert s.completion_mask.tolist() == [0, 0, 0, 1, 0, 1, 1]
    # old_log_probs[p] is the logprob of input_ids[p] (TRL's packer), zero where nothing was sampled
    assert s.old_log_probs.tolist() == [0.0, 0.0, 0.0, -0.5, 0.0, -0.25, -1.5]
    assert (s.advantage, s.model_version, s.group_id, s.metrics) == (0.75, 3, 7, {"reward": 1.0})


def test_samples_take_the_oldest_version_their_calls_record_and_refuse_untagged_calls() -> None:
    ids: dict[str, int] = {}
    [s] = rows_to_samples([_row()], {"t1": _trace("t1", ["4", "2", "3"])}, ids)
    assert s.model_version == 2 and ids == {"g": 0}
    [s2] = rows_to_samples([_row(group_id="h")], {"t1": _trace("t1", ["4"])}, ids)
    assert s2.group_id == 1  # group ids stay unique across batches
    with pytest.raises(UntaggedCall):
        rows_to_samples([_row()], {"t1": _trace("t1", ["4", None])}, ids)  # type: ignore[list-item]


def test_samples_carry_trls_dtypes_the_decoded_text_and_when_they_were_queued() -> None:
    s = row_sample(_row(), model_version=0, group_id=0, enqueued_at=12.5)
    assert (s.input_ids.dtype, s.completion_mask.dtype, s.old_log_probs.dtype) == (np.int64, np.int64, np.float32)
    assert (s.prompt, s.completion, s.enqueued_at) == ([], [], 12.5)
    text = row_sample(_row(), model_version=0, group_id=0, decode=lambda ids: ",".join(map(str, ids)))
    assert text.prompt == [{"role": "user", "content": "5,6,7"}]
    assert text.completion == [{"role": "assistant", "content": "8,9,10,11"}]


def test_rows_to_samples_keeps_a_groups_rows_together_and_stamps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("polar_cli.trl_async.samples.time.time", lambda: 99.0)
    rows = [_row(group_id="b", trace_id="t1"), _row(group_id="a", trace_id="t2"), _row(group_id="b", trace_id="t3")]
    traces = {t: _trace(t, ["1"]) for t in ("t1", "t2", "t3")}
    ids: dict[str, int] = {}
    samples = rows_to_samples(rows, traces, ids, decode=lambda ids: "x")
    assert [s.group_id for s in samples] == [0, 1, 1] and ids == {"a": 0, "b": 1}
    assert all(s.enqueued_at == 99.0 and s.prompt[0]["content"] == "x" for s in samples)


@pytest.mark.parametrize(
    ("tags", "version"),
    [(["3"], 3), (["-1", "2"], -1), (["10", "9"], 9), ([], None), (["v2"], None), (["2", "-"], None), (["X2"], None)],
)
def test_trace_version_reads_numeric_tags_only(tags: list[str], version: int | None) -> None:
    from polar_cli.trl_async.samples import trace_version

    if version is None:
        with pytest.raises(UntaggedCall, match="without a numeric weight_version"):
            trace_version(_trace("t", tags))
    else:
        assert trace_version(_trace("t", tags)) == version


def test_weight_transfer_writes_each_sync_and_holds_it_until_trl_names_its_version(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.zeros(2)}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    (base / "pytorch_model.bin").write_text("stale")  # another weights format is never copied
    transfer = PolarWeightTransfer(base, tmp_path / "out", keep=2)
    transfer.init_weight_transfer()
    assert (tmp_path / "out" / "weights").is_dir() and transfer.take_pending() is None
    transfer.pause()
    assert transfer.syncing.is_set()
    for value in (1.0, 2.0, 3.0):
        transfer.send_weights(iter([("w", torch.full((4,), value)[::2])]))  # a strided view is saved whole
    pending = transfer.take_pending()
    assert pending == tmp_path / "out" / "weights" / "sync-0003" and transfer.take_pending() is None
    assert load_file(str(pending / "model.safetensors"))["w"].tolist() == [3.0, 3.0]
    assert sorted(p.name for p in pending.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out" / "weights").iterdir()) == ["sync-0002", "sync-0003"]
    transfer.in_use = {pending}
    transfer.send_weights(iter([("w", torch.ones(2))]))
    transfer.send_weights(iter([("w", torch.ones(2))]))
    kept = sorted(p.name for p in (tmp_path / "out" / "weights").iterdir())
    assert kept == ["sync-0003", "sync-0004", "sync-0005"]  # the one a batch serves stays; the older goes
    transfer.resume()
    assert transfer.syncing.is_set()  # released by update_model_version, not by resume
    transfer.destroy()
    assert not transfer.syncing.is_set()


def test_a_checkpoint_is_written_whole_over_a_stale_attempt_and_an_older_copy(tmp_path: Path) -> None:
    import os

    from safetensors import safe_open

    base = tmp_path / "base"
    base.mkdir()
    save_file({"a": torch.zeros(2)}, str(base / "model.safetensors"))
    dest = tmp_path / "deep" / "er" / "sync-0001"  # parents made as needed
    stale = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    stale.mkdir(parents=True)
    (stale / "junk").write_text("a killed write's leftovers")
    write_checkpoint(base, dest, iter([("a", torch.ones(2))]))
    write_checkpoint(base, dest, iter([("a", torch.full((2,), 2.0))]))  # over an existing copy
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses a safetensors file without it
        assert f.get_tensor("a").tolist() == [2.0, 2.0]
    assert not stale.exists()
    fresh = write_checkpoint(base, tmp_path / "new" / "parents" / "sync-0001", iter([("a", torch.ones(2))]))
    assert fresh == ["a"] and (tmp_path / "new" / "parents" / "sync-0001" / "model.safetensors").is_file()


def test_weight_transfer_defaults_and_a_repeated_init(tmp_path: Path) -> None:
    transfer = PolarWeightTransfer(tmp_path, tmp_path / "out")
    assert transfer.keep == 3 and transfer.sends == 0 and not transfer.syncing.is_set()
    transfer.init_weight_transfer()
    transfer.init_weight_transfer()  # TRL's resume calls it again
    assert (tmp_path / "out" / "weights").is_dir()


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One segment through torch's SDPA: keys before the queries are the segment's prefix path, then causal."""
    len_q, len_k = q.shape[0], k.shape[0]
    repeat = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    allowed = torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=allowed)
    return out.transpose(0, 1)


def test_cpu_varlen_attention_equals_sdpa_per_segment_with_prefix_keys_and_gqa() -> None:
    torch.manual_seed(0)
    lens_q, lens_k = [5, 3, 1], [5, 7, 4]  # a whole segment, then segments with 4 and 3 prefix keys
    q = torch.randn(sum(lens_q), 4, 8)
    k, v = torch.randn(sum(lens_k), 2, 8), torch.randn(sum(lens_k), 2, 8)
    cu_q = torch.tensor([0, *np.cumsum(lens_q)])
    cu_k = torch.tensor([0, *np.cumsum(lens_k)])
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    for i in range(3):
        qs, ks, vs = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]], _reference_attention(qs, ks, vs))
    scaled = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=1.0 / math.sqrt(8), causal=True)
    torch.testing.assert_close(scaled, out)


def test_checkpoint_holds_the_sent_weights_and_the_base_for_the_rest(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    (base / "tokenizer.json").write_text("{}")
    dest = tmp_path / "out" / "sync-0001"
    dest.parent.mkdir()
    sent = write_checkpoint(base, dest, iter([("a", torch.full((2,), 7.0))]))
    weights = load_file(str(dest / "model.safetensors"))
    assert sent == ["a"] and weights["a"].tolist() == [7.0, 7.0] and weights["b"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in dest.parent.iterdir()] == ["sync-0001"]  # no temporary directory left


# -- TRL's trainer on polar rollouts -----------------------------------------------------------------------------


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_async_grpo", REPO / "examples" / "trl_async_grpo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trl_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three optimizer steps of TRL's AsyncGRPOTrainer, built by the example, on 2 toy tasks x 4 samples."""
    out = tmp_path_factory.mktemp("trl") / "run"
    example = _example()
    args = example.parse(
        ["--model", str(tiny_model_dir), "--out", str(out), "--steps", "3", "--samples", "4", "--task-limit", "2",
         "--concurrency", "8", "--token-budget", "384", "--max-length", "384"]
    )  # fmt: skip
    trainer, worker = example.make_trainer(args)
    received: list[Any] = []
    get = worker.rollout_buffer.get

    def recording_get(*a: Any, **kw: Any) -> Any:
        sample = get(*a, **kw)
        received.append(sample)
        return sample

    worker.rollout_buffer.get = recording_get  # the trainer holds this very queue
    trainer.train()
    return {"out": out, "trainer": trainer, "worker": worker, "received": received, "model": tiny_model_dir}


def _batch_calls(out: Path) -> dict[str, list[Any]]:
    calls: dict[str, list[Any]] = {}
    for shards in sorted(out.glob("batch-*/shards")):
        for record in iter_records(str(shards)):
            if record.status == "ok":
                calls.setdefault(record.session_id, []).append(record)
    return calls


@pytest.mark.slow
def test_end_to_end_trl_receives_the_captured_tokens_and_logprobs(trl_run: dict[str, Any]) -> None:
    received, calls = trl_run["received"], _batch_calls(trl_run["out"])
    assert len(received) >= 8
    every_call = [c for session in calls.values() for c in session]
    for sample in received:
        assert_captured(sample, every_call)
    # the samples are the trainer's view of exactly those calls: a planted shift is caught
    good = received[0]
    for bad in (
        dataclasses.replace(good, old_log_probs=np.roll(good.old_log_probs, 1)),
        dataclasses.replace(good, completion_mask=np.roll(good.completion_mask, 1)),
        dataclasses.replace(good, input_ids=np.roll(good.input_ids, 1)),
    ):
        with pytest.raises(AssertionError):
            assert_captured(bad, every_call)


@pytest.mark.slow
def test_end_to_end_trl_trains_on_the_served_policy_and_pushes_each_sync(trl_run: dict[str, Any]) -> None:
    trainer, worker, out = trl_run["trainer"], trl_run["worker"], trl_run["out"]
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 3 and trainer.state.global_step == 3
    # step 1 trains samples of the weights it starts from: TRL's logprobs are the engine's (ratio 1, no KL)
    assert abs(steps[0]["ratio"] - 1.0) < 1e-3 and steps[0]["kl"] < 1e-4, steps[0]
    assert any(s["grad_norm"] > 0 for s in steps)
    # every sync was written whole, and a batch after a training step was served from its checkpoint
    records = worker.batches
    assert records and all(r["statuses"]["completed"] == r["sessions"] for r in records)
    later = [r for r in records if r["version"] >= 2]
    assert later, [(r["batch"], r["version"]) for r in records]
    first = later[0]
    assert Path(first["policy"]).name == f"sync-{first['version']:04d}"
    shards = out / f"batch-{first['batch']:04d}" / "shards"
    assert {r.weight_version for r in iter_records(str(shards))} == {str(first["version"])}
    base = load_file(str(trl_run["model"] / "model.safetensors"))
    pushed = load_file(str(Path(first["policy"]) / "model.safetensors"))
    assert set(pushed) >= set(base)
    assert any(not torch.equal(pushed[name].float(), base[name].float()) for name in base)
    # TRL bounded the staleness it trained on by what the calls record
    assert all(sample.model_version >= 1 for sample in trl_run["received"])
    assert (out / "worker.json").is_file() and (out / "batch-0000" / "rollout-progress.json").is_file()
