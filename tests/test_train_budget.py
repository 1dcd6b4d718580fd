"""`polar train`'s token budget per forward, checkpointing switch, trained-position log-probs and step plan.

The real-model tests use a Qwen2-shaped model stored in bf16 with Qwen2.5's 151,936-entry vocabulary and untied head
(the shape that ran out of memory in issue 24), hundreds of tokens per trace, and the real TRL trainer.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from polar_cli.trace import Trace
from polar_cli.train.budget import (
    GIB,
    ModelShape,
    activation_bytes_per_token,
    lora_trainable_params,
    plan_memory,
    plan_steps,
)
from polar_cli.train.config import TrainConfig
from polar_cli.train.dataset import length_buckets, prepare_rows
from tests.test_train_trainer import config as trainer_config

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# Qwen2.5-0.5B(-Coder)-Instruct's config (issue 24's model: 630M parameters with the head untied).
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=False,
)
QWEN_VOCAB = 151936


def qwen25_shape(lora_r: int = 16) -> ModelShape:
    from transformers import Qwen2Config

    shape = ModelShape.from_config(Qwen2Config(**QWEN25_05B))
    return ModelShape(**{**shape.__dict__, "trainable_params": lora_trainable_params(shape, lora_r)})


# --- pure: packing and the memory plan -----------------------------------------------------------------------------


def test_forwards_stay_under_the_budget_and_cover_every_row_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(200, 2400) for _ in range(40)]
    for budget in (1000, 2500, 6000):
        groups = length_buckets(lengths, 0.1, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            padded = len(g) * max(lengths[i] for i in g)
            assert padded <= budget or len(g) == 1, (budget, g, padded)
    # A bigger budget never needs more forwards; no budget is the old padding-only grouping.
    assert len(length_buckets(lengths, 0.1, 1000)) >= len(length_buckets(lengths, 0.1, 6000))
    assert length_buckets(lengths, 0.1, 0) == length_buckets(lengths, 0.1)
    # Eight equal 1.65k traces (issue 24's Pi step): one forward unbounded, four of two under a 4k budget.
    assert len(length_buckets([1650] * 8, 0.1)) == 1
    assert [len(g) for g in length_buckets([1650] * 8, 0.1, 4000)] == [2, 2, 2, 2]


def test_model_shape_counts_qwen25_05b_parameters() -> None:
    shape = qwen25_shape()
    assert 0.62e9 < shape.num_params < 0.64e9  # 630M with the untied head
    assert 8e6 < shape.trainable_params < 10e6  # LoRA r=16 on every linear layer (PEFT says 8.8M)


def test_issue_24_case_fits_a_24_gb_machine_by_default() -> None:
    """8 Pi traces of ~1.65k tokens, LoRA r=16, the 0.5B model: the old default forwarded all 13.2k tokens at
    once (~40 GiB of activations by this estimate; OOM-killed at 24 GB). The default budget must keep the estimate
    inside the memory free on a 24 GB machine, with or without checkpointing."""
    shape = qwen25_shape()
    old = 13_236 * activation_bytes_per_token(shape, checkpointing=False)
    assert old > 24 * GIB
    for free_gib in (20, 12):
        plan = plan_memory(shape, longest_row=1700, available=free_gib * GIB)
        assert plan.needed_bytes <= 0.6 * free_gib * GIB, (free_gib, plan)
        assert "may not fit" not in plan.why
        assert plan.token_budget >= 1700  # the longest trace fits one forward
        # Without checkpointing while a forward of the longest trace fits without it; with it below.
        plain = plan_memory(shape, 1700, gradient_checkpointing=False, available=free_gib * GIB)
        assert plan.gradient_checkpointing == (plain.needed_bytes > 0.6 * free_gib * GIB)
        assert ("gradient checkpointing on" in plan.why) == plan.gradient_checkpointing
    assert not plan_memory(shape, 1700, available=20 * GIB).gradient_checkpointing
    assert plan_memory(shape, 1700, available=8 * GIB).gradient_checkpointing
    # Less than the weights and one trace need: still one trace per forward, and said.
    short = plan_memory(shape, 1700, available=5 * GIB)
    assert short.gradient_checkpointing and short.token_budget == 1700 and "may not fit" in short.why


def test_a_given_budget_is_kept_and_checkpointing_follows_it() -> None:
    shape = qwen25_shape()
    small = plan_memory(shape, 1700, token_budget=2048, available=20 * GIB)
    assert (small.token_budget, small.gradient_checkpointing) == (2048, False)
    big = plan_memory(shape, 1700, token_budget=16384, available=20 * GIB)
    assert (big.token_budget, big.gradient_checkpointing) == (16384, True)
    assert "gradient checkpointing on: a 16384-token forward needs" in big.why
    forced = plan_memory(shape, 1700, token_budget=16384, gradient_checkpointing=False, available=20 * GIB)
    assert not forced.gradient_checkpointing and "as asked" in forced.why
    unknown = plan_memory(shape, 1700, available=None)
    assert unknown.token_budget == 8192 and unknown.gradient_checkpointing


def test_step_plan_counts_forward_and_trainable_tokens() -> None:
    lengths, trainable = [1650] * 8, [250] * 8
    plan = plan_steps([list(range(8))], lengths, trainable, micro_batches=1, token_budget=4000, pad_waste=0.1)
    assert plan.forward_tokens == (13200, 13200, 13200)
    assert plan.trainable_tokens == (2000, 2000, 2000)
    assert plan.forwards == (4, 4, 4)
    text = plan.describe(4000, checkpointing=False, tokens_per_s=100.0)
    assert "13,200 forward tokens, 2,000 trainable, in 4 forwards of <= 4,000 tokens" in text
    assert "~6.6 min a step (scoring ran at 100 tokens/s)" in text  # 3 x 13,200 / 100 s


# --- the real trainer on a Qwen2-shaped bf16 model with Qwen's vocabulary -------------------------------------------


@pytest.fixture(scope="module")
def qwen2_bf16_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("models") / "qwen2-bf16"
    torch.manual_seed(0)
    config = Qwen2Config(
        **{
            **QWEN25_05B,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,  # checkpointing keeps less than the plain backward from 3 layers on
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        dtype="bfloat16",
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in os.listdir(tiny_model_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(tiny_model_dir / name, out / name)
    return out


def long_traces(n_groups: int = 2, per_group: int = 4, seed: int = 0, turn: tuple[int, int] = (8, 24)) -> list[Trace]:
    """Agent-like traces: long prompts, two sampled turns around a masked interstitial, mixed rewards. (Short turns:
    on CPU the 151,936-entry head costs ~20 elementwise passes over (trained positions x vocabulary).)"""
    rng = random.Random(seed)
    traces = []
    for g in range(n_groups):
        for s in range(per_group):
            prompt = [rng.randrange(QWEN_VOCAB) for _ in range(rng.randint(300, 700))]
            a1, u, a2 = (rng.randint(*turn), rng.randint(3, 10), rng.randint(*turn))
            completion = [rng.randrange(QWEN_VOCAB) for _ in range(a1 + u + a2)]
            mask = [1] * a1 + [0] * u + [1] * a2
            behavior = [-rng.uniform(9.0, 14.0) if m else 0.0 for m in mask]  # ~log(1/151936) = -11.9
            traces.append(
                Trace(
                    trace_id=f"g{g}-s{s}",
                    session_id=f"g{g}-s{s}",
                    task_id=f"g{g}",
                    group_id=f"g{g}",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    loss_mask=mask,
                    behavior_logprobs=behavior,
                    reward=float(s % 2) + 0.25 * g,
                    temperature=1.0,
                    calls_merged=2,
                )
            )
    return traces


def config(model: Path, out: Path, **kw) -> TrainConfig:
    """test_train_trainer's config, without curves and clipped against each step's own weights."""
    return trainer_config(model, out, **{"plot": False, "clip_against": "step", **kw})


def step_loss_and_grads(
    cfg: TrainConfig, data, one_forward: bool = False
) -> tuple[float, dict[str, torch.Tensor], list[int]]:
    from polar_cli.train.run import build_trainer

    trainer = build_trainer(cfg, data)
    if one_forward:  # no length buckets either: the whole step padded into one forward
        trainer.args.pad_waste = float("inf")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = cfg.grad_accum
    batches = trainer._build_step(list(range(len(data.groups))))
    trainer.model.zero_grad()
    total = 0.0
    for batch in batches:
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    widths = [c["input_ids"].numel() for b in batches for c in b["chunks"]]
    return total, grads, widths


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_budgeted_forwards_give_the_one_forward_loss_and_gradient(
    qwen2_bf16_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    data = prepare_rows(long_traces(), max_length=4096)
    longest = max(r.num_tokens for r in data.rows)
    one_loss, one_grads, one_widths = step_loss_and_grads(
        config(qwen2_bf16_dir, tmp_path / "one", loss_type=loss_type, token_budget=0), data, one_forward=True
    )
    budget = int(longest * 1.5)  # at most one row of the longest kind per forward
    cut_loss, cut_grads, cut_widths = step_loss_and_grads(
        config(qwen2_bf16_dir, tmp_path / "cut", loss_type=loss_type, token_budget=budget), data
    )
    assert len(one_widths) == 1 and len(cut_widths) >= 4
    assert max(cut_widths) <= max(budget, longest)
    assert cut_loss == pytest.approx(one_loss, rel=1e-5, abs=1e-7)
    assert one_grads.keys() == cut_grads.keys() and one_grads
    for name, g in one_grads.items():
        torch.testing.assert_close(cut_grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_trained_positions_logprobs_equal_a_full_vocabulary_log_softmax(qwen2_bf16_dir: Path, tmp_path: Path) -> None:
    from polar_cli.train.run import build_trainer

    data = prepare_rows(long_traces(1, 3, seed=1), max_length=4096)
    trainer = build_trainer(config(qwen2_bf16_dir, tmp_path / "lp", groups_per_step=1), data)
    chunk = trainer._build_step([0])[0]["chunks"][0]
    with torch.no_grad():
        ours = trainer._logps_no_grad(trainer.model, chunk)
        logits = trainer.model(input_ids=chunk["input_ids"], attention_mask=chunk["attention_mask"]).logits
        keep = chunk["logits_to_keep"]
        full = torch.log_softmax(logits[:, -keep - 1 : -1].float() / trainer.temperature, dim=-1)
        ref = full.gather(-1, chunk["input_ids"][:, -keep:].unsqueeze(-1)).squeeze(-1)
    mask = chunk["loss_mask"].bool()
    assert mask.sum() > 0 and (~mask).sum() > 0
    torch.testing.assert_close(ours[mask], ref[mask], rtol=1e-5, atol=1e-5)
    assert (ours[~mask] == 0).all()  # never scored


def test_run_says_the_plan_and_checkpoints_when_memory_is_short(
    qwen2_bf16_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told only a little memory is free, `polar train` checkpoints activations, says so and what a step holds,
    and trains (real TRL loop: every forward its own backward)."""
    import orjson
    from transformers import AutoConfig

    from polar_cli.train import budget
    from polar_cli.train.run import run_training

    traces = long_traces(per_group=2)
    data = prepare_rows(traces, max_length=4096)
    longest = max(r.num_tokens for r in data.rows)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(qwen2_bf16_dir))
    fixed = budget.static_bytes(shape) + budget.head_bytes(shape)
    # Free memory for ~1.5 longest traces with checkpointing, far less than one without it.
    free = (fixed + int(1.5 * longest * activation_bytes_per_token(shape, True))) / budget.USABLE_FRACTION
    monkeypatch.setattr(budget, "available_memory", lambda processes=1: int(free))
    lines: list[str] = []
    result = run_training(
        config(qwen2_bf16_dir, tmp_path / "run", clip_against="start"), traces=traces, echo=lines.append
    )
    text = "\n".join(lines)
    assert result.memory.gradient_checkpointing and "gradient checkpointing on: the longest trace" in text
    assert f"forwards of <= {result.memory.token_budget:,} tokens" in text and "trainable" in text
    assert "a step (scoring ran at" in text  # the estimate from the measured start pass
    metrics = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().split()]
    assert any("loss" in m and m["loss"] == m["loss"] for m in metrics)
