"""TRL's GRPOTrainer fed from stored traces instead of its own generation.

What is kept from TRL: model/PEFT/reference-model setup, the loss (`_compute_loss`: PPO clip,
loss types, KL, entropy and clip metrics), the optimizer loop, checkpointing and resume, and
accelerate/DDP. What is replaced, and why:

- ``get_train_dataloader``: a step is the traces of ``groups_per_step`` GRPO groups, whose
  number varies (sessions fan out into several traces), so TRL's fixed
  ``num_generations`` batching does not fit. Every process sees the same global step.
- ``_prepare_inputs``: instead of generating, it takes the step's rows, splits them
  (deterministically, by tokens) over processes x micro-batches, and pads this process's share
  in length buckets (each bucket padded to its own longest row, so padding stays small when
  short and long traces share a step). The advantages were computed over whole groups before
  training (``advantages.py``).
- ``_compute_loss``: truncated importance sampling as slime / verl ``--use-tis`` do. The PPO
  ratio compares pi_theta with the trainer's *own* detached old logprob (so the engine/trainer
  mismatch is not mistaken for policy drift and clipped from step 0), and each token's loss is
  weighted by the detached ``min(exp(old - behaviour), tis_cap)``. Log-ratios are clamped before
  ``exp`` so one absurd behaviour logprob (vLLM's -9999 sentinel) cannot overflow a step. The
  loss mask marks sampled tokens; interstitial tokens are context only. With ``--clip-against start``
  (the default) the old logprob is that of the weights the run started with (one no-grad pass over
  every trace before the first update, as verl / slime recompute ``old_log_prob`` before updating on
  a rollout batch): the clip bounds the drift of the whole run. ``step`` takes each step's own
  weights (the clip then only sees drift within one step's ``--num-iterations``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import identity, nanmax, nanmin, use_adapter

from polar_cli.train.dataset import NothingToTrain, TrainData, TrainRow, length_buckets, partition_rows
from polar_cli.train.logprobs import add_trained_positions_head, trained_labels

log = logging.getLogger("polar.train")

# GRPOConfig insists on num_generations >= 2 dividing the generation batch. Neither value is used
# here (our sampler and advantages replace TRL's), so both are set to the smallest it accepts.
TRL_PLACEHOLDER_GENERATIONS = 2
START_LOGPS_FILE = "polar_start_logps.pt"  # --clip-against start: saved with each checkpoint for --resume


@dataclass
class TraceGRPOConfig(GRPOConfig):
    """GRPOConfig plus the off-policy knobs of training on stored traces."""

    tis_cap: float = field(
        default=2.0, metadata={"help": "C of truncated importance sampling: weight min(pi_old / pi_behavior, C)."}
    )
    cispo_cap: float = field(
        default=5.0, metadata={"help": "CISPO's cap on pi_theta / pi_old (TRL reuses epsilon_high for it)."}
    )
    log_ratio_clamp: float = field(
        default=20.0, metadata={"help": "Log-ratios are clamped to +-this before exp (exp(20) = 4.9e8)."}
    )
    pad_waste: float = field(
        default=0.1, metadata={"help": "Length buckets keep padded tokens <= this fraction of real ones."}
    )
    clip_against: str = field(
        default="start",
        metadata={"help": "pi_old of the PPO clip and TIS: the weights at the start of each step, or of the run."},
    )
    start_logps_batch: int = field(
        default=8, metadata={"help": "Rows per forward of the no-grad pass that scores the starting weights."}
    )
    token_budget: int = field(
        default=0,
        metadata={
            "help": "Padded tokens per forward (as AsyncGRPOConfig.token_budget); each forward gets its own "
            "backward. A longer row gets a forward of its own. 0: no bound (the micro-batch's length buckets)."
        },
    )


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
    args: TraceGRPOConfig

    def __init__(self, *, data: TrainData, groups_per_step: int, **kwargs: Any):
        from datasets import Dataset

        if not data.rows:
            raise NothingToTrain(f"no trainable rows: every trace was dropped ({data.stats})")
        self.data = data
        self.groups_per_step = groups_per_step
        self._resume_buffer: Path | None = None
        # --clip-against start: the starting weights' logprob of each completion token, per row of data.rows (by
        # position: trace ids need not be unique across several stores).
        self._start_logps: list[torch.Tensor] | None = None
        self._row_index = {id(row): i for i, row in enumerate(data.rows)}
        super().__init__(
            reward_funcs=[stored_rewards_only],
            train_dataset=Dataset.from_dict({"group": list(range(len(data.groups)))}),
            **kwargs,
        )
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            raise ValueError("steps_per_generation must equal gradient_accumulation_steps (one step per batch)")
        # TRL's fused head, but scoring only the trained positions on every device (logprobs.py says why).
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_trained_positions_head(base, self.temperature, outputs=("log_probs", "entropy"))
        if self.ref_model is not None:
            add_trained_positions_head(self.ref_model, self.temperature)
        self.start_scoring: tuple[int, float] | None = None  # (tokens, seconds) of the --clip-against start pass
        # Told the start pass's forward tokens/s: the first measured speed, for the "a step will take" estimate.
        self.on_start_scored: Callable[[float], None] | None = None

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
        if self._resume_buffer is not None:
            self._restore_step_buffer(self._resume_buffer)
        grad_accum = self.args.gradient_accumulation_steps
        if self._step % (grad_accum * self.num_iterations) == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._build_step([example["group"] for example in generation_batch])
        return self._buffered_inputs[self._step % grad_accum]

    def _build_step(self, group_indices: list[int]) -> list[dict[str, Any]]:
        if self.args.clip_against == "start" and self._start_logps is None:  # before the first update
            self._start_logps = self._compute_start_logps()
        rows = [self.data.rows[i] for g in group_indices for i in self.data.groups[g]]
        grad_accum = self.args.gradient_accumulation_steps
        nproc, rank = self.accelerator.num_processes, self.accelerator.process_index
        bins = partition_rows([r.num_tokens for r in rows], nproc * grad_accum)
        mine = bins[rank * grad_accum : (rank + 1) * grad_accum]
        # `polar train --verbose`: which traces each process trains (under DDP, each a different share of the step).
        log.info(
            "process %d of %d, step %d: traces %s",
            rank,
            nproc,
            self.state.global_step,
            " ".join(rows[i].trace_id for b in mine for i in b),
        )
        # The loss normalizer counts the whole step's trainable tokens, over all processes; every
        # process knows the whole step, so no collective is needed.
        num_items = torch.tensor(float(sum(r.num_trainable for r in rows)), device=self.accelerator.device)

        metrics = step_metrics(rows)
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        self.state.num_input_tokens_seen += int(metrics["tokens/forward"])
        self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]

        # Every process must hold the same number of rows at each micro-step (DDP needs every
        # process to run): empty slots get a copy of the step's shortest row with its loss mask
        # zeroed, which adds exactly nothing to the loss or the gradient.
        slots = max(len(b) for b in bins)
        filler = _zero_weight(min(rows, key=lambda r: r.num_tokens))
        micro = [[rows[i] for i in b] + [filler] * (slots - len(b)) for b in mine]
        batches = [self._tensorize(m, num_items) for m in micro]
        padded = sum(int(c["attention_mask"].numel() - c["attention_mask"].sum()) for b in batches for c in b["chunks"])
        self._metrics["train"]["tokens/padded"].append(float(padded))
        return batches

    def _tensorize(self, rows: list[TrainRow], num_items: torch.Tensor) -> dict[str, Any]:
        # Each chunk is one forward, with its own backward (``_compute_loss``) except under DeepSpeed, whose engine
        # counts one backward per micro-step: there the micro-batch stays one forward.
        if self._one_backward_per_micro_step():
            groups = [list(range(len(rows)))]
        else:
            groups = length_buckets([r.num_tokens for r in rows], self.args.pad_waste, self.args.token_budget)
        chunks = [self._chunk([rows[i] for i in g]) for g in groups]
        return {"chunks": chunks, "num_items_in_batch": num_items}

    def _one_backward_per_micro_step(self) -> bool:
        from accelerate.utils import DistributedType

        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def _chunk(self, rows: list[TrainRow]) -> dict[str, Any]:
        """One forward's rows, their loss mask, behaviour (and old, reference) logprobs and advantages."""
        device = self.accelerator.device
        chunk = self._sequences(rows)
        window = partial(_window, rows, chunk["logits_to_keep"])
        chunk["loss_mask"] = window(lambda r: r.loss_mask).to(device)
        chunk["behavior_logps"] = window(lambda r: r.behavior_logprobs).to(device)
        chunk["advantages"] = torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device)
        if self._start_logps is not None:
            chunk["old_logps"] = window(self._start_logps_of).to(device)
        elif self.num_iterations > 1:
            # Later iterations on this batch compare with the weights it started from (TRL's mu).
            chunk["old_logps"] = self._logps_no_grad(self.model, chunk)
        if self.beta != 0.0:
            chunk["ref_logps"] = self._reference_logps(chunk)
        return chunk

    def _sequences(self, rows: list[TrainRow]) -> dict[str, Any]:
        """Right-padded full sequences; the scored window starts at the shortest prompt's end.

        ``prompt + completion`` is padded as one sequence, so a short-prompt/long-completion trace
        next to a long-prompt/short-completion one costs max(total), not max(prompt) + max(completion).
        """
        width = max(r.num_tokens for r in rows)
        input_ids = torch.full((len(rows), width), self._tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids = r.prompt_ids + r.completion_ids
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
        device = self.accelerator.device
        return {
            "input_ids": input_ids.to(device),
            "attention_mask": attention.to(device),
            "logits_to_keep": width - min(len(r.prompt_ids) for r in rows),
        }

    def _start_logps_of(self, row: TrainRow) -> Any:
        at = self._row_index.get(id(row))
        # A zero-weight filler (a copy, loss mask 0) adds nothing whatever its old logprob.
        return row.behavior_logprobs if at is None else self._start_logps[at]

    def _compute_start_logps(self) -> list[torch.Tensor]:
        """The completion logprobs of every row under the weights before any update. Each process scores every
        nproc-th row (in length buckets, as training pads them) and all of them gather the whole table."""
        from accelerate.utils import gather_object

        nproc, rank = self.accelerator.num_processes, self.accelerator.process_index
        mine = list(range(rank, len(self.data.rows), nproc))
        import time

        scored: list[tuple[int, list[float]]] = []
        started, tokens = time.perf_counter(), 0
        lengths = [self.data.rows[i].num_tokens for i in mine]
        for bucket in length_buckets(lengths, self.args.pad_waste, self.args.token_budget):
            for at in range(0, len(bucket), self.args.start_logps_batch):
                indices = [mine[i] for i in bucket[at : at + self.args.start_logps_batch]]
                rows = [self.data.rows[i] for i in indices]
                chunk = self._sequences(rows)
                # Only trained positions are scored (the others are never read: every use is under the loss mask).
                chunk["loss_mask"] = _window(rows, chunk["logits_to_keep"], lambda r: r.loss_mask)
                logps = self._logps_no_grad(self.model, chunk).float().cpu()
                tokens += chunk["input_ids"].numel()
                for i, (index, r, at) in enumerate(zip(indices, rows, _completion_offsets(rows), strict=True)):
                    scored.append((index, logps[i, at : at + len(r.completion_ids)].tolist()))
        self.start_scoring = (tokens, time.perf_counter() - started)
        log.info("scored the starting weights: %d tokens in %.1f s", *self.start_scoring)
        if self.on_start_scored is not None and self.start_scoring[1] > 0:
            self.on_start_scored(tokens / self.start_scoring[1])
        table = dict(gather_object(scored)) if nproc > 1 else dict(scored)
        return [torch.tensor(table[i]) for i in range(len(self.data.rows))]

    @torch.no_grad()
    def _logps_no_grad(self, model, chunk: dict[str, Any]) -> torch.Tensor:
        logps, _ = self._trained_logps(model, chunk)
        return logps

    def _trained_logps(
        self, model, chunk: dict[str, Any], compute_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, logits_to_keep) logprobs and entropies at the loss mask's positions, zeros elsewhere: the head
        scores only those positions (TRL's scores the whole completion window, and on CPU every position)."""
        labels = trained_labels(chunk["input_ids"], chunk["loss_mask"])
        labels = labels.masked_fill(chunk["attention_mask"] == 0, -100)
        keep = chunk["logits_to_keep"]
        with self.accelerator.autocast():
            out = model(
                input_ids=chunk["input_ids"], attention_mask=chunk["attention_mask"], labels=labels, fused_lm_head=True
            )
        entropy = out.entropy[:, -keep:] if compute_entropy else None
        return out.log_probs[:, -keep:], entropy

    @torch.no_grad()
    def _reference_logps(self, chunk: dict[str, Any]) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logps_no_grad(self.ref_model, chunk)
        # PEFT: the reference is the base model, i.e. the adapter switched off (TRL's own rule).
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._logps_no_grad(self.model, chunk)

    # --- resume -------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # TRL restarts its micro-step counter at 0 on resume and would rebuild the step's batch with
        # the *current* weights as "old": keep the counter and the batch (old logprobs included).
        if self.num_iterations > 1:
            torch.save(
                {"step": self._step, "buffered": self._buffered_inputs},
                folder / f"polar_step_buffer-{self.accelerator.process_index}.pt",
            )
        # The starting weights are gone by then: a resumed run must clip against the same table.
        if self._start_logps is not None and self.accelerator.is_main_process:
            torch.save(self._start_logps, folder / START_LOGPS_FILE)

    def resume_from(self, checkpoint: Path) -> None:
        """Exact resume: restore TRL's micro-step counter and buffered batch saved with ``checkpoint``, and with
        ``--clip-against start`` the starting weights' logprobs."""
        if self.num_iterations > 1:
            self._resume_buffer = Path(checkpoint) / f"polar_step_buffer-{self.accelerator.process_index}.pt"
        if self.args.clip_against == "start":
            path = Path(checkpoint) / START_LOGPS_FILE
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} missing: with --clip-against start, resume needs the starting "
                    "weights' logprobs saved with the checkpoint"
                )
            self._start_logps = torch.load(path, weights_only=True)
            if len(self._start_logps) != len(self.data.rows):
                raise ValueError(
                    f"{path} scores {len(self._start_logps)} traces, these inputs have "
                    f"{len(self.data.rows)}: resume with the inputs the checkpoint was trained on"
                )

    def _restore_step_buffer(self, path: Path) -> None:
        self._resume_buffer = None
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} missing: with --num-iterations > 1, resume needs the step buffer saved with the checkpoint"
            )
        saved = torch.load(path, map_location=self.accelerator.device, weights_only=False)
        self._step, self._buffered_inputs = saved["step"], saved["buffered"]

    # --- loss ---------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        args = self.args
        mode = "train" if self.model.training else "eval"
        # TRL's dapo/cispo normaliser: the step's trainable tokens, per process and accumulation window.
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / args.steps_per_generation
        loss = torch.zeros((), device=self.accelerator.device)
        done = torch.zeros((), device=self.accelerator.device)  # the value of the chunks already backpropagated
        sums: dict[str, torch.Tensor] = {}
        ratio_lo, ratio_hi = [], []
        chunks = inputs["chunks"]
        # Every forward but the last gets its backward here, so one forward's activations are alive at a time; the
        # last one's loss is returned for the Trainer's backward (TRL's loss is already scaled for accumulation, so
        # the Trainer backpropagates it unscaled, as here). Under DDP the early backwards run without a gradient
        # all-reduce: each process reduces once per micro-step, however many forwards it ran.
        separate = torch.is_grad_enabled() and len(chunks) > 1 and not self._one_backward_per_micro_step()
        for at, chunk in enumerate(chunks):
            if separate and at < len(chunks) - 1:
                with self.accelerator.no_sync(model):
                    chunk_loss, stats, ratio = self._chunk_loss(model, chunk)
                    self.accelerator.backward(chunk_loss / normalizer)
                done = done + chunk_loss.detach() / normalizer
            else:
                chunk_loss, stats, ratio = self._chunk_loss(model, chunk)
                loss = loss + chunk_loss / normalizer
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            if ratio.numel():
                ratio_lo.append(ratio.min())
                ratio_hi.append(ratio.max())
        self._log_loss_metrics(mode, sums, ratio_lo, ratio_hi)
        return loss + done

    def _chunk_loss(self, model, chunk: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Summed per-token loss of one chunk, its metric sums, and its masked pi_theta / pi_behavior."""
        args = self.args
        logps, entropies = self._trained_logps(model, chunk, compute_entropy=True)
        mask = chunk["loss_mask"]
        behavior = chunk["behavior_logps"]
        old = chunk.get("old_logps")
        old = logps.detach() if old is None else old
        adv = chunk["advantages"].unsqueeze(1)
        bound = args.log_ratio_clamp
        per_token, ratio, log_is = policy_loss(
            logps,
            old,
            behavior,
            adv,
            loss_type=self.loss_type,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            cispo_cap=args.cispo_cap,
            tis_cap=args.tis_cap,
            log_ratio_clamp=bound,
        )
        if self.beta != 0.0:
            ref_diff = torch.clamp(chunk["ref_logps"] - logps, -bound, bound)
            per_token_kl = torch.exp(ref_diff) - ref_diff - 1
            per_token = per_token + self.beta * per_token_kl

        m = mask.bool()
        with torch.no_grad():
            behaviour_ratio = torch.exp(torch.clamp(logps.detach() - behavior, -bound, bound))[m]
            negative = (adv < 0).expand_as(mask)
            positive = (adv > 0).expand_as(mask)
            if self.loss_type == "cispo":
                low = torch.zeros_like(mask, dtype=torch.bool)
                high = (ratio > args.cispo_cap) & positive
            else:
                low = (ratio < 1 - self.epsilon_low) & negative
                high = (ratio > 1 + self.epsilon_high) & positive
            stats = {
                "count": mask.sum(),
                "entropy": (entropies * mask).sum(),
                "clip_low": (low.float() * mask).sum(),
                "clip_high": (high.float() * mask).sum(),
                "is_sum": behaviour_ratio.sum(),
                "tis_truncated": ((log_is >= math.log(args.tis_cap)).float() * mask).sum(),
                "tis_weight": (torch.exp(log_is) * mask).sum(),
            }
            if self.beta != 0.0:
                stats["kl"] = (per_token_kl * mask).sum()
        return (per_token * mask).sum(), stats, behaviour_ratio

    def _log_loss_metrics(self, mode: str, sums: dict[str, torch.Tensor], lo: list, hi: list) -> None:
        keys = sorted(sums)
        totals = self.accelerator.reduce(torch.stack([torch.as_tensor(sums[k]).float() for k in keys]), "sum")
        t = dict(zip(keys, totals.tolist(), strict=True))
        count = max(t["count"], 1.0)
        # A zero-weight filler micro-batch has no trainable token: NaN, which TRL's log() skips.
        nan = torch.tensor(float("nan"), device=self.accelerator.device)
        lo_all = nanmin(self.accelerator.gather(torch.stack(lo).min() if lo else nan))
        hi_all = nanmax(self.accelerator.gather(torch.stack(hi).max() if hi else nan))
        metrics = self._metrics[mode]
        metrics["entropy"].append(t["entropy"] / count)
        if self.beta != 0.0:
            metrics["kl"].append(t["kl"] / count)
        metrics["clip_ratio/low_mean"].append(t["clip_low"] / count)
        metrics["clip_ratio/high_mean"].append(t["clip_high"] / count)
        metrics["clip_ratio/region_mean"].append((t["clip_low"] + t["clip_high"]) / count)
        metrics["is_ratio/mean"].append(t["is_sum"] / count)
        metrics["is_ratio/min"].append(lo_all.item())
        metrics["is_ratio/max"].append(hi_all.item())
        metrics["is_ratio/truncated_frac"].append(t["tis_truncated"] / count)
        metrics["tis/weight_mean"].append(t["tis_weight"] / count)


def policy_loss(
    logps: torch.Tensor,
    old: torch.Tensor,
    behavior: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    cispo_cap: float,
    tis_cap: float,
    log_ratio_clamp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token policy loss (before the mask and the normaliser), the ratio pi_theta / pi_old, and the log of the TIS
    weight.

    PPO-clip (``dapo``/``grpo``): ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; CISPO: ``-sg(min(r, cap)) A
    logp``. Either times the TIS weight ``min(pi_old / pi_behavior, C)`` (a constant: no gradient flows through it).
    Log-ratios are clamped to +-``log_ratio_clamp`` before ``exp`` so a -9999 sentinel logprob gives a bounded
    weight, not inf."""
    bound = log_ratio_clamp
    ratio = torch.exp(torch.clamp(logps - old, -bound, bound))
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=cispo_cap).detach() * advantages * logps
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
    # TIS: min(exp(old - behaviour), C), computed in log space so a -9999 sentinel gives C, not inf.
    log_is = torch.clamp(old.detach() - behavior, -bound, math.log(tis_cap))
    return per_token * torch.exp(log_is), ratio, log_is


