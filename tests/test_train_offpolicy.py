"""Issue 10: the RL math on a model stored like a real one (bf16 weights), at a real learning rate.

Each test here pins one defect of the first `polar train`: pure-bf16 parameters that never move at
lr 1e-6, a LoRA merge rounded twice, TIS implemented as a dual clip against the behaviour logprob,
CISPO capped at epsilon_high, a -9999 behaviour logprob turning the step into NaN, an inexact
resume with num_iterations > 1, warmup never reaching TRL, stale traces trained silently.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import torch

from polar_cli.train.config import TrainConfig
from polar_cli.train.dataset import length_buckets, prepare_rows
from polar_cli.train.run import StaleTraces, build_trainer, check_staleness, run_training
from polar_cli.train.trainer import build_grpo_config
from tests.support.train_traces import SessionSpec, TraceFactory, two_group_specs

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from polar_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bf16", dtype="bfloat16")


@pytest.fixture(scope="module")
def traces(bf16_model_dir: Path):
    return TraceFactory(bf16_model_dir, temperature=0.7, seed=3).traces(two_group_specs())


def config(model: Path, out: Path, **kw) -> TrainConfig:
    base = dict(inputs=[], model=str(model), output=out, learning_rate=1e-6, groups_per_step=2, max_steps=1,
                progress=False, plot=False, dtype="float32")  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def first_step(cfg: TrainConfig, traces):
    data = prepare_rows(traces, max_length=cfg.max_length)
    trainer = build_trainer(cfg, data)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = cfg.grad_accum
    [batch] = trainer._build_step(list(range(len(data.groups))))
    return trainer, batch


def surrogate(trainer, batch, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-computed first-step loss and its gradient's surrogate: -sum(A * w * logp) / N."""
    n = batch["num_items_in_batch"]
    value = torch.zeros(())
    grad_loss = torch.zeros(())
    for chunk in batch["chunks"]:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, chunk["input_ids"], chunk["attention_mask"], chunk["logits_to_keep"]
        )
        w = weight(logps.detach(), chunk["behavior_logps"]) * chunk["loss_mask"]
        adv = chunk["advantages"].unsqueeze(1)
        value = value - (adv * w).sum() / n
        grad_loss = grad_loss - (adv * w * logps).sum() / n
    return value, grad_loss


