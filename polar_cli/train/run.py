"""`polar train` end to end: traces -> rows -> TraceGRPOTrainer -> HF checkpoint, metrics, curves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from transformers import TrainerCallback

from polar_cli.serving import ADAPTER_DIR
from polar_cli.train.config import TrainConfig

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "training_curves.png"


@dataclass
class TrainResult:
    output: Path
    steps: int
    stats: dict[str, int]
    temperature: float
    metrics_path: Path
    plot_path: Path | None
    train_seconds: float = 0.0
    num_processes: int = 1
    summary: dict[str, Any] = field(default_factory=dict)
    memory: Any = None  # the budget.MemoryPlan trained with


class MetricsFile(TrainerCallback):
    """Appends every log (one per logging step) to metrics.jsonl, main process only."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch, **logs}
        with self.path.open("ab") as f:
            f.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")


class RichProgress(TrainerCallback):
    """One progress bar with the latest reward, loss, clip fraction and IS ratio."""

    def __init__(self) -> None:
        self.progress = None
        self.task = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold blue]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=state.max_steps, status="", completed=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is None or not logs or "loss" not in logs:
            return
        parts = [
            f"{label} {logs[key]:.4g}"
            for label, key in (
                ("reward", "reward"),
                ("loss", "loss"),
                ("clip", "clip_ratio/region_mean"),
                ("is", "is_ratio/mean"),
            )
            if logs.get(key) is not None
        ]
        self.progress.update(self.task, status="  ".join(parts))

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def run_training(
    cfg: TrainConfig, traces: list | None = None, echo: Callable[[str], None] | None = None
) -> TrainResult:
    """Train from ``cfg.inputs`` (or from ``traces`` already in memory) and write ``cfg.output``. ``echo`` is told,
    before training, the token budget, whether activations are checkpointed and why, and what a step will take."""
    import logging
    import os
    import time

    from polar_addon.call_roles import parse_roles
    from polar_cli.train.dataset import NothingToTrain, explain_nothing_to_train, load_traces, prepare_rows

    cfg.validate()
    if traces is None:
        # The model being trained carries the tokenizer the traces were sampled with.
        tokenizer = cfg.model if (Path(cfg.model) / "tokenizer_config.json").is_file() else None
        traces = load_traces(
            cfg.inputs,
            cfg.strategy,
            tokenizer=tokenizer,
            broadcast_rewards=cfg.broadcast_rewards,
            eot_token_id=cfg.eot_token_id,
            merge_retokenized=cfg.retokenized == "merge",
            roles=parse_roles(cfg.roles),
            tool_call_reward=cfg.tool_call_reward,
        )
    unrewarded = cfg.strategy == "per_request" and not cfg.broadcast_rewards
    if not any(t.trainable for t in traces):
        raise NothingToTrain(
            f"no trainable traces: {explain_nothing_to_train(traces, {}, unrewarded_per_request=unrewarded)}"
        )
    check_staleness(traces, cfg.current_weight_version, cfg.max_staleness)
    data = prepare_rows(
        traces,
        max_length=cfg.max_length,
        scale_rewards=cfg.scale_rewards,
        drop_zero_advantage=cfg.drop_zero_advantage,
        temperature=cfg.temperature,
    )
    if not data.rows:
        raise NothingToTrain(
            f"no trainable rows: {explain_nothing_to_train(traces, data.stats, unrewarded_per_request=unrewarded)}"
        )
    cfg.output.mkdir(parents=True, exist_ok=True)
    metrics_path = cfg.output / METRICS_FILE
    if cfg.resume is None and metrics_path.exists():
        metrics_path.unlink()

    if cfg.trackers:
        import os

        from polar_cli.trackers import tracker_env

        # TRL's tracker callbacks read their directories from the environment (transformers has no logging_dir).
        os.environ.update(tracker_env(cfg.trackers, cfg.tracker_dir, cfg.tracker_run_name, cfg.project))
    callbacks: list[TrainerCallback] = [MetricsFile(metrics_path)]
    if cfg.progress:
        callbacks.append(RichProgress())
    if echo is None or int(os.environ.get("RANK", "0")) != 0:
        echo = logging.getLogger("polar.train").info
    memory, steps = plan_run(cfg, data)
    echo(f"memory: {memory.why}")
    echo(steps.describe(memory.token_budget, memory.gradient_checkpointing))
    trainer = build_trainer(cfg, data, callbacks, memory=memory)
    if trainer.args.clip_against == "start" and cfg.resume is None:
        trainer.on_start_scored = lambda rate: echo(
            steps.describe(memory.token_budget, memory.gradient_checkpointing, rate)
        )
    if cfg.resume is not None:
        trainer.resume_from(cfg.resume)
    start = time.perf_counter()
    output = trainer.train(resume_from_checkpoint=str(cfg.resume) if cfg.resume else None)
    seconds = time.perf_counter() - start
    save_checkpoint(trainer, cfg.output, serving_dtype(cfg.model))

    plot_path = None
    if cfg.plot and trainer.accelerator.is_main_process and metrics_path.exists():
        from polar_cli.train.plots import plot_curves

        plot_path = plot_curves(metrics_path, cfg.output / CURVES_FILE)
    return TrainResult(
        output=cfg.output,
        steps=trainer.state.global_step,
        stats=data.stats,
        temperature=data.temperature,
        metrics_path=metrics_path,
        plot_path=plot_path,
        train_seconds=seconds,
        num_processes=trainer.accelerator.num_processes,
        summary=dict(output.metrics),
        memory=memory,
    )


