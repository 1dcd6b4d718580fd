"""TraceGRPOTrainer on traces sampled from the tiny model: off-policy math, masks, outputs."""

from __future__ import annotations

import copy
import os
import statistics
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import torch

from polar_cli.train.advantages import SCALE_EPS
from polar_cli.train.config import TrainConfig
from polar_cli.train.dataset import prepare_rows
from polar_cli.train.run import build_trainer, run_training
from tests.support.train_traces import SessionSpec, TraceFactory, two_group_specs

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def factory(tiny_model_dir: Path) -> TraceFactory:
    return TraceFactory(tiny_model_dir, temperature=0.7, seed=1)


@pytest.fixture(scope="module")
def traces(factory: TraceFactory):
    return factory.traces(two_group_specs())


def config(model: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        inputs=[],
        model=str(model),
        output=out,
        learning_rate=1e-3,
        groups_per_step=2,
        max_steps=1,
        progress=False,
        dtype="float32",  # the 1e-4 on-policy bound is an fp32 statement (auto would pick bf16 on a GPU)
    )
    base.update(kw)
    return TrainConfig(**base)


def step_batches(cfg: TrainConfig, traces, **prep):
    data = prepare_rows(traces, max_length=cfg.max_length, **prep)
    trainer = build_trainer(cfg, data)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = cfg.grad_accum  # set by Trainer's loop, which these tests skip
    return trainer, trainer._build_step(list(range(len(data.groups))))


def chunks(batches):
    return [c for b in batches for c in b["chunks"]]


def policy_logps(trainer, chunk) -> torch.Tensor:
    return trainer._logps_no_grad(trainer.model, chunk)


def max_ratio_error(trainer, batches) -> float:
    worst = 0.0
    for chunk in chunks(batches):
        mask = chunk["loss_mask"].bool()
        ratio = torch.exp(policy_logps(trainer, chunk) - chunk["behavior_logps"])[mask]
        worst = max(worst, (ratio - 1).abs().max().item())
    return worst


def loss_and_grads(trainer, batches) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.zero_grad()
    total = 0.0
    for batch in batches:
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total, grads


