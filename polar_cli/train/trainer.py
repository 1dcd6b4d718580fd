"""TRL's GRPOTrainer fed from stored traces instead of its own generation.

What is kept from TRL: model/PEFT/reference-model setup, the loss (`_compute_loss`: PPO clip,
loss types, KL, entropy and clip metrics), the optimizer loop, checkpointing and resume, and
accelerate/DDP. What is replaced, and why:

- ``get_train_dataloader``: a step is the traces of ``groups_per_step`` GRPO groups, whose
  number varies (sessions fan out into several traces), so TRL's fixed
  ``num_generations`` batching does not fit. Every process sees the same global step.
- ``_prepare_inputs``: instead of generating, it takes the step's rows, splits them
  (deterministically, by tokens) over processes x micro-batches, and pads this process's share.
  The advantages were computed over whole groups before training (``advantages.py``).
- Off-policy math: ``old_per_token_logps`` is the *captured* behaviour logprob, so TRL's ratio is
  ``pi_theta / pi_behavior`` with no fresh forward pass; TRL's two-sided clip ``delta`` caps that
  ratio (truncated importance sampling) in the unclipped branch; ``tool_mask`` is the trace's loss
  mask, so interstitial tokens are context only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import identity, nanmax, nanmin, pad, use_adapter

from polar_cli.train.dataset import NothingToTrain, TrainData, TrainRow, partition_rows

# GRPOConfig insists on num_generations >= 2 dividing the generation batch. Neither value is used
# here (our sampler and advantages replace TRL's), so both are set to the smallest it accepts.
TRL_PLACEHOLDER_GENERATIONS = 2


def stored_rewards_only(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """GRPOTrainer requires a reward source; ours are the rewards stored in the traces."""
    raise RuntimeError("rewards come from the stored traces; TRL's generation path must not run")


class StepSampler(Sampler[list[int]]):
    """Yields each optimizer step's group indices, repeated once per micro-step of that step.

    HF's Trainer pulls one batch per micro-step (grad_accum x num_iterations of them per step);
    ``_prepare_inputs`` builds the step on the first and serves the buffered micro-batches after.
    The order depends only on (seed, epoch), so all processes agree and resume is exact.
    """

    def __init__(self, num_groups: int, groups_per_step: int, repeats: int, seed: int, shuffle: bool = True):
        self.num_groups = num_groups
        self.groups_per_step = groups_per_step
        self.repeats = repeats
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def steps(self) -> list[list[int]]:
        order = list(range(self.num_groups))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_groups, generator=g).tolist()
        return [order[i : i + self.groups_per_step] for i in range(0, self.num_groups, self.groups_per_step)]

    def __iter__(self):
        for step in self.steps():
            for _ in range(self.repeats):
                yield step

    def __len__(self) -> int:
        return math.ceil(self.num_groups / self.groups_per_step) * self.repeats


class _EpochDataLoader(DataLoader):
    # HF's Trainer calls set_epoch on the loader; torch's DataLoader has none to forward.
    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def step_metrics(rows: list[TrainRow]) -> dict[str, float]:
    """What a step trained on: session-weighted reward, advantages, traces and token counts."""
    weight = sum(r.session_weight for r in rows)
    reward = sum(r.session_reward * r.session_weight for r in rows) / weight
    var = sum(r.session_weight * (r.session_reward - reward) ** 2 for r in rows) / weight
    return {
        "reward": reward,
        "reward_std": math.sqrt(var),
        "advantage/abs_mean": sum(abs(r.advantage) * r.session_weight for r in rows) / weight,
        "step/traces": float(len(rows)),
        "step/sessions": weight,
        "step/clipped_traces": float(sum(r.clipped for r in rows)),
        "tokens/trainable": float(sum(r.num_trainable for r in rows)),
        "tokens/forward": float(sum(r.num_tokens for r in rows)),
    }


class TraceGRPOTrainer(GRPOTrainer):
    def __init__(self, *, data: TrainData, groups_per_step: int, **kwargs: Any):
        from datasets import Dataset

        if not data.rows:
            raise NothingToTrain(f"no trainable rows: every trace was dropped ({data.stats})")
        self.data = data
        self.groups_per_step = groups_per_step
        self._policy_logps: torch.Tensor | None = None
        super().__init__(
            reward_funcs=[stored_rewards_only],
            train_dataset=Dataset.from_dict({"group": list(range(len(data.groups)))}),
            **kwargs,
        )
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            raise ValueError("steps_per_generation must equal gradient_accumulation_steps (one step per batch)")

    # --- data ---------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        sampler = StepSampler(
            num_groups=len(self.data.groups),
            groups_per_step=self.groups_per_step,
            repeats=self.args.gradient_accumulation_steps * self.num_iterations,
            seed=self.args.seed,
            shuffle=self.shuffle_dataset,
        )
        return _EpochDataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=identity)

    def _prepare_inputs(self, generation_batch: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training:
            raise RuntimeError("evaluation is not supported: traces carry their own rewards")
        grad_accum = self.args.gradient_accumulation_steps
        if self._step % (grad_accum * self.num_iterations) == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._build_step([example["group"] for example in generation_batch])
        return self._buffered_inputs[self._step % grad_accum]

    def _build_step(self, group_indices: list[int]) -> list[dict[str, Any]]:
        rows = [self.data.rows[i] for g in group_indices for i in self.data.groups[g]]
        grad_accum = self.args.gradient_accumulation_steps
        nproc, rank = self.accelerator.num_processes, self.accelerator.process_index
        bins = partition_rows([r.num_tokens for r in rows], nproc * grad_accum)
        mine = bins[rank * grad_accum : (rank + 1) * grad_accum]
        # The loss normalizer counts the whole step's trainable tokens, over all processes; every
        # process knows the whole step, so no collective is needed.
        num_items = torch.tensor(float(sum(r.num_trainable for r in rows)), device=self.accelerator.device)

        metrics = step_metrics(rows)
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        self.state.num_input_tokens_seen += int(metrics["tokens/forward"])
        self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]

        # Every process must hold the same number of rows at each micro-step (TRL gathers per-row
        # metrics, DDP needs every process to run): empty slots get a copy of the step's shortest
        # row with its loss mask zeroed, which adds exactly nothing to the loss or the gradient.
        slots = max(len(b) for b in bins)
        filler = _zero_weight(min(rows, key=lambda r: r.num_tokens))
        return [
            self._tensorize([rows[i] for i in micro] + [filler] * (slots - len(micro)), num_items) for micro in mine
        ]

    def _tensorize(self, rows: list[TrainRow], num_items: torch.Tensor) -> dict[str, torch.Tensor]:
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id

        def stack(seqs: list[list], side: str, value: float, dtype: torch.dtype) -> torch.Tensor:
            return pad([torch.tensor(s, dtype=dtype) for s in seqs], padding_value=value, padding_side=side).to(device)

        prompt_ids = stack([r.prompt_ids for r in rows], "left", pad_id, torch.long)
        prompt_mask = stack([[1] * len(r.prompt_ids) for r in rows], "left", 0, torch.long)
        completion_ids = stack([r.completion_ids for r in rows], "right", pad_id, torch.long)
        completion_mask = stack([[1] * len(r.completion_ids) for r in rows], "right", 0, torch.long)
        out = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": stack([r.loss_mask for r in rows], "right", 0, torch.long),
            "old_per_token_logps": stack([r.behavior_logprobs for r in rows], "right", 0.0, torch.float32),
            "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
            "num_items_in_batch": num_items,
        }
        if self.beta != 0.0:
            out["ref_per_token_logps"] = self._reference_logps(out)
        return out

    @torch.no_grad()
    def _reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        keep = batch["completion_ids"].size(1)
        if self.ref_model is not None:
            logps, _, _ = self._get_per_token_logps_and_entropies(self.ref_model, input_ids, attention_mask, keep)
            return logps
        # PEFT: the reference is the base model, i.e. the adapter switched off (TRL's own rule).
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            logps, _, _ = self._get_per_token_logps_and_entropies(self.model, input_ids, attention_mask, keep)
        return logps

    # --- importance-ratio metrics ------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # TRL keeps pi_theta local to _compute_loss; keep the last forward's so the IS ratio can be
        # logged without a second pass (in _compute_loss the policy forward is the only one).
        self._policy_logps = logps.detach()
        return logps, entropies, aux

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self._log_importance_ratios(inputs)
        return loss

    def _log_importance_ratios(self, inputs: dict[str, torch.Tensor]) -> None:
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        ratio = torch.exp(self._policy_logps - inputs["old_per_token_logps"])[mask]
        negative = (inputs["advantages"].unsqueeze(1).expand_as(mask) < 0)[mask]
        truncated = ((ratio > self.args.delta) & negative).float()
        local = torch.stack([ratio.sum(), truncated.sum(), torch.tensor(float(ratio.numel()), device=ratio.device)])
        totals = self.accelerator.reduce(local, reduction="sum")
        count = totals[2].clamp(min=1.0)
        # A zero-weight filler micro-batch has no trainable token: NaN, which TRL's log() skips.
        nan = torch.tensor(float("nan"), device=ratio.device)
        lo = nanmin(self.accelerator.gather(ratio.min() if ratio.numel() else nan))
        hi = nanmax(self.accelerator.gather(ratio.max() if ratio.numel() else nan))
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["is_ratio/mean"].append((totals[0] / count).item())
        metrics["is_ratio/min"].append(lo.item())
        metrics["is_ratio/max"].append(hi.item())
        metrics["is_ratio/truncated_frac"].append((totals[1] / count).item())


def _zero_weight(row: TrainRow) -> TrainRow:
    return dataclasses.replace(row, loss_mask=[0] * len(row.loss_mask), advantage=0.0, session_weight=0.0)


def build_grpo_config(cfg: Any, *, temperature: float, max_completion_length: int) -> GRPOConfig:
    """TRL arguments from a TrainConfig (``cfg``); our knobs map onto TRL's own where they exist."""
    dtype = resolve_dtype(cfg.dtype)
    return GRPOConfig(
        output_dir=str(cfg.output),
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type=cfg.lr_scheduler,
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=TRL_PLACEHOLDER_GENERATIONS,
        num_generations=TRL_PLACEHOLDER_GENERATIONS,
        gradient_accumulation_steps=cfg.grad_accum,
        steps_per_generation=cfg.grad_accum,
        num_iterations=cfg.num_iterations,
        epsilon=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        delta=cfg.tis_cap,
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        temperature=temperature,
        max_completion_length=max_completion_length,
        mask_truncated_completions=False,
        bf16=dtype == torch.bfloat16,
        activation_checkpointing=cfg.gradient_checkpointing,
        optim=cfg.optim,
        model_init_kwargs={"dtype": dtype},
        seed=cfg.seed,
        logging_steps=cfg.logging_steps,
        save_strategy="steps" if cfg.save_steps > 0 else "no",
        save_steps=max(cfg.save_steps, 1),
        save_total_limit=cfg.save_total_limit,
        # Without CUDA, say so: accelerate only forms a multi-process (gloo) group for CPU runs then.
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
    )


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
