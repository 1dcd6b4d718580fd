"""The trainer's own pieces, without a training run: what a step reports (`step_metrics`), the order steps come in
(`StepSampler`), where each row's completion sits in a forward's scored window (`_window`), the filler row, the
TRL arguments built from `polar train`'s options, the compute dtype, and the chunked loss (`_chunk_loss`,
`_compute_loss`, `_log_loss_metrics`) on hand-written logprobs with hand-computed values.

The loss is driven on a `TraceGRPOTrainer` made without TRL's set-up (`__new__`): its model forward is replaced by
the given logprobs (the head itself is tested in test_train_logprobs_units.py), its accelerator by a one-process
stand-in."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from polar_cli.train.config import TrainConfig
from polar_cli.train.dataset import TrainRow
from polar_cli.train.trainer import (
    StepSampler,
    TraceGRPOTrainer,
    _completion_offsets,
    _EpochDataLoader,
    _window,
    _zero_weight,
    build_grpo_config,
    resolve_dtype,
    step_metrics,
    stored_rewards_only,
)

LOG = math.log


def row(
    prompt: int = 2,
    completion: int = 3,
    *,
    mask: list[int] | None = None,
    behavior: list[float] | None = None,
    advantage: float = 1.0,
    reward: float = 1.0,
    weight: float = 1.0,
    clipped: bool = False,
    trace_id: str = "t",
) -> TrainRow:
    return TrainRow(
        trace_id=trace_id,
        session_id=trace_id,
        group_id="g",
        prompt_ids=list(range(100, 100 + prompt)),
        completion_ids=list(range(200, 200 + completion)),
        loss_mask=[1] * completion if mask is None else mask,
        behavior_logprobs=[-float(i + 1) for i in range(completion)] if behavior is None else behavior,
        advantage=advantage,
        session_reward=reward,
        session_weight=weight,
        clipped=clipped,
    )


# --- step_metrics ----------------------------------------------------------------------------------------------------


def test_step_metrics_weight_each_session_once() -> None:
    # Session A's two traces (weight 1/2 each, reward 1) and session B's one (weight 1, reward 0): two sessions,
    # mean reward 0.5 by session, not 2/3 by trace.
    rows = [
        row(2, 3, mask=[1, 0, 1], advantage=0.75, reward=1.0, weight=0.5, clipped=True),
        row(4, 2, mask=[1, 1], advantage=-0.25, reward=1.0, weight=0.5),
        row(1, 4, mask=[0, 1, 1, 1], advantage=-0.5, reward=0.0, weight=1.0),
    ]
    m = step_metrics(rows)
    assert m["reward"] == pytest.approx(0.5)
    # var = (0.5 * 0.25 + 0.5 * 0.25 + 1 * 0.25) / 2
    assert m["reward_std"] == pytest.approx(0.5)
    assert m["advantage/abs_mean"] == pytest.approx((0.5 * 0.75 + 0.5 * 0.25 + 1 * 0.5) / 2)
    assert m["step/traces"] == 3.0 and m["step/sessions"] == 2.0
    assert m["step/clipped_traces"] == 1.0
    assert m["tokens/trainable"] == 2 + 2 + 3
    assert m["tokens/forward"] == 5 + 6 + 5
    assert all(isinstance(v, float) for v in m.values())


def test_step_metrics_std_is_the_weighted_spread_around_the_weighted_mean() -> None:
    rows = [row(reward=1.0, weight=0.5), row(reward=0.0, weight=0.5), row(reward=0.0, weight=1.0)]
    m = step_metrics(rows)
    assert m["reward"] == pytest.approx(0.25)
    # (0.5 * 0.75^2 + 0.5 * 0.25^2 + 1 * 0.25^2) / 2 = 0.1875
    assert m["reward_std"] == pytest.approx(math.sqrt(0.1875))


# --- StepSampler -----------------------------------------------------------------------------------------------------


def test_sampler_in_order_repeats_each_step_once_per_micro_step() -> None:
    sampler = StepSampler(num_groups=5, groups_per_step=2, repeats=3, seed=0, shuffle=False)
    assert sampler.steps() == [[0, 1], [2, 3], [4]]  # the last step takes what is left
    assert list(sampler) == [[0, 1]] * 3 + [[2, 3]] * 3 + [[4]] * 3
    assert len(sampler) == 9
    assert len(StepSampler(4, 2, 1, 0, shuffle=False)) == 2 and len(StepSampler(5, 5, 2, 0)) == 2


def test_shuffled_order_depends_on_seed_and_epoch_only() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        sampler = StepSampler(num_groups=12, groups_per_step=12, repeats=1, seed=seed)
        sampler.set_epoch(epoch)
        return sampler.steps()[0]

    first = order(3, 0)
    assert sorted(first) == list(range(12)) and first != list(range(12))
    assert order(3, 0) == first  # every process, and a resumed run, agrees
    assert order(3, 1) != first  # a new epoch, a new order
    assert order(4, 0) != first
    # The seed and epoch are mixed so that neighbouring (seed, epoch) pairs do not share an order.
    assert order(0, 1) != order(1, 0)
    sampler = StepSampler(12, 5, 2, seed=3)
    assert sampler.epoch == 0
    sampler.set_epoch(1)
    assert sampler.epoch == 1 and [g for s in sampler.steps() for g in s] == order(3, 1)
    assert [len(s) for s in sampler.steps()] == [5, 5, 2]


def test_epoch_loader_forwards_the_epoch_to_the_sampler() -> None:
    sampler = StepSampler(4, 2, 1, seed=0)
    loader = _EpochDataLoader(list(range(4)), batch_sampler=sampler, collate_fn=lambda b: b)
    loader.set_epoch(2)
    assert sampler.epoch == 2


# --- the scored window, the filler, TRL's arguments ------------------------------------------------------------------


def test_completion_offsets_count_from_the_shortest_prompt() -> None:
    assert _completion_offsets([row(3), row(5), row(4)]) == [0, 2, 1]
    assert _completion_offsets([row(7)]) == [0]


def test_window_places_each_rows_values_after_its_own_prompt() -> None:
    # Widths 5 and 5; the window starts at the shorter prompt's end (2): 3 positions.
    rows = [row(2, 3, behavior=[-0.5, -1.5, -2.5]), row(4, 1, behavior=[-7.25])]
    out = _window(rows, 3, lambda r: r.behavior_logprobs)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert out.tolist() == [[-0.5, -1.5, -2.5], [0.0, 0.0, -7.25]]
    # Integer values (a loss mask) come out as floats; a row shorter than the window leaves zeros after it.
    rows = [row(2, 1, mask=[1]), row(3, 2, mask=[1, 0]), row(2, 4, mask=[0, 1, 1, 1])]
    out = _window(rows, 4, lambda r: r.loss_mask)
    assert out.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]


def test_zero_weight_filler_trains_nothing_and_leaves_the_row_alone() -> None:
    original = row(3, 4, mask=[1, 0, 1, 1], advantage=0.8, reward=1.0, weight=0.5)
    filler = _zero_weight(original)
    assert filler.loss_mask == [0, 0, 0, 0] and filler.advantage == 0.0 and filler.session_weight == 0.0
    assert (filler.prompt_ids, filler.completion_ids, filler.behavior_logprobs) == (
        original.prompt_ids,
        original.completion_ids,
        original.behavior_logprobs,
    )
    assert filler.session_reward == 1.0 and filler.trace_id == original.trace_id
    assert original.loss_mask == [1, 0, 1, 1] and original.advantage == 0.8 and original.session_weight == 0.5


def test_stored_rewards_only_refuses_to_score_generations() -> None:
    with pytest.raises(RuntimeError, match="^rewards come from the stored traces; TRL's generation path must not run$"):
        stored_rewards_only(["p"], ["c"])


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    return TrainConfig(inputs=[], model="m", output=tmp_path / "run", **kw)


def test_build_grpo_config_maps_every_option(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        learning_rate=3e-6,
        weight_decay=0.05,
        max_grad_norm=0.7,
        lr_scheduler="cosine",
        warmup_ratio=0.1,
        epochs=2.5,
        max_steps=7,
        grad_accum=3,
        num_iterations=2,
        clip_against="step",
        epsilon_low=0.15,
        epsilon_high=0.3,
        tis_cap=3.0,
        cispo_cap=4.0,
        beta=0.02,
        loss_type="cispo",
        optim="sgd",
        seed=11,
        logging_steps=2,
        save_steps=4,
        token_budget=1234,
        gradient_checkpointing=True,
        dtype="float32",
        project="proj",
    )
    a = build_grpo_config(cfg, temperature=0.6, max_completion_length=96)
    assert a.output_dir == str(tmp_path / "run")
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm) == (3e-6, 0.05, 0.7)
    assert a.lr_scheduler_type == "cosine" and a.warmup_steps == 0.1  # only "constant" ignores warmup
    assert (a.num_train_epochs, a.max_steps) == (2.5, 7)
    # TRL's generation batching is a placeholder: the sampler makes the steps.
    assert (a.per_device_train_batch_size, a.num_generations) == (2, 2)
    assert (a.gradient_accumulation_steps, a.steps_per_generation, a.num_iterations) == (3, 3, 2)
    assert a.clip_against == "step"
    assert (a.epsilon, a.epsilon_high, a.delta) == (0.15, 0.3, None)
    assert (a.tis_cap, a.cispo_cap, a.beta, a.loss_type) == (3.0, 4.0, 0.02, "cispo")
    assert (a.temperature, a.max_completion_length, a.mask_truncated_completions) == (0.6, 96, False)
    assert a.bf16 is False and a.model_init_kwargs == {"dtype": torch.float32}
    assert a.activation_checkpointing is True and a.token_budget == 1234
    assert a.optim == "sgd" and a.seed == 11 and a.logging_steps == 2
    assert a.save_strategy == "steps" and a.save_steps == 4 and a.save_total_limit == 2
    assert a.use_cpu is True  # no CUDA here
    assert a.report_to == [] and a.run_name == "run" and a.project == "proj"
    assert a.disable_tqdm is True and a.remove_unused_columns is False and a.ddp_find_unused_parameters is False


def test_build_grpo_config_defaults_warmup_saving_and_the_memory_plan(tmp_path: Path) -> None:
    a = build_grpo_config(_cfg(tmp_path), temperature=1.0, max_completion_length=8)
    assert a.lr_scheduler_type == "constant" and a.warmup_steps == 0.0
    assert a.save_strategy == "no" and a.save_steps == 1  # 0 means no checkpoints, and TRL wants a positive value
    assert a.activation_checkpointing is False and a.token_budget == 0  # gradient_checkpointing None: off
    assert a.clip_against == "start"
    warm = build_grpo_config(_cfg(tmp_path, warmup_ratio=0.25), temperature=1.0, max_completion_length=8)
    assert warm.lr_scheduler_type == "constant_with_warmup" and warm.warmup_steps == 0.25
    # A memory plan overrides the options' budget and checkpointing, both ways.
    plan = SimpleNamespace(token_budget=4096, gradient_checkpointing=True)
    a = build_grpo_config(_cfg(tmp_path, token_budget=99), temperature=1.0, max_completion_length=8, memory=plan)
    assert a.token_budget == 4096 and a.activation_checkpointing is True
    plan = SimpleNamespace(token_budget=512, gradient_checkpointing=False)
    cfg = _cfg(tmp_path, gradient_checkpointing=True)
    a = build_grpo_config(cfg, temperature=1.0, max_completion_length=8, memory=plan)
    assert a.token_budget == 512 and a.activation_checkpointing is False
    bf16 = build_grpo_config(_cfg(tmp_path, dtype="bfloat16"), temperature=1.0, max_completion_length=8)
    assert bf16.bf16 is True and bf16.model_init_kwargs == {"dtype": torch.float32}  # fp32 master weights


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(KeyError):
        resolve_dtype("float16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto") is torch.float32


# --- the chunked loss ------------------------------------------------------------------------------------------------


class OneProcess:
    """The accelerator calls the loss makes, for one process on the CPU."""

    num_processes = 1
    process_index = 0
    device = torch.device("cpu")
    distributed_type = "NO"

    def __init__(self) -> None:
        self.backwards: list[float] = []
        self.no_sync_models: list[object] = []

    def autocast(self):
        return contextlib.nullcontext()

    def no_sync(self, model):
        self.no_sync_models.append(model)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.backwards.append(loss.item())
        loss.backward()

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(1)


def trainer(loss_type: str = "dapo", beta: float = 0.0, clamp: float = 20.0, training: bool = True):
    t = TraceGRPOTrainer.__new__(TraceGRPOTrainer)
    t.args = SimpleNamespace(
        log_ratio_clamp=clamp, cispo_cap=5.0, tis_cap=2.0, steps_per_generation=2, gradient_accumulation_steps=2
    )
    t.loss_type, t.beta, t.epsilon_low, t.epsilon_high = loss_type, beta, 0.2, 0.28
    t.accelerator = OneProcess()
    t.model = SimpleNamespace(training=training)
    t.current_gradient_accumulation_steps = 2
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.forward_models = []

    def trained_logps(model, chunk, compute_entropy=False):
        # The model's forward: the chunk carries its logprobs and entropies (these only when asked, as the head).
        t.forward_models.append(model)
        return chunk["logps"], chunk["entropy"] if compute_entropy else None

    t._trained_logps = trained_logps
    return t


OLD = -1.0


def chunk(ratios: list[list[float]], tis: list[list[float]], mask: list[list[int]], adv: list[float], **kw) -> dict:
    """Logprobs with pi_theta / pi_old = ``ratios`` and pi_old / pi_behaviour = ``tis`` (before the cap)."""
    logps = torch.tensor([[OLD + LOG(r) for r in rs] for rs in ratios], dtype=torch.float64)
    c = {
        "logps": kw.pop("logps", logps),
        "entropy": torch.tensor([[0.1 * (j + 1) + i for j in range(len(rs))] for i, rs in enumerate(ratios)]),
        "loss_mask": torch.tensor(mask, dtype=torch.float64),
        "old_logps": torch.full(logps.shape, OLD, dtype=torch.float64),
        "behavior_logps": torch.tensor([[OLD - LOG(w) for w in ws] for ws in tis], dtype=torch.float64),
        "advantages": torch.tensor(adv, dtype=torch.float64),
    }
    c.update(kw)
    return c


# Row 0 (A = 2): r 1.5 (clipped high), 0.5 (below 1 - eps, but A > 0: not clipped), 3.0 (masked), 1.1.
# Row 1 (A = -1): r 0.5 (clipped low), 0.9, 1.5 (high, but A < 0: not clipped), 0.7 (masked).
RATIOS = [[1.5, 0.5, 3.0, 1.1], [0.5, 0.9, 1.5, 0.7]]
TIS = [[1.0, 4.0, 4.0, 0.5], [1.0, 1.0, 1.0, 1.0]]  # 4.0 is capped at C = 2
MASK = [[1, 1, 0, 1], [1, 1, 1, 0]]
ADV = [2.0, -1.0]


def test_chunk_loss_dapo_by_hand() -> None:
    loss, stats, ratio = trainer()._chunk_loss(None, chunk(RATIOS, TIS, MASK, ADV))
    # Row 0: -min(rA, clip(r)A) w = -2.56 x 1, -1.0 x 2, (masked), -2.2 x 0.5; row 1: max(r, clip(r)) = 0.8, 0.9, 1.5.
    assert loss.item() == pytest.approx(-2.56 - 2.0 - 1.1 + 0.8 + 0.9 + 1.5)
    assert stats["count"].item() == 6
    assert stats["entropy"].item() == pytest.approx(0.1 + 0.2 + 0.4 + 1.1 + 1.2 + 1.3)
    assert stats["clip_high"].item() == 1  # row 0's 1.5 (its masked 3.0 is not counted)
    assert stats["clip_low"].item() == 1  # row 1's 0.5 (its masked 0.7 is not counted)
    # pi_theta / pi_behaviour = r x w at the trained positions, row by row.
    assert ratio.tolist() == pytest.approx([1.5, 2.0, 0.55, 0.5, 0.9, 1.5])
    assert stats["is_sum"].item() == pytest.approx(1.5 + 2.0 + 0.55 + 0.5 + 0.9 + 1.5)
    assert stats["tis_truncated"].item() == 1  # row 0's capped 4.0 (the masked one is not counted)
    assert stats["tis_weight"].item() == pytest.approx(1 + 2 + 0.5 + 3)
    assert "kl" not in stats


def test_chunk_loss_gradient_flows_only_through_trained_positions() -> None:
    c = chunk(RATIOS, TIS, MASK, ADV)
    c["logps"] = c["logps"].clone().requires_grad_(True)
    loss, _, _ = trainer()._chunk_loss(None, c)
    loss.backward()
    # d/dlogp of -r A w: -r A w where the ratio is not clipped, 0 where it is or where the mask is 0.
    expected = [[0.0, -0.5 * 2 * 2, 0.0, -1.1 * 2 * 0.5], [0.0, 0.9, 1.5, 0.0]]
    assert c["logps"].grad.tolist() == [pytest.approx(e) for e in expected]


def test_chunk_loss_without_old_logps_compares_with_the_current_weights() -> None:
    c = chunk(RATIOS, TIS, MASK, ADV)
    del c["old_logps"]
    loss, stats, _ = trainer()._chunk_loss(None, c)
    # r = 1 everywhere: -A w per trained token; the TIS weight is then exp(logp - behaviour), capped.
    w0 = [min(r * w, 2.0) for r, w in zip(RATIOS[0], TIS[0], strict=True)]
    w1 = [min(r * w, 2.0) for r, w in zip(RATIOS[1], TIS[1], strict=True)]
    expected = -2.0 * (w0[0] + w0[1] + w0[3]) + 1.0 * (w1[0] + w1[1] + w1[2])
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0


def test_chunk_loss_cispo_counts_only_the_cap() -> None:
    ratios = [[6.0, 1.5, 0.5], [0.5, 6.0, 1.0]]
    tis = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    c = chunk(ratios, tis, [[1, 1, 1], [1, 1, 1]], [2.0, -1.0])
    loss, stats, _ = trainer("cispo")._chunk_loss(None, c)
    logps = [[OLD + LOG(r) for r in rs] for rs in ratios]
    # -min(r, 5) A logp per token.
    expected = sum(-min(r, 5.0) * a * lp for rs, lps, a in zip(ratios, logps, [2.0, -1.0]) for r, lp in zip(rs, lps))
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_high"].item() == 1  # row 0's 6.0 > 5; row 1's 6.0 has A < 0
    assert stats["clip_low"].item() == 0  # CISPO has no lower clip: row 1's 0.5 is not counted


def test_chunk_loss_kl_to_the_reference_by_hand() -> None:
    ratios, tis, mask = [[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]], [[1, 1, 0]]
    c = chunk(ratios, tis, mask, [0.0])  # A = 0: the loss is the KL term alone
    # ref - logp: 0.5, -1.0, (masked) 2.0; k3 estimator exp(d) - d - 1.
    c["ref_logps"] = torch.tensor([[OLD + 0.5, OLD - 1.0, OLD + 2.0]], dtype=torch.float64)
    loss, stats, _ = trainer(beta=0.1)._chunk_loss(None, c)
    kl = [math.exp(0.5) - 1.5, math.exp(-1.0) + 1.0 - 1.0]
    assert stats["kl"].item() == pytest.approx(sum(kl))
    assert loss.item() == pytest.approx(0.1 * sum(kl))


def test_chunk_loss_clamps_every_log_ratio() -> None:
    # A -9999 sentinel behaviour logprob and a reference 3 nats away, with the clamp at 2.
    c = chunk([[1.0, 1.0]], [[1.0, 1.0]], [[1, 1]], [1.0])
    c["behavior_logps"] = torch.tensor([[-9999.0, OLD]], dtype=torch.float64)
    c["ref_logps"] = torch.tensor([[OLD + 3.0, OLD - 3.0]], dtype=torch.float64)
    loss, stats, ratio = trainer(beta=1.0, clamp=2.0)._chunk_loss(None, c)
    assert ratio.tolist() == pytest.approx([math.exp(2.0), 1.0])
    kl = [math.exp(2.0) - 3.0, math.exp(-2.0) + 1.0]
    assert stats["kl"].item() == pytest.approx(sum(kl))
    assert stats["tis_truncated"].item() == 1 and stats["tis_weight"].item() == pytest.approx(3.0)
    assert loss.item() == pytest.approx(-(2.0 + 1.0) + sum(kl))


def test_compute_loss_backpropagates_early_chunks_and_normalises_by_the_steps_tokens() -> None:
    theta = torch.tensor([OLD + LOG(1.1), OLD + LOG(0.9), OLD + LOG(1.2)], dtype=torch.float64, requires_grad=True)
    chunks = []
    for i in range(3):  # each chunk's logprobs come from one parameter
        c = chunk([[1.0]], [[1.0]], [[1]], [1.0 + i])
        c["logps"] = theta[i].reshape(1, 1)
        chunks.append(c)
    t = trainer()
    # 8 trainable tokens in the whole step; grad accumulation 2 of steps_per_generation 2: normaliser 8.
    loss = t._compute_loss(None, {"chunks": chunks, "num_items_in_batch": torch.tensor(8.0)})
    per_chunk = [-1.1 * 1.0, -0.9 * 2.0, -1.2 * 3.0]
    assert loss.item() == pytest.approx(sum(per_chunk) / 8)
    assert t.accelerator.backwards == pytest.approx([per_chunk[0] / 8, per_chunk[1] / 8])  # the last is returned
    loss.backward()
    # Every chunk's gradient arrives once: -r A / 8 each.
    assert theta.grad.tolist() == pytest.approx([-1.1 / 8, -0.9 * 2 / 8, -1.2 * 3 / 8])
    metrics = t._metrics["train"]
    assert metrics["is_ratio/min"] == [pytest.approx(0.9)] and metrics["is_ratio/max"] == [pytest.approx(1.2)]
    assert metrics["is_ratio/mean"] == [pytest.approx((1.1 + 0.9 + 1.2) / 3)]


def test_compute_loss_normaliser_edges() -> None:
    def run(t, items: float, grad: bool = True) -> float:
        c = chunk([[1.0, 1.0]], [[1.0, 1.0]], [[1, 1]], [1.0])
        with torch.set_grad_enabled(grad):
            return t._compute_loss(None, {"chunks": [c], "num_items_in_batch": torch.tensor(items)}).item()

    assert run(trainer(), 4.0) == pytest.approx(-2.0 / 4)
    assert run(trainer(), 0.0) == pytest.approx(-2.0)  # no trainable token: divided by 1, not 0
    t = trainer()
    t.current_gradient_accumulation_steps = 1  # HF's last, shorter accumulation window
    assert run(t, 4.0) == pytest.approx(-2.0 / 2)
    t = trainer()
    t.accelerator.num_processes = 2
    assert run(t, 4.0) == pytest.approx(-2.0 / 2)
    # Evaluation: no accumulation window.
    t = trainer(training=False)
    t.current_gradient_accumulation_steps = 1
    assert run(t, 4.0) == pytest.approx(-2.0 / 4)
    assert t._metrics["eval"]["entropy"] and not t._metrics["train"]["entropy"]
    # Without gradients (a no-grad evaluation) nothing is backpropagated early.
    t = trainer()
    c = [chunk([[1.0]], [[1.0]], [[1]], [1.0]) for _ in range(2)]
    with torch.no_grad():
        loss = t._compute_loss(None, {"chunks": c, "num_items_in_batch": torch.tensor(2.0)})
    assert loss.item() == pytest.approx(-1.0) and t.accelerator.backwards == []


def test_loss_metrics_are_per_trained_token() -> None:
    t = trainer(beta=0.5)
    sums = {
        "count": torch.tensor(4.0),
        "entropy": torch.tensor(2.0),
        "clip_low": torch.tensor(1.0),
        "clip_high": torch.tensor(2.0),
        "is_sum": torch.tensor(6.0),
        "tis_truncated": torch.tensor(3.0),
        "tis_weight": torch.tensor(5.0),
        "kl": torch.tensor(0.8),
    }
    t._log_loss_metrics("train", sums, [torch.tensor(0.5), torch.tensor(0.25)], [torch.tensor(3.0), torch.tensor(2.0)])
    m = t._metrics["train"]
    assert m["entropy"] == [0.5] and m["kl"] == [pytest.approx(0.2)]
    assert m["clip_ratio/low_mean"] == [0.25] and m["clip_ratio/high_mean"] == [0.5]
    assert m["clip_ratio/region_mean"] == [0.75]
    assert m["is_ratio/mean"] == [1.5] and m["is_ratio/min"] == [0.25] and m["is_ratio/max"] == [3.0]
    assert m["is_ratio/truncated_frac"] == [0.75] and m["tis/weight_mean"] == [1.25]
    assert not t._metrics["eval"]


def test_loss_metrics_of_a_filler_micro_batch() -> None:
    t = trainer()
    zeros = dict.fromkeys(("count", "entropy", "clip_low", "clip_high", "is_sum", "tis_truncated", "tis_weight"), 0.0)
    zeros["entropy"] = 0.5
    t._log_loss_metrics("train", zeros, [], [])
    m = t._metrics["train"]
    assert m["entropy"] == [0.5]  # divided by 1, not by a zero count
    assert math.isnan(m["is_ratio/min"][0]) and math.isnan(m["is_ratio/max"][0])
    assert "kl" not in m  # beta 0: no reference, no KL metric


# --- sequences and the starting weights' table -----------------------------------------------------------------------


def test_sequences_pad_each_row_on_the_right() -> None:
    t = trainer()
    t._tokenizer = SimpleNamespace(pad_token_id=0)
    s = t._sequences([row(2, 3), row(4, 2)])
    assert s["input_ids"].tolist() == [[100, 101, 200, 201, 202, 0], [100, 101, 102, 103, 200, 201]]
    assert s["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert s["input_ids"].dtype == torch.long and s["attention_mask"].dtype == torch.long
    assert s["logits_to_keep"] == 6 - 2


def test_start_logps_of_a_row_and_of_a_filler() -> None:
    t = trainer()
    a, b = row(trace_id="a"), row(trace_id="b")
    t._row_index = {id(a): 0, id(b): 1}
    t._start_logps = [torch.tensor([1.0]), torch.tensor([2.0])]
    assert t._start_logps_of(b).tolist() == [2.0] and t._start_logps_of(a).tolist() == [1.0]
    filler = _zero_weight(a)  # a copy: not in the table, its behaviour logprobs stand in (its mask is 0)
    assert t._start_logps_of(filler) == a.behavior_logprobs


def test_trained_logps_score_the_masked_window_and_never_padding() -> None:
    from polar_cli.train.logprobs import add_trained_positions_head
    from tests.test_train_logprobs_units import Toy

    model = Toy()
    add_trained_positions_head(model, 1.0, outputs=("log_probs", "entropy"))
    t = TraceGRPOTrainer.__new__(TraceGRPOTrainer)
    t.accelerator = OneProcess()
    # Row 1's last position is padding: not scored, whatever its loss mask says.
    c = {
        "input_ids": torch.tensor([[0, 1, 2, 0], [2, 1, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "loss_mask": torch.tensor([[1.0, 1.0], [1.0, 1.0]]),
        "logits_to_keep": 2,
    }
    z1 = math.log(1 + math.e + 1 / math.e)  # log Z after token 1
    logps, entropy = t._trained_logps(model, c, compute_entropy=True)
    assert logps.tolist() == [[pytest.approx(-1.0 - z1), pytest.approx(-LOG(3))], [pytest.approx(-z1), 0.0]]
    h1 = z1 - (math.e - 1 / math.e) / (1 + math.e + 1 / math.e)
    assert entropy.tolist() == [[pytest.approx(h1), pytest.approx(LOG(3))], [pytest.approx(h1), 0.0]]
    # Only the loss mask's positions: row 0's first window position is context.
    c["loss_mask"] = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    logps, entropy = t._trained_logps(model, c)
    assert logps.tolist() == [[0.0, pytest.approx(-LOG(3))], [pytest.approx(-z1), 0.0]] and entropy is None
    assert t._logps_no_grad(model, c).tolist() == logps.tolist()


# --- what the loss hands on, bounds met exactly ----------------------------------------------------------------------

MODEL = object()  # the model the Trainer passes in


def test_the_given_model_is_the_one_scored_and_kept_out_of_sync() -> None:
    t = trainer()
    chunks = [chunk([[1.0]], [[1.0]], [[1]], [1.0]) for _ in range(2)]
    for c in chunks:
        c["logps"] = c["logps"].clone().requires_grad_(True)
    t._compute_loss(MODEL, {"chunks": chunks, "num_items_in_batch": torch.tensor(2.0)})
    assert t.forward_models == [MODEL, MODEL]
    # Two forwards: the first backpropagated here without a gradient all-reduce, the last returned.
    assert t.accelerator.no_sync_models == [MODEL] and len(t.accelerator.backwards) == 1


def test_clip_counts_need_a_nonzero_advantage_of_the_right_sign() -> None:
    # A = 0.5 and A = 0 rows, each with a ratio far below and far above the clip range.
    c = chunk([[0.5, 1.5], [0.5, 1.5]], [[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 1]], [0.5, 0.0])
    _, stats, _ = trainer()._chunk_loss(MODEL, c)
    assert stats["clip_high"].item() == 1  # A = 0.5's 1.5
    assert stats["clip_low"].item() == 0  # neither 0.5: A is not negative
    c = chunk([[0.5, 1.5], [0.5, 1.5]], [[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 1]], [-0.5, 0.0])
    _, stats, _ = trainer()._chunk_loss(MODEL, c)
    assert stats["clip_low"].item() == 1 and stats["clip_high"].item() == 0


def test_a_ratio_exactly_at_a_clip_bound_is_not_clipped() -> None:
    # pi_old = 1 (log 0): the ratio is exp(logp) exactly; 0.8 and 1.28 are 1 - eps_low and 1 + eps_high.
    def stats(ratios: list[float], adv: float, loss_type: str = "dapo", cap: float = 5.0) -> dict:
        c = chunk([ratios], [[1.0] * len(ratios)], [[1] * len(ratios)], [adv])
        c["logps"] = torch.tensor([[LOG(r) for r in ratios]], dtype=torch.float64)
        c["old_logps"] = torch.zeros_like(c["logps"])
        c["behavior_logps"] = torch.zeros_like(c["logps"])
        t = trainer(loss_type)
        t.args.cispo_cap = cap
        return t._chunk_loss(MODEL, c)[1]

    assert stats([0.8, 0.79], -1.0)["clip_low"].item() == 1
    assert stats([1.28, 1.29], 1.0)["clip_high"].item() == 1
    assert stats([4.0, 4.01], 1.0, "cispo", cap=4.0)["clip_high"].item() == 1


def test_the_behaviour_ratio_is_clamped_below_too() -> None:
    # pi_theta far below pi_behaviour: e^-3 clamped to e^-2.
    c = chunk([[1.0]], [[1.0]], [[1]], [1.0])
    c["behavior_logps"] = torch.tensor([[OLD + 3.0]], dtype=torch.float64)
    _, stats, ratio = trainer(clamp=2.0)._chunk_loss(MODEL, c)
    assert ratio.tolist() == [pytest.approx(math.exp(-2.0))]


def test_sequences_are_put_on_the_accelerators_device() -> None:
    t = trainer()
    t._tokenizer = SimpleNamespace(pad_token_id=0)
    t.accelerator.device = torch.device("meta")
    s = t._sequences([row(2, 3), row(4, 2)])
    assert s["input_ids"].device.type == "meta" and s["attention_mask"].device.type == "meta"


def test_a_filler_batchs_missing_ratio_is_gathered_from_the_accelerators_device() -> None:
    # NCCL gathers only tensors on the process's own device.
    t = trainer()
    t.accelerator.device = torch.device("meta")
    gathered = []

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tensor.device.type)
        return torch.tensor([float("nan")])

    t.accelerator.gather = gather
    zeros = dict.fromkeys(("count", "entropy", "clip_low", "clip_high", "is_sum", "tis_truncated", "tis_weight"), 0.0)
    t._log_loss_metrics("train", zeros, [], [])
    assert gathered == ["meta", "meta"]


def test_trained_logps_pass_the_attention_mask() -> None:
    from polar_cli.train.logprobs import add_trained_positions_head
    from tests.test_train_logprobs_units import Toy

    model = Toy()
    add_trained_positions_head(model, 1.0)
    t = TraceGRPOTrainer.__new__(TraceGRPOTrainer)
    t.accelerator = OneProcess()
    attention = torch.tensor([[1, 1, 1, 0]])
    c = {"input_ids": torch.tensor([[0, 1, 2, 0]]), "attention_mask": attention, "loss_mask": torch.ones((1, 2))}
    t._trained_logps(model, {**c, "logits_to_keep": 2})
    assert model.base_calls[-1]["attention_mask"] is attention


def test_build_grpo_config_passes_the_trackers_and_saves_every_step(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, report_to=["tensorboard"], save_steps=1)
    a = build_grpo_config(cfg, temperature=1.0, max_completion_length=8)
    assert a.report_to == ["tensorboard"]
    assert a.save_strategy == "steps" and a.save_steps == 1


# --- the data path: loader, micro-steps, the step's split, chunks, the starting weights' table, resume --------------


def data_trainer(rows: list[TrainRow], groups: list[list[int]], **args) -> TraceGRPOTrainer:
    t = trainer()
    t.data = SimpleNamespace(rows=rows, groups=groups)
    t._row_index = {id(r): i for i, r in enumerate(rows)}
    t._start_logps = None
    t._tokenizer = SimpleNamespace(pad_token_id=0)
    t.num_iterations = 1
    t.on_start_scored = None
    t.state = SimpleNamespace(global_step=3, num_input_tokens_seen=100)
    t.args = SimpleNamespace(
        **{
            **vars(t.args),
            "clip_against": "step",
            "pad_waste": 0.1,
            "token_budget": 0,
            "start_logps_batch": 8,
            "seed": 5,
            **args,
        }
    )
    return t


def named(k: int, prompt: int, completion: int, **kw) -> TrainRow:
    """Row ``k``: prompt ids 1000k.., completion ids 1000k + 500.. (so a row is known by its ids)."""
    r = row(prompt, completion, trace_id=f"r{k}", **kw)
    base = 1000 * (k + 1)
    return TrainRow(
        **{
            **vars(r),
            "prompt_ids": list(range(base, base + prompt)),
            "completion_ids": list(range(base + 500, base + 500 + completion)),
        }
    )


def test_train_dataloader_serves_each_step_once_per_micro_step() -> None:
    t = data_trainer([], [[0], [1], [2]])
    t.groups_per_step, t.args.gradient_accumulation_steps, t.num_iterations = 2, 2, 3
    t.shuffle_dataset = False
    t.train_dataset = [{"group": g} for g in range(3)]
    loader = t.get_train_dataloader()
    batches = [[item["group"] for item in batch] for batch in loader]
    assert batches == [[0, 1]] * 6 + [[2]] * 6 and len(loader) == 12
    t.shuffle_dataset = True
    sampler = t.get_train_dataloader().batch_sampler
    assert (sampler.seed, sampler.shuffle, sampler.repeats, sampler.groups_per_step) == (5, True, 6, 2)
    assert sampler.steps() == StepSampler(3, 2, 6, seed=5).steps()


def test_prepare_inputs_builds_a_step_once_per_window_and_serves_its_micro_batches() -> None:
    t = data_trainer([], [])
    t.args.gradient_accumulation_steps, t.num_iterations = 2, 2
    built: list[list[int]] = []

    def build(groups: list[int]) -> list[str]:
        built.append(groups)
        return [f"step{len(built)}-micro0", f"step{len(built)}-micro1"]

    t._build_step, t._resume_buffer, t._buffered_inputs = build, None, None
    t.model = SimpleNamespace(training=True)
    served = []
    for step in range(5):
        t._step = step
        served.append(t._prepare_inputs([{"group": 4}, {"group": 7}]))
    # Four micro-steps (2 accumulation x 2 iterations) on one batch, then the next.
    assert served == ["step1-micro0", "step1-micro1", "step1-micro0", "step1-micro1", "step2-micro0"]
    assert built == [[4, 7], [4, 7]]
    t._step, t._buffered_inputs = 3, None  # a resumed run without its buffer rebuilds
    assert t._prepare_inputs([{"group": 1}]) == "step3-micro1"
    t.model.training = False
    with pytest.raises(RuntimeError, match="^evaluation is not supported: traces carry their own rewards$"):
        t._prepare_inputs([{"group": 1}])


def test_prepare_inputs_restores_a_saved_buffer_first(tmp_path: Path) -> None:
    t = data_trainer([], [])
    t.args.gradient_accumulation_steps, t.num_iterations = 2, 2
    path = tmp_path / "polar_step_buffer-0.pt"
    torch.save({"step": 3, "buffered": ["saved0", "saved1"]}, path)
    t._resume_buffer, t._buffered_inputs, t._step = path, None, 0
    t.model = SimpleNamespace(training=True)
    t._build_step = lambda groups: pytest.fail("the saved batch must be served, not rebuilt")
    assert t._prepare_inputs([{"group": 0}]) == "saved1" and t._step == 3 and t._resume_buffer is None


def test_build_step_splits_the_step_over_processes_and_pads_with_zero_weight_rows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Tokens: r0 5, r1 6, r2 4, r3 8, r4 3; 2 processes x 2 micro-batches: bins [r3], [r1], [r0], [r2, r4].
    rows = [named(0, 2, 3), named(1, 3, 3), named(2, 2, 2), named(3, 4, 4), named(4, 1, 2, mask=[1, 0])]
    shares = {}
    for rank in (0, 1):
        t = data_trainer(rows, [[0, 1], [2, 3, 4]], gradient_accumulation_steps=2)
        t.accelerator.num_processes, t.accelerator.process_index = 2, rank
        seen: list[list[str]] = []

        def tensorize(micro, num_items, t=t, seen=seen):
            seen.append([(r.trace_id, r.num_trainable) for r in micro])
            return TraceGRPOTrainer._tensorize(t, micro, num_items)

        t._tensorize = tensorize
        with caplog.at_level("INFO", logger="polar.train"):
            batches = t._build_step([1, 0])
        shares[rank] = seen
        # Every process normalises by the whole step's trainable tokens.
        assert [b["num_items_in_batch"].item() for b in batches] == [3 + 3 + 2 + 4 + 1] * 2
        assert t.state.num_input_tokens_seen == 100 + 26 and t._metrics["train"]["num_tokens"] == [126]
        assert t._metrics["train"]["step/traces"] == [5.0] and t._metrics["train"]["tokens/forward"] == [26.0]
        padded = sum(int((c["attention_mask"] == 0).sum()) for b in batches for c in b["chunks"])
        assert t._metrics["train"]["tokens/padded"] == [float(padded)]
    # The filler is the shortest row (r4) with nothing to train.
    assert shares[0] == [[("r3", 4), ("r4", 0)], [("r1", 3), ("r4", 0)]]
    assert shares[1] == [[("r0", 3), ("r4", 0)], [("r2", 2), ("r4", 1)]]
    assert "process 0 of 2, step 3: traces r3 r1" in caplog.messages
    assert "process 1 of 2, step 3: traces r0 r2 r4" in caplog.messages


def test_build_step_padding_is_counted() -> None:
    # One process, one micro-batch: r2 (4 tokens) and r4 (3) share a forward padded to 4 (waste 1 of 7 <= 0.5).
    rows = [named(2, 2, 2), named(4, 1, 2)]
    t = data_trainer(rows, [[0, 1]], gradient_accumulation_steps=1, pad_waste=0.5)
    batches = t._build_step([0])
    assert len(batches) == 1 and len(batches[0]["chunks"]) == 1
    assert t._metrics["train"]["tokens/padded"] == [1.0]


def test_build_step_scores_the_starting_weights_before_the_first_step() -> None:
    rows = [named(0, 2, 2), named(1, 2, 2)]
    t = data_trainer(rows, [[0, 1]], gradient_accumulation_steps=1, clip_against="start")
    calls = []
    t._compute_start_logps = lambda: calls.append(1) or [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])]
    batches = t._build_step([0])
    assert batches[0]["chunks"][0]["old_logps"].tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    t._build_step([0])
    assert calls == [1]  # once per run
    t = data_trainer(rows, [[0, 1]], gradient_accumulation_steps=1)  # --clip-against step: never
    t._compute_start_logps = lambda: pytest.fail("scored with clip_against step")
    assert "old_logps" not in t._build_step([0])[0]["chunks"][0]


def test_tensorize_makes_one_chunk_per_length_bucket_or_one_under_deepspeed() -> None:
    from accelerate.utils import DistributedType

    rows = [named(0, 5, 5), named(1, 1, 2), named(2, 4, 5)]  # 10, 3, 9 tokens
    t = data_trainer(rows, [])
    t._chunk = lambda rs: [r.trace_id for r in rs]
    items = torch.tensor(7.0)
    out = t._tensorize(rows, items)
    assert out == {"chunks": [["r0", "r2"], ["r1"]], "num_items_in_batch": items}
    t.args.token_budget = 19  # r0 and r2 padded together are 20 tokens
    assert t._tensorize(rows, items)["chunks"] == [["r0"], ["r2"], ["r1"]]
    t.args.pad_waste = 0.0
    t.args.token_budget = 0
    assert t._tensorize(rows, items)["chunks"] == [["r0"], ["r2"], ["r1"]]
    t.accelerator.distributed_type = DistributedType.DEEPSPEED
    assert t._one_backward_per_micro_step()
    assert t._tensorize(rows, items)["chunks"] == [["r0", "r1", "r2"]]
    t.accelerator.distributed_type = DistributedType.MULTI_GPU
    assert not t._one_backward_per_micro_step()


def test_chunk_holds_the_window_of_each_rows_values() -> None:
    rows = [
        named(0, 2, 3, mask=[1, 0, 1], behavior=[-0.5, -1.5, -2.5], advantage=0.75),
        named(1, 3, 2, mask=[1, 1], behavior=[-3.0, -4.0], advantage=-0.25),
    ]
    t = data_trainer(rows, [])
    t.accelerator.device = torch.device("meta")
    c = t._chunk(rows)
    assert c["logits_to_keep"] == 3
    for key in ("input_ids", "attention_mask", "loss_mask", "behavior_logps", "advantages"):
        assert c[key].device.type == "meta", key
    t.accelerator.device = torch.device("cpu")
    c = t._chunk(rows)
    assert c["loss_mask"].tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
    assert c["behavior_logps"].tolist() == [[-0.5, -1.5, -2.5], [0.0, -3.0, -4.0]]
    assert c["advantages"].dtype == torch.float32 and c["advantages"].tolist() == [0.75, -0.25]
    assert "old_logps" not in c and "ref_logps" not in c  # pi_old is the current weights, no reference


def test_chunk_old_logps_from_the_start_table_or_the_step_start_and_the_reference() -> None:
    rows = [named(0, 2, 2), named(1, 2, 2)]
    t = data_trainer(rows, [])
    t._start_logps = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])]
    filler = _zero_weight(rows[0])
    assert t._chunk([rows[1], filler])["old_logps"].tolist() == [[-3.0, -4.0], [-1.0, -2.0]]
    # No table, several iterations: the weights the batch started from, scored once (no grad).
    t._start_logps, t.num_iterations = None, 2
    t.model = "policy"
    scored = []

    def no_grad(model, chunk):
        scored.append((model, torch.is_grad_enabled()))
        return torch.full(chunk["loss_mask"].shape, -7.0)

    t._logps_no_grad = no_grad
    assert t._chunk(rows)["old_logps"].tolist() == [[-7.0, -7.0], [-7.0, -7.0]] and scored[0][0] == "policy"
    t.num_iterations, t.beta = 1, 0.1
    t._reference_logps = lambda chunk: torch.full(chunk["loss_mask"].shape, -9.0)
    c = t._chunk(rows)
    assert "old_logps" not in c and c["ref_logps"].tolist() == [[-9.0, -9.0], [-9.0, -9.0]]


def test_compute_start_logps_scores_every_row_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    # Lengths 5, 9, 4, 9: buckets of similar lengths (9 + 9, 5 + 4 padded to 5), two rows a forward.
    rows = [named(0, 2, 3), named(1, 4, 5, mask=[1, 0, 1, 1, 0]), named(2, 1, 3), named(3, 5, 4)]
    t = data_trainer(rows, [], start_logps_batch=2, pad_waste=0.15)
    t.model = "policy"
    forwards = []

    def no_grad(model, chunk):
        # The token id at each trained window position, 0 elsewhere (the head scores only those).
        keep = chunk["logits_to_keep"]
        forwards.append((model, chunk["input_ids"].shape))
        return -(chunk["input_ids"][:, -keep:].float() * chunk["loss_mask"])

    t._logps_no_grad = no_grad
    clock = iter([10.0, 12.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    speeds = []
    t.on_start_scored = speeds.append
    table = t._compute_start_logps()
    assert [x.tolist() for x in table] == [
        [-1500.0, -1501.0, -1502.0],
        [-2500.0, 0.0, -2502.0, -2503.0, 0.0],
        [-3500.0, -3501.0, -3502.0],
        [-4500.0, -4501.0, -4502.0, -4503.0],
    ]
    assert forwards == [("policy", (2, 9)), ("policy", (2, 5))]
    assert t.start_scoring == (18 + 10, 2.5) and speeds == [28 / 2.5]


def test_compute_start_logps_one_row_a_forward_and_no_speed_without_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    rows = [named(0, 2, 3), named(1, 2, 3)]
    t = data_trainer(rows, [], start_logps_batch=1)
    shapes = []
    t._logps_no_grad = lambda model, chunk: shapes.append(chunk["input_ids"].shape) or torch.zeros((1, 3))
    monkeypatch.setattr(time, "perf_counter", lambda: 5.0)
    t.on_start_scored = lambda speed: pytest.fail("no speed from zero seconds")
    assert len(t._compute_start_logps()) == 2 and shapes == [(1, 5), (1, 5)] and t.start_scoring == (10, 0.0)
    t.on_start_scored = None  # no listener: nothing to tell
    monkeypatch.setattr(time, "perf_counter", iter([1.0, 2.0]).__next__)
    assert len(t._compute_start_logps()) == 2


def test_checkpoint_keeps_the_step_buffer_and_the_start_table_and_resume_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trl import GRPOTrainer

    from polar_cli.train.trainer import START_LOGPS_FILE

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", lambda self, model, trial: None)
    rows = [named(0, 2, 2), named(1, 2, 2)]
    t = data_trainer(rows, [])
    t._get_output_dir = lambda trial: str(tmp_path)
    t.state.global_step = 4
    t.accelerator.process_index, t.accelerator.is_main_process = 1, True
    t.num_iterations, t._step, t._buffered_inputs = 2, 9, ["micro0", "micro1"]
    t._start_logps = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])]
    (tmp_path / "checkpoint-4").mkdir()
    t._save_checkpoint(None, None)
    saved = torch.load(tmp_path / "checkpoint-4" / "polar_step_buffer-1.pt", weights_only=False)
    assert saved == {"step": 9, "buffered": ["micro0", "micro1"]}
    assert START_LOGPS_FILE == "polar_start_logps.pt"

    resumed = data_trainer(rows, [], clip_against="start")
    resumed.accelerator.process_index, resumed.num_iterations = 1, 2
    resumed._resume_buffer = None
    resumed.resume_from(tmp_path / "checkpoint-4")
    assert resumed._resume_buffer == tmp_path / "checkpoint-4" / "polar_step_buffer-1.pt"
    assert [x.tolist() for x in resumed._start_logps] == [[-1.0, -2.0], [-3.0, -4.0]]


def test_checkpoint_without_iterations_or_table_writes_neither(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl import GRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", lambda self, model, trial: None)
    t = data_trainer([], [])
    t._get_output_dir = lambda trial: str(tmp_path)
    t.state.global_step = 1
    t.accelerator.is_main_process = True
    (tmp_path / "checkpoint-1").mkdir()
    t._save_checkpoint(None, None)  # one iteration, --clip-against step
    assert list((tmp_path / "checkpoint-1").iterdir()) == []
    t._start_logps = [torch.tensor([0.0])]
    t.accelerator.is_main_process = False  # only the main process writes the shared table
    t._save_checkpoint(None, None)
    assert list((tmp_path / "checkpoint-1").iterdir()) == []


def test_resume_refuses_a_checkpoint_without_its_start_table_or_for_other_inputs(tmp_path: Path) -> None:
    rows = [named(0, 2, 2), named(1, 2, 2)]
    t = data_trainer(rows, [], clip_against="start")
    t._resume_buffer = None
    with pytest.raises(FileNotFoundError) as missing:
        t.resume_from(tmp_path)
    assert str(missing.value) == (
        f"{tmp_path / 'polar_start_logps.pt'} missing: with --clip-against start, resume needs the starting "
        "weights' logprobs saved with the checkpoint"
    )
    assert t._resume_buffer is None  # one iteration: no step buffer to restore
    torch.save([torch.tensor([0.0])], tmp_path / "polar_start_logps.pt")
    with pytest.raises(ValueError) as other:
        t.resume_from(tmp_path)
    assert str(other.value) == (
        f"{tmp_path / 'polar_start_logps.pt'} scores 1 traces, these inputs have 2: resume with the inputs the "
        "checkpoint was trained on"
    )
    step = data_trainer(rows, [])  # --clip-against step: no table needed
    step._start_logps = None
    step.resume_from(tmp_path)
    assert step._start_logps is None


def test_restoring_a_missing_step_buffer_says_what_is_missing(tmp_path: Path) -> None:
    t = data_trainer([], [])
    t._resume_buffer = tmp_path / "polar_step_buffer-0.pt"
    with pytest.raises(FileNotFoundError) as missing:
        t._restore_step_buffer(t._resume_buffer)
    assert str(missing.value) == (
        f"{tmp_path / 'polar_step_buffer-0.pt'} missing: with --num-iterations > 1, resume needs the step buffer "
        "saved with the checkpoint"
    )
    assert t._resume_buffer is None  # tried once, not on every micro-step


def test_start_table_from_a_checkpoint_is_on_the_device_and_loaded_as_tensors_only(tmp_path: Path) -> None:
    rows = [named(0, 2, 2), named(1, 2, 2)]
    t = data_trainer(rows, [])
    t._start_logps = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])]
    t.accelerator.device = torch.device("meta")
    assert t._chunk(rows)["old_logps"].device.type == "meta"
    # A table file holding anything but tensors (a pickled object) is refused, not executed.
    torch.save([SimpleNamespace(x=1), SimpleNamespace(x=2)], tmp_path / "polar_start_logps.pt")
    resumed = data_trainer(rows, [], clip_against="start")
    with pytest.raises(Exception, match="Weights only load failed"):
        resumed.resume_from(tmp_path)


def test_a_restored_step_buffer_lands_on_the_device(tmp_path: Path) -> None:
    path = tmp_path / "polar_step_buffer-0.pt"
    torch.save({"step": 1, "buffered": [{"advantages": torch.tensor([0.5])}]}, path)
    t = data_trainer([], [])
    t.accelerator.device = torch.device("meta")
    t._restore_step_buffer(path)
    assert t._buffered_inputs[0]["advantages"].device.type == "meta" and t._step == 1


def test_start_logps_of_one_process_among_two_gathers_the_others_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate.utils

    rows = [named(k, 2, 2) for k in range(4)]
    t = data_trainer(rows, [], start_logps_batch=8)
    t.accelerator.num_processes, t.accelerator.process_index = 2, 1
    t._logps_no_grad = lambda model, chunk: -chunk["input_ids"][:, -2:].float()
    # Rank 0 scored rows 0 and 2 (here: made up, as its own weights would have).
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: [(0, [0.5, 0.5]), (2, [2.5, 2.5]), *mine])
    table = t._compute_start_logps()
    assert [x.tolist() for x in table] == [[0.5, 0.5], [-2500.0, -2501.0], [2.5, 2.5], [-4500.0, -4501.0]]
    # One process scores everything itself: no collective.
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: pytest.fail("gathered on one process"))
    t.accelerator.num_processes, t.accelerator.process_index = 1, 0
    assert [x.tolist() for x in t._compute_start_logps()][0] == [-1500.0, -1501.0]


def test_start_logps_forwards_keep_to_the_token_budget_and_say_what_they_took(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    rows = [named(0, 5, 4), named(1, 5, 4)]  # 9 tokens each: 18 padded together
    t = data_trainer(rows, [], token_budget=10)
    shapes = []
    t._logps_no_grad = lambda model, chunk: shapes.append(tuple(chunk["input_ids"].shape)) or torch.zeros((1, 4))
    monkeypatch.setattr(time, "perf_counter", iter([10.0, 10.5]).__next__)
    speeds = []
    t.on_start_scored = speeds.append
    with caplog.at_level("INFO", logger="polar.train"):
        t._compute_start_logps()
    assert shapes == [(1, 9), (1, 9)]
    assert speeds == [36.0]  # half a second is enough to measure a speed
    assert "scored the starting weights: 18 tokens in 0.5 s" in caplog.messages


def test_checkpoint_saves_through_the_trainers_own_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl import GRPOTrainer

    saves, dirs = [], []
    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", lambda self, model, trial: saves.append((model, trial)))
    t = data_trainer([], [])
    t._get_output_dir = lambda trial: dirs.append(trial) or str(tmp_path)
    t.state.global_step, t.accelerator.is_main_process = 2, True
    (tmp_path / "checkpoint-2").mkdir()
    t._save_checkpoint(MODEL, "trial-7")
    assert saves == [(MODEL, "trial-7")] and dirs == ["trial-7"]