def plan_run(cfg: TrainConfig, data):
    """The memory plan (budget.MemoryPlan) for ``cfg`` on this machine, and the first epoch's step plan."""
    import os

    from transformers import AutoConfig

    from polar_cli.train.budget import ModelShape, available_memory, lora_trainable_params, plan_memory, plan_steps
    from polar_cli.train.trainer import StepSampler, TraceGRPOConfig

    shape = ModelShape.from_config(AutoConfig.from_pretrained(cfg.model))
    if cfg.lora_r > 0:
        shape = ModelShape(**{**shape.__dict__, "trainable_params": lora_trainable_params(shape, cfg.lora_r)})
    nproc = int(os.environ.get("WORLD_SIZE", "1"))
    memory = plan_memory(
        shape,
        max(r.num_tokens for r in data.rows),
        token_budget=cfg.token_budget,
        gradient_checkpointing=cfg.gradient_checkpointing,
        available=available_memory(processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        reference_model=cfg.beta != 0.0 and cfg.lora_r == 0,
    )
    sampler = StepSampler(len(data.groups), cfg.groups_per_step, repeats=1, seed=cfg.seed)
    steps = plan_steps(
        [[i for g in step for i in data.groups[g]] for step in sampler.steps()],
        [r.num_tokens for r in data.rows],
        [r.num_trainable for r in data.rows],
        micro_batches=cfg.grad_accum * nproc,
        token_budget=memory.token_budget,
        pad_waste=TraceGRPOConfig.pad_waste,
    )
    return memory, steps


def serving_dtype(model: str):
    """The dtype the starting checkpoint is stored in, i.e. what an engine loading it serves."""
    import torch
    from transformers import AutoConfig

    # transformers (>= 4.56, as pyproject requires) reads the config's dtype string as a torch.dtype itself.
    return AutoConfig.from_pretrained(model).dtype or torch.float32


class StaleTraces(ValueError):
    """Traces sampled too many weight versions before the weights being trained."""


def check_staleness(traces: list, current: str | None, max_staleness: int | None) -> int:
    """Warn about (or, past ``max_staleness``, refuse) traces sampled by older weights than ``current``.

    Versions are compared as integers when they all parse as such (what `polar engine reload
    --weight-version N` tags); otherwise any version other than ``current`` counts as 1 behind.
    Returns the number of stale trainable traces.
    """
    import logging

    if current is None:
        return 0
    stale, worst = 0, 0
    for t in traces:
        if not t.trainable or not t.weight_versions:
            continue
        behind = [_versions_behind(v, current) for v in t.weight_versions]
        if max(behind) > 0:
            stale += 1
            worst = max(worst, max(behind))
    if stale:
        message = (
            f"{stale} trainable traces were sampled by weights older than {current!r} (up to {worst} versions "
            "behind): their importance weights correct for it only up to --tis-cap"
        )
        if max_staleness is not None and worst > max_staleness:
            raise StaleTraces(f"{message}; --max-staleness is {max_staleness}. Recapture or raise the bound.")
        logging.getLogger("polar.train").warning(message)
    return stale


def _versions_behind(version: str, current: str) -> int:
    try:
        return max(0, int(current) - int(version))
    except ValueError:
        return 0 if version == current else 1


def build_trainer(cfg: TrainConfig, data, callbacks: list[TrainerCallback] | None = None, memory=None):
    """A TraceGRPOTrainer for prepared rows (``TrainData``), configured from ``cfg`` (and ``memory``, a
    ``budget.MemoryPlan``: without one, ``cfg``'s token budget and checkpointing as given)."""
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from polar_cli.train.trainer import TraceGRPOTrainer, build_grpo_config

    args = build_grpo_config(
        cfg, temperature=data.temperature, max_completion_length=data.max_completion_length, memory=memory
    )
    trainer = TraceGRPOTrainer(
        model=cfg.model,
        args=args,
        data=data,
        groups_per_step=cfg.groups_per_step,
        processing_class=AutoTokenizer.from_pretrained(cfg.model),
        peft_config=_lora_config(cfg),
        callbacks=callbacks,
    )
    # Logs go to metrics.jsonl and the progress bar, not to stdout as dicts.
    trainer.remove_callback(PrinterCallback)
    if cfg.lora_init is not None:
        load_adapter(trainer.model, cfg.lora_init)
    return trainer


def load_adapter(model, adapter: Path) -> None:
    """Go on training a saved adapter: its weights into the run's fresh one, whose shape must be the adapter's (a
    different rank, alpha or set of target modules would train another adapter than the one being served)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        saved = orjson.loads((adapter / "adapter_config.json").read_bytes())
        weights = load_file(adapter / "adapter_model.safetensors")
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"--lora-init {adapter}: not a saved LoRA adapter ({exc})") from exc
    lora = model.peft_config["default"]
    for key, flag in (("r", "--lora-r"), ("lora_alpha", "--lora-alpha"), ("use_rslora", None)):
        if saved.get(key, False) != getattr(lora, key):
            raise ValueError(
                f"--lora-init {adapter}: its {key} is {saved.get(key)}, this run's {getattr(lora, key)}"
                + (f" (pass {flag} {saved.get(key)})" if flag else "")
            )
    result = set_peft_model_state_dict(model, weights)
    # peft reports every base weight as missing (an adapter holds none): only a missing LoRA weight matters.
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"--lora-init {adapter}: its weights do not fit this run's adapter (targets "
            f"{sorted(lora.target_modules)}): unexpected {list(result.unexpected_keys)[:3]}, missing {missing[:3]}"
        )


def _lora_config(cfg: TrainConfig):
    if cfg.lora_r == 0:
        return None
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha or 2 * cfg.lora_r,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )


def save_checkpoint(trainer, out_dir: Path, serving_dtype=None) -> None:
    """Write a plain HF checkpoint (LoRA merged) that vLLM and SGLang load as is.

    The full state dict comes from the accelerator (gathered under FSDP / ZeRO-3, where each
    process holds a shard), LoRA is merged into the fp32 master weights in fp32, and the result is
    cast once to ``serving_dtype`` (the starting model's dtype, what the engine will serve).
    """
    import torch
    from accelerate.utils import is_peft_model

    state = trainer.accelerator.get_state_dict(trainer.model)  # a collective: every process calls it
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    if is_peft_model(model):
        lora = model.peft_config["default"]
        save_adapter(model, state, out_dir / ADAPTER_DIR)
        scaling = lora.lora_alpha / (lora.r**0.5 if lora.use_rslora else lora.r)
        state = merge_lora_state_dict(state, scaling)
        model = model.get_base_model()
    dtype = serving_dtype or model.config.dtype
    cast: dict[int, torch.Tensor] = {}  # by storage, so tied weights stay one tensor (saved once)
    state = {
        k: cast.setdefault(v.data_ptr(), v.to(dtype)) if torch.is_floating_point(v) else v for k, v in state.items()
    }
    # Training turns the KV cache off; the checkpoint is for inference.
    model.config.use_cache = True
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    # save_pretrained records the dtype of the (fp32 master) parameters; engines serve the config's.
    model.config.dtype = dtype
    model.config.save_pretrained(out_dir)
    trainer.processing_class.save_pretrained(out_dir)


def save_adapter(model, state: dict, out_dir: Path) -> None:
    """The LoRA adapter alone, in PEFT's format (fp32, as trained): what a server of the base model loads in place
    (``polar engine serve --push adapter``). Its config names the base by absolute path, which that server checks:
    an adapter is a difference from the weights it was trained on."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    weights = get_peft_model_state_dict(model, state_dict=state)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().float().cpu().contiguous() for k, v in weights.items()}, out_dir / "adapter_model.safetensors"
    )
    config = copy.copy(model.peft_config["default"])
    base = config.base_model_name_or_path
    if base and Path(base).is_dir():
        config.base_model_name_or_path = str(Path(base).resolve())
    config.save_pretrained(out_dir)


def merge_lora_state_dict(state: dict, scaling: float, adapter: str = "default") -> dict:
    """A PEFT LoRA state dict -> the plain model's, with ``W + scaling * B @ A`` computed in fp32."""

    prefix = "base_model.model."
    out: dict = {}
    for key, value in state.items():
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        out[name] = value
        stem = key.rsplit(".base_layer.weight", 1)[0] if key.endswith(".base_layer.weight") else None
        if stem is not None and f"{stem}.lora_A.{adapter}.weight" in state:
            a = state[f"{stem}.lora_A.{adapter}.weight"].float()
            b = state[f"{stem}.lora_B.{adapter}.weight"].float()
            out[name] = value.float() + scaling * (b @ a)
    return out