def test_first_step_is_on_policy(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    """Captured logprobs, masks and positions line up with the trainer's own forward pass."""
    cfg = config(tiny_model_dir, tmp_path / "a", grad_accum=2)
    trainer, batches = step_batches(cfg, traces)
    assert trainer.args.temperature == 0.7  # read from the traces
    assert sum(int(c["loss_mask"].sum()) for c in chunks(batches)) == sum(sum(t.loss_mask) for t in traces)
    assert max_ratio_error(trainer, batches) < 1e-4

    # The logged ratios of a real first step say the same.
    result = run_training(cfg, traces=traces)
    first = next(r for r in map(orjson.loads, result.metrics_path.read_text().splitlines()) if "loss" in r)
    assert first["is_ratio/min"] > 1 - 1e-4 and first["is_ratio/max"] < 1 + 1e-4
    assert first["clip_ratio/region_mean"] == 0.0


def test_wrong_capture_temperature_is_visible_in_the_ratios(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    """Control for the test above: traces claiming T=1 while sampled at 0.7 are far off-policy."""
    mislabeled = [replace(t, temperature=1.0) for t in traces]
    trainer, batches = step_batches(config(tiny_model_dir, tmp_path), mislabeled)
    assert max_ratio_error(trainer, batches) > 1e-2


def test_tokens_under_mask_zero_do_not_change_the_loss(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    def with_tail(tail: list[int], placeholder: float):
        out = []
        for t in traces:
            t = copy.deepcopy(t)
            t.completion_ids += tail
            t.loss_mask += [0] * len(tail)
            lps = t.behavior_logprobs + [0.0] * len(tail)
            t.behavior_logprobs = [lp if m else placeholder for lp, m in zip(lps, t.loss_mask, strict=True)]
            out.append(t)
        return out

    cfg = config(tiny_model_dir, tmp_path)
    trainer, batches_a = step_batches(cfg, with_tail([5, 6, 7], 0.0))
    _, batches_b = step_batches(cfg, with_tail([900, 901, 902], -3.5))
    loss_a, grads_a = loss_and_grads(trainer, batches_a)
    loss_b, grads_b = loss_and_grads(trainer, batches_b)
    assert loss_a == pytest.approx(loss_b, abs=1e-7)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-7, rtol=0)


def test_constant_reward_group_gives_zero_gradient(tiny_model_dir: Path, factory: TraceFactory, tmp_path: Path) -> None:
    flat = factory.traces([SessionSpec("g", f"s{i}", 1.0) for i in range(4)])
    trainer, batches = step_batches(config(tiny_model_dir, tmp_path), flat, drop_zero_advantage=False)
    assert all(float(c["advantages"].abs().max()) == 0.0 for c in chunks(batches))
    _, grads = loss_and_grads(trainer, batches)
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads.values())

    # control: one differing reward in the group and the gradient is not zero
    mixed = copy.deepcopy(flat)
    mixed[0].reward = 0.0
    trainer, batches = step_batches(config(tiny_model_dir, tmp_path), mixed)
    _, grads = loss_and_grads(trainer, batches)
    assert max(float(g.abs().max()) for g in grads.values()) > 0.0


def test_session_with_two_traces_is_one_sample(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    trainer, batches = step_batches(config(tiny_model_dir, tmp_path), traces)
    logged = trainer._metrics["train"]
    assert logged["step/traces"][-1] == 9 and logged["step/sessions"][-1] == pytest.approx(8.0)
    # Session rewards per group (g0-s0 fans out into two traces, both rewarded 1, one vote):
    # A = (r - mean of the other sessions) / (stdev of the session rewards + eps), computed by hand.
    expected = {}
    for group, rewards in {"g0": [1.0, 0.0, 1.0, 0.0], "g1": [0.5, 0.0, 1.0, 0.25]}.items():
        s = statistics.stdev(rewards) + SCALE_EPS
        for i, r in enumerate(rewards):
            expected[f"{group}-s{i}"] = (r - (sum(rewards) - r) / 3) / s
    assert expected["g0-s0"] == pytest.approx(2 / 3 / (statistics.stdev([1, 0, 1, 0]) + SCALE_EPS))
    rows = trainer.data.rows
    assert sorted(r.session_id for r in rows).count("g0-s0") == 2
    for row in rows:
        assert row.advantage == pytest.approx(expected[row.session_id], rel=1e-12), row.trace_id
    in_batches = sorted(a for c in chunks(batches) for a in c["advantages"].tolist())
    assert in_batches == pytest.approx(sorted(expected[r.session_id] for r in rows), rel=1e-6)


def test_training_moves_probability_toward_rewarded_sessions(
    tiny_model_dir: Path, factory: TraceFactory, tmp_path: Path
) -> None:
    specs = [SessionSpec("g", "good", 1.0), SessionSpec("g", "bad", 0.0)]
    pair = factory.traces(specs)
    cfg = config(tiny_model_dir, tmp_path / "out", max_steps=4, groups_per_step=1)
    run_training(cfg, traces=pair)

    def seq_logp(model_dir) -> dict[str, float]:
        trainer, batches = step_batches(replace(cfg, model=str(model_dir)), pair, drop_zero_advantage=False)
        out = {}
        for chunk in chunks(batches):
            lp = policy_logps(trainer, chunk) * chunk["loss_mask"]
            for row_lp, adv in zip(lp.sum(1).tolist(), chunk["advantages"].tolist(), strict=True):
                out["good" if adv > 0 else "bad"] = row_lp
        return out

    before, after = seq_logp(tiny_model_dir), seq_logp(tmp_path / "out")
    assert after["good"] > before["good"] + 0.5
    assert after["bad"] < before["bad"] - 0.5


def test_outputs_checkpoint_metrics_and_curves(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "ckpt"
    result = run_training(config(tiny_model_dir, out, max_steps=2, grad_accum=2), traces=traces)
    assert result.steps == 2
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert (out / "chat_template.jinja").read_text() == (tiny_model_dir / "chat_template.jinja").read_text()
    assert orjson.loads((out / "config.json").read_bytes())["use_cache"] is True
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    AutoModelForCausalLM.from_pretrained(out)
    trained, base = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)

    logs = [r for r in map(orjson.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2]
    for key in ("reward", "loss", "clip_ratio/region_mean", "is_ratio/mean", "is_ratio/truncated_frac", "num_tokens"):
        assert all(key in r for r in logs), key
    assert result.plot_path is not None and result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lora_is_merged_on_save(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "lora"
    run_training(config(tiny_model_dir, out, max_steps=2, lora_r=4, learning_rate=5e-2), traces=traces)
    trained, base = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert trained.keys() == base.keys()  # no lora_A / lora_B / base_layer names
    changed = [k for k in base if not torch.equal(trained[k], base[k])]
    assert changed and all("proj" in k for k in changed)  # only the adapted linear layers moved


def test_kl_to_the_start_model_is_zero_at_the_first_step(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    result = run_training(config(tiny_model_dir, tmp_path / "kl", beta=0.05, max_steps=2), traces=traces)
    logs = [r for r in map(orjson.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    assert abs(logs[0]["kl"]) < 1e-6
    assert logs[1]["kl"] > 1e-6


def test_resume_continues_exactly(tiny_model_dir: Path, traces, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    full = tmp_path / "full"
    cfg = config(tiny_model_dir, full, max_steps=3, groups_per_step=1, save_steps=1, save_total_limit=3)
    run_training(cfg, traces=traces)
    assert (full / "checkpoint-1").is_dir()
    resumed = tmp_path / "resumed"
    run_training(
        config(tiny_model_dir, resumed, max_steps=3, groups_per_step=1, resume=full / "checkpoint-1"), traces=traces
    )
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