def _completion_offsets(rows: list[TrainRow]) -> list[int]:
    """Where each row's completion starts in the scored window, which begins at the shortest prompt's end."""
    start = min(len(r.prompt_ids) for r in rows)
    return [len(r.prompt_ids) - start for r in rows]


def _window(rows: list[TrainRow], keep: int, values: Any) -> torch.Tensor:
    """(rows, keep) float tensor: each row's per-completion-token ``values(row)`` at its place in the scored window,
    zeros elsewhere."""
    out = torch.zeros((len(rows), keep), dtype=torch.float32)
    for i, (r, at) in enumerate(zip(rows, _completion_offsets(rows), strict=True)):
        out[i, at : at + len(r.completion_ids)] = torch.as_tensor(values(r), dtype=torch.float32)
    return out


def _zero_weight(row: TrainRow) -> TrainRow:
    return dataclasses.replace(row, loss_mask=[0] * len(row.loss_mask), advantage=0.0, session_weight=0.0)


def build_grpo_config(
    cfg: Any, *, temperature: float, max_completion_length: int, memory: Any = None
) -> TraceGRPOConfig:
    """TRL arguments from a TrainConfig (``cfg``); our knobs map onto TRL's own where they exist. ``memory`` (a
    ``budget.MemoryPlan``) sets the token budget and checkpointing; without it they are ``cfg``'s as given.

    Dtype policy: parameters and optimizer state are always fp32 (master weights: AdamW's update at
    lr 1e-6 is far below half a bf16 ulp, so bf16 parameters would mostly never move); ``cfg.dtype``
    is the *compute* dtype, bf16 meaning autocast around the forward passes.
    """
    compute = resolve_dtype(cfg.dtype)
    scheduler = cfg.lr_scheduler
    if cfg.warmup_ratio > 0 and scheduler == "constant":
        scheduler = "constant_with_warmup"  # "constant" ignores warmup
    return TraceGRPOConfig(
        output_dir=str(cfg.output),
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type=scheduler,
        warmup_steps=cfg.warmup_ratio,  # a float < 1 is a ratio of the total steps (TRL/HF semantics)
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=TRL_PLACEHOLDER_GENERATIONS,
        num_generations=TRL_PLACEHOLDER_GENERATIONS,
        gradient_accumulation_steps=cfg.grad_accum,
        steps_per_generation=cfg.grad_accum,
        num_iterations=cfg.num_iterations,
        clip_against=cfg.clip_against,
        epsilon=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        delta=None,  # TRL's dual-clip is not used: our _compute_loss does TIS
        tis_cap=cfg.tis_cap,
        cispo_cap=cfg.cispo_cap,
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        temperature=temperature,
        max_completion_length=max_completion_length,
        mask_truncated_completions=False,
        bf16=compute == torch.bfloat16,
        activation_checkpointing=bool(cfg.gradient_checkpointing) if memory is None else memory.gradient_checkpointing,
        token_budget=cfg.token_budget if memory is None else memory.token_budget,
        optim=cfg.optim,
        model_init_kwargs={"dtype": torch.float32},
        seed=cfg.seed,
        logging_steps=cfg.logging_steps,
        save_strategy="steps" if cfg.save_steps > 0 else "no",
        save_steps=max(cfg.save_steps, 1),
        save_total_limit=cfg.save_total_limit,
        # Without CUDA, say so: accelerate only forms a multi-process (gloo) group for CPU runs then.
        use_cpu=not torch.cuda.is_available(),
        # --report-to: TRL's own callbacks log the trainer's metrics (polar_cli/trackers.py sets where they write).
        report_to=cfg.trackers or "none",
        run_name=cfg.tracker_run_name,
        project=cfg.project,
        disable_tqdm=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
    )


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