def grads(trainer, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    trainer.model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def shifted(traces, shift_of_index):
    """Traces whose behaviour logprob of sampled token i is moved by shift_of_index(i)."""
    out = []
    for t in traces:
        lps, k = [], 0
        for lp, m in zip(t.behavior_logprobs, t.loss_mask, strict=True):
            lps.append(lp + shift_of_index(k) if m else lp)
            k += m
        out.append(replace(t, behavior_logprobs=lps))
    return out


# --- 1. dtype policy ---------------------------------------------------------------------------


def test_bf16_model_weights_move_at_lr_1e_6(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """bf16 compute keeps fp32 master weights: every weight moves at lr 1e-6 (pure bf16: ~2%)."""
    from safetensors.torch import load_file

    cfg = config(bf16_model_dir, tmp_path / "out", dtype="bfloat16", max_steps=2)
    data = prepare_rows(traces, max_length=cfg.max_length)
    trainer = build_trainer(cfg, data)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    moved = sum(int((params[n].detach() != start[n]).sum()) for n in start)
    total = sum(v.numel() for v in start.values())
    assert moved / total > 0.99, f"{moved}/{total} weights moved"
    norms = [n for n in start if "norm" in n]
    assert norms and all(not torch.equal(params[n].detach(), start[n]) for n in norms)
    # bf16 autocast really ran: the step's logged ratio is not fp32-exact
    logs = [r for r in trainer.state.log_history if "is_ratio/max" in r]
    assert logs and logs[0]["is_ratio/max"] > 1 + 1e-5

    # the checkpoint is written in the dtype the engine serves (the model's own), whatever the compute dtype
    from polar_cli.train.run import save_checkpoint, serving_dtype

    save_checkpoint(trainer, tmp_path / "ckpt", serving_dtype(cfg.model))
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    for name, value in saved.items():
        torch.testing.assert_close(value, params[name].detach().to(torch.bfloat16), atol=0, rtol=0)


def test_fp32_compute_still_saves_in_the_serving_dtype(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "fp32"
    run_training(config(bf16_model_dir, out, dtype="float32"), traces=traces)
    saved = load_file(out / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    assert orjson.loads((out / "config.json").read_bytes())["dtype"] == "bfloat16"


def _bf16_neighbour_gap(w: torch.Tensor, toward: torch.Tensor) -> torch.Tensor:
    """Distance from bf16 values ``w`` to their bf16 neighbour in the direction of ``toward``'s sign."""
    w16 = w.to(torch.bfloat16)
    limit = torch.where(toward >= 0, float("inf"), float("-inf")).to(torch.bfloat16)
    return (torch.nextafter(w16, limit).float() - w16.float()).abs()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float32: what --dtype auto is on a CPU
def test_lora_merges_in_fp32_then_rounds_once(bf16_model_dir: Path, traces, tmp_path: Path, dtype: str) -> None:
    """At lr 1e-6 the LoRA delta is far below half a bf16 ulp for most weights (as in real runs).

    The served checkpoint must be the trained policy W + s * B @ A, computed in fp32 and rounded
    once to the dtype the engine serves (the base model's bf16): exactly that for every adapted
    weight, changed wherever the fp32 policy is more than half a bf16 step from the base, and the
    weights LoRA does not adapt left bit-identical.
    """
    from safetensors.torch import load_file

    out = tmp_path / "lora"
    cfg = config(bf16_model_dir, out, lora_r=4, learning_rate=1e-6, max_steps=2, save_steps=2, dtype=dtype)
    run_training(cfg, traces=traces)
    adapter = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    base = load_file(bf16_model_dir / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    assert {v.dtype for v in merged.values()} == {torch.bfloat16}
    scaling = (2 * 4) / 4
    adapted, total, sub_ulp, must_move = set(), 0, 0, 0
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        name = key.split(".lora_A.")[0].removeprefix("base_model.model.") + ".weight"
        w = base[name].float()
        delta = scaling * (adapter[key.replace(".lora_A.", ".lora_B.")].float() @ a.float())
        policy = w + delta
        torch.testing.assert_close(merged[name], policy.to(torch.bfloat16), atol=0, rtol=0)
        gap = _bf16_neighbour_gap(w, delta)
        far = delta.abs() > gap / 2
        assert torch.all(merged[name][far].float() != w[far]), name
        adapted.add(name)
        total += w.numel()
        sub_ulp += int((delta != 0).logical_and(~far).sum())
        must_move += int(far.sum())
    assert len(adapted) >= 2 * 7  # every linear layer of both blocks
    # the regime of a real run: most deltas vanish in bf16, yet some weights do move
    assert sub_ulp > 0.9 * total and must_move > 0, (sub_ulp, must_move, total)
    for name, value in merged.items():
        if name not in adapted:
            torch.testing.assert_close(value, base[name], atol=0, rtol=0)


def test_checkpoint_is_the_accelerators_full_state_dict(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """Under FSDP / ZeRO-3 each process holds a shard: only the accelerator's state dict is whole.

    accelerate (1.15) runs FSDP only on accelerator devices (on CPU, ``--use_fsdp`` silently becomes
    gloo DDP), so this checks the contract on one process: every process calls ``get_state_dict``
    (a collective), and the checkpoint is exactly what it returned, cast to the serving dtype.
    """
    from safetensors.torch import load_file

    from polar_cli.train.run import save_checkpoint

    trainer, _ = first_step(config(bf16_model_dir, tmp_path / "out"), traces)
    gathered = trainer.accelerator.get_state_dict(trainer.model)
    for value in gathered.values():
        value.add_(torch.randn_like(value) * 0.01)  # what the local module holds is no longer the answer
    calls = []
    trainer.accelerator.get_state_dict = lambda model, *a, **k: calls.append(model) or gathered
    save_checkpoint(trainer, tmp_path / "ckpt", torch.bfloat16)
    assert calls == [trainer.model]
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    base = load_file(bf16_model_dir / "model.safetensors")
    assert sorted(saved) == sorted(base)
    for name, value in saved.items():
        assert value.shape == base[name].shape and value.numel() > 0
        torch.testing.assert_close(value, gathered[name].to(torch.bfloat16), atol=0, rtol=0)


# --- 2/3/5. the loss --------------------------------------------------------------------------


def test_tis_weight_is_truncated_at_the_cap(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """Behaviour logprobs 3 nats below the trainer's (ratio e^3 = 20) weigh C = 2; others e^-0.5.

    At the first step the PPO ratio (against the trainer's own old logprob) is exactly 1, so the
    loss is -sum(A * min(exp(old - behaviour), C)) / N and its gradient -sum(A * w * grad logp) / N.
    A cap not passed through (e.g. 1e9) would weigh the shifted tokens 20.
    """
    off = shifted(traces, lambda k: -3.0 if k % 2 == 0 else 0.5)
    trainer, batch = first_step(config(bf16_model_dir, tmp_path, tis_cap=2.0), off)
    assert trainer.args.tis_cap == 2.0
    loss = trainer._compute_loss(trainer.model, batch)
    value, grad_loss = surrogate(trainer, batch, lambda old, behav: torch.clamp(torch.exp(old - behav), max=2.0))
    untruncated, _ = surrogate(trainer, batch, lambda old, behav: torch.exp(old - behav))
    assert loss.item() == pytest.approx(value.item(), rel=1e-5)
    assert abs(untruncated.item() - value.item()) > 0.1 * abs(value.item())  # the cap mattered
    assert trainer._metrics["train"]["is_ratio/truncated_frac"][-1] == pytest.approx(0.5, abs=0.1)
    got, want = grads(trainer, loss), grads(trainer, grad_loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-7, rtol=1e-4)


def test_mismatched_tokens_are_not_clipped_at_step_0(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """A 0.5-nat engine/trainer mismatch is importance-weighted, not treated as policy drift and clipped."""
    off = shifted(traces, lambda k: -0.5)
    trainer, batch = first_step(config(bf16_model_dir, tmp_path), off)
    trainer._compute_loss(trainer.model, batch)
    assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] == 0.0
    assert trainer._metrics["train"]["tis/weight_mean"][-1] == pytest.approx(math.exp(0.5), rel=1e-3)


def test_cispo_has_its_own_cap(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """On-policy CISPO weighs every token 1 (TRL's epsilon_high cap 0.28 weighed all of them 0.28)."""
    trainer, batch = first_step(config(bf16_model_dir, tmp_path, loss_type="cispo"), traces)
    assert trainer.args.cispo_cap == 5.0
    loss = trainer._compute_loss(trainer.model, batch)
    _, grad_loss = surrogate(trainer, batch, lambda old, behav: torch.clamp(torch.exp(old - behav), max=2.0))
    got, want = grads(trainer, loss), grads(trainer, grad_loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("sentinel", [-100.0, -9999.0])
def test_absurd_behaviour_logprob_does_not_nan_the_step(bf16_model_dir: Path, traces, tmp_path: Path, sentinel):
    off = shifted(traces, lambda k: sentinel if k == 1 else 0.0)
    off = [replace(t, behavior_logprobs=[sentinel if (m and i == 1) else lp for i, (lp, m) in
                                         enumerate(zip(t.behavior_logprobs, t.loss_mask, strict=True))])
           for t in traces]  # fmt: skip
    trainer, batch = first_step(config(bf16_model_dir, tmp_path), off)
    loss = trainer._compute_loss(trainer.model, batch)
    assert math.isfinite(loss.item())
    value, _ = surrogate(trainer, batch, lambda old, behav: torch.exp(torch.clamp(old - behav, max=math.log(2.0))))
    assert loss.item() == pytest.approx(value.item(), rel=1e-5)
    assert all(torch.isfinite(g).all() for g in grads(trainer, loss).values())


def test_build_grpo_config_passes_the_caps_warmup_and_fp32_master(tmp_path: Path) -> None:
    cfg = TrainConfig(inputs=[], model="m", output=tmp_path, tis_cap=3.0, cispo_cap=4.0, warmup_ratio=0.25,
                      dtype="bfloat16")  # fmt: skip
    args = build_grpo_config(cfg, temperature=0.6, max_completion_length=8)
    assert (args.tis_cap, args.cispo_cap, args.delta) == (3.0, 4.0, None)
    assert args.warmup_steps == 0.25 and args.lr_scheduler_type == "constant_with_warmup"
    assert args.model_init_kwargs["dtype"] == torch.float32 and args.bf16


# --- 9. resume, staleness ----------------------------------------------------------------------


def test_resume_mid_batch_is_exact_with_two_iterations(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """checkpoint-1 is between the two iterations on the first batch; TRL restarts its counter at 0."""
    from safetensors.torch import load_file

    kw = dict(max_steps=3, groups_per_step=1, num_iterations=2, learning_rate=1e-3, dtype="float32")
    full = tmp_path / "full"
    run_training(config(bf16_model_dir, full, save_steps=1, save_total_limit=3, **kw), traces=traces)
    resumed = tmp_path / "resumed"
    run_training(config(bf16_model_dir, resumed, resume=full / "checkpoint-1", **kw), traces=traces)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert any(not torch.equal(a[k], load_file(bf16_model_dir / "model.safetensors")[k]) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_clip_against_start_scores_every_row_with_the_weights_before_any_update(
    bf16_model_dir: Path, traces, tmp_path: Path
) -> None:
    """The starting weights' logprob of every completion token (what --clip-against start clips against) is the
    trainer's own first-step logprob, in the right place: the traces were sampled by these weights, so it equals
    the captured behaviour logprob; and the step's chunks carry exactly that table as old_logps."""
    trainer, batch = first_step(config(bf16_model_dir, tmp_path, clip_against="start", groups_per_step=2), traces)
    table = trainer._start_logps
    assert table is not None and len(table) == len(trainer.data.rows)
    for logps, row in zip(table, trainer.data.rows, strict=True):
        assert len(logps) == len(row.completion_ids)
        sampled = torch.tensor(row.loss_mask).bool()  # the rest (tool results, template glue) were not sampled
        assert sampled.any()
        torch.testing.assert_close(logps[sampled], torch.tensor(row.behavior_logprobs)[sampled], atol=1e-4, rtol=0)
    for chunk in batch["chunks"]:
        mask = chunk["loss_mask"].bool()
        torch.testing.assert_close(chunk["old_logps"][mask], chunk["behavior_logps"][mask], atol=1e-4, rtol=0)


def _logged(result) -> list[dict]:
    return [r for r in map(orjson.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]


def test_clip_against_start_bounds_the_drift_of_the_whole_run(bf16_model_dir: Path, traces, tmp_path: Path) -> None:
    """Six steps on the same two groups at a high lr. Clipping against each step's own weights (``step``,
    --num-iterations 1) never clips, and its TIS weight follows the drifted policy; clipping against the start
    clips the tokens that moved past 1 + eps since the run began, and its TIS weight stays the start/behaviour
    ratio (1 for these on-policy traces)."""
    kw = dict(max_steps=6, groups_per_step=1, learning_rate=5e-3, weight_decay=0.0)
    step = _logged(run_training(config(bf16_model_dir, tmp_path / "step", clip_against="step", **kw), traces=traces))
    start = _logged(run_training(config(bf16_model_dir, tmp_path / "start", clip_against="start", **kw), traces=traces))
    print([(r["step"], round(r["clip_ratio/region_mean"], 3), round(r["tis/weight_mean"], 3)) for r in start])
    assert all(r["clip_ratio/region_mean"] == 0.0 for r in step)
    assert max(abs(r["tis/weight_mean"] - 1) for r in step[1:]) > 0.05
    assert start[0]["clip_ratio/region_mean"] == 0.0 and max(r["clip_ratio/region_mean"] for r in start) > 0.05
    assert all(abs(r["tis/weight_mean"] - 1) < 1e-3 for r in start)


def test_resume_with_clip_against_start_clips_against_the_run_s_start(
    bf16_model_dir: Path, traces, tmp_path: Path
) -> None:
    """checkpoint-1's weights are not the start: a resumed run takes the table saved with the checkpoint, so it
    ends exactly where the uninterrupted run does; a checkpoint without the table is refused."""
    from safetensors.torch import load_file

    kw = dict(max_steps=4, groups_per_step=1, learning_rate=5e-3, weight_decay=0.0, clip_against="start")
    full = tmp_path / "full"
    run_training(config(bf16_model_dir, full, save_steps=1, save_total_limit=4, **kw), traces=traces)
    resumed = tmp_path / "resumed"
    run_training(config(bf16_model_dir, resumed, resume=full / "checkpoint-2", **kw), traces=traces)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    fewer = [t for t in traces if t.group_id == traces[0].group_id]  # one group of the two
    with pytest.raises(ValueError, match=r"scores \d+ traces, these inputs have \d+: resume with the inputs"):
        run_training(config(bf16_model_dir, tmp_path / "other", resume=full / "checkpoint-2", **kw), traces=fewer)
    (full / "checkpoint-2" / "polar_start_logps.pt").unlink()
    with pytest.raises(FileNotFoundError, match="--clip-against start, resume needs"):
        run_training(config(bf16_model_dir, tmp_path / "again", resume=full / "checkpoint-2", **kw), traces=traces)


def test_stale_traces_are_warned_about_and_bounded(traces, caplog) -> None:
    versions = [replace(t, weight_versions=[v]) for t, v in zip(traces, ["3", "3", "2", "1"] * 3, strict=False)]
    assert check_staleness(versions, None, None) == 0
    with caplog.at_level(logging.WARNING, logger="polar.train"):
        assert check_staleness(versions, "3", max_staleness=2) == sum(t.weight_versions != ["3"] for t in versions)
    assert "up to 2 versions behind" in caplog.text
    with pytest.raises(StaleTraces, match="max-staleness is 1"):
        check_staleness(versions, "3", max_staleness=1)


# --- efficiency --------------------------------------------------------------------------------


def test_length_buckets_bound_padding() -> None:
    lengths = [900, 40, 880, 35, 60, 870, 50, 45]
    buckets = length_buckets(lengths, 0.1)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    padded = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in buckets)
    assert padded <= 0.1 * sum(lengths)
    assert sorted(buckets[0]) == [0, 2, 5]  # the long rows share one forward


def test_mixed_trace_shapes_pad_little(bf16_model_dir: Path, tmp_path: Path) -> None:
    """Merged traces (short prompt, long completion) next to per-request ones (long prompt)."""
    factory = TraceFactory(bf16_model_dir, temperature=0.7, seed=5)
    specs = [SessionSpec("g", f"s{i}", float(i % 2)) for i in range(4)]
    merged = [factory.trace(s, 0, first=24, second=24) for s in specs]
    long_prompt = "word " * 60
    per_request = [replace(factory.trace(s, 1, prompt_text=long_prompt, first=4, second=2),
                           trace_id=f"{s.session_id}-pr")
                   for s in specs]  # fmt: skip
    trainer, batch = first_step(config(bf16_model_dir, tmp_path, groups_per_step=1), merged + per_request)
    real = sum(int(c["attention_mask"].sum()) for c in batch["chunks"])
    padded = sum(int(c["attention_mask"].numel()) for c in batch["chunks"]) - real
    assert padded <= 0.1 * real, (padded, real)
