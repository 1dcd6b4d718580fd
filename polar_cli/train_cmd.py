"""`polar train`: a thin Typer shell over polar_cli.train.

Heavy imports (torch, TRL) happen inside the commands so `polar --help` stays fast.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

import typer

from polar_cli.train.config import DTYPES, LOSS_TYPES, TrainConfig

# Exit status when every trace was dropped (e.g. equal rewards everywhere): not an error for a loop.
EXIT_NOTHING_TO_TRAIN = 3

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(TrainConfig)}


def _d(name: str) -> Any:
    return _DEFAULTS[name]


def train(
    inputs: list[Path] = typer.Argument(
        ..., help="A trace store (the proxy's polar_out: built on the fly) or a built trace dataset (`polar build`)."
    ),
    model: str = typer.Option(..., "--model", "-m", help="Model directory to start from (the policy that sampled)."),
    output: Path = typer.Option(..., "--output", "-o", help="Checkpoint directory to write (HF format, vLLM-ready)."),
    strategy: str = typer.Option(_d("strategy"), help="Builder for raw shards: prefix_merging or per_request."),
    broadcast_rewards: bool = typer.Option(
        _d("broadcast_rewards"), "--broadcast-rewards", help="per_request: every call gets its session's reward."
    ),
    eot_token_id: int | None = typer.Option(
        None, help="Raw shards: end-of-turn token id (default: detected from the calls, as `polar build`)."
    ),
    retokenized: str = typer.Option(
        _d("retokenized"),
        help="Raw shards: merge or break chains at a re-tokenized sampled turn, as `polar build --retokenized`. "
        "break keeps the first step exactly on-policy (merged later turns were sampled after other token ids).",
    ),
    learning_rate: float = typer.Option(_d("learning_rate"), "--lr", "--learning-rate", help="Peak learning rate."),
    optim: str = typer.Option(_d("optim"), help="Optimizer (TrainingArguments name: adamw_torch, sgd, ...)."),
    weight_decay: float = typer.Option(_d("weight_decay")),
    max_grad_norm: float = typer.Option(_d("max_grad_norm")),
    lr_scheduler: str = typer.Option(_d("lr_scheduler"), help="constant, linear, cosine, ..."),
    epochs: float = typer.Option(_d("epochs"), help="Passes over the traces."),
    max_steps: int = typer.Option(_d("max_steps"), help="Optimizer steps; > 0 overrides --epochs."),
    groups_per_step: int = typer.Option(_d("groups_per_step"), help="GRPO groups (tasks) per optimizer step."),
    grad_accum: int = typer.Option(_d("grad_accum"), help="Micro-batches per step and process (memory)."),
    num_iterations: int = typer.Option(_d("num_iterations"), help="Optimizer steps on each step's batch (PPO mu)."),
    clip_against: str = typer.Option(
        _d("clip_against"),
        help="pi_old of the PPO clip and TIS weight: start = the weights the run started from (one no-grad pass "
        "over the traces first, as verl/slime recompute old logprobs): the clip bounds the whole run's drift from "
        "the policy that sampled the traces; step = the weights at the start of each step (no bound across steps).",
    ),
    epsilon_low: float = typer.Option(_d("epsilon_low"), help="PPO clip: ratio >= 1 - eps_low."),
    epsilon_high: float = typer.Option(_d("epsilon_high"), help="PPO clip: ratio <= 1 + eps_high (DAPO clip-higher)."),
    tis_cap: float = typer.Option(
        _d("tis_cap"), help="Truncated importance sampling: token weight min(pi_old/pi_behavior, C)."
    ),
    cispo_cap: float = typer.Option(_d("cispo_cap"), help="--loss-type cispo: cap on pi_theta/pi_old."),
    warmup_ratio: float = typer.Option(_d("warmup_ratio"), help="Linear LR warmup over this fraction of the steps."),
    current_weight_version: str | None = typer.Option(
        None, help="Version tag of --model (what `engine reload --weight-version` set): older traces are warned about."
    ),
    max_staleness: int | None = typer.Option(
        None, help="Refuse traces more than this many weight versions behind --current-weight-version."
    ),
    beta: float = typer.Option(_d("beta"), help="KL coefficient to the starting model (0: no reference model)."),
    loss_type: str = typer.Option(_d("loss_type"), help=f"TRL loss: {', '.join(LOSS_TYPES)}."),
    scale_rewards: str = typer.Option(_d("scale_rewards"), help="group: divide advantages by the group std; none."),
    keep_zero_advantage: bool = typer.Option(
        False, "--keep-zero-advantage", help="Also forward traces whose advantage is 0 (they add no gradient)."
    ),
    max_length: int = typer.Option(_d("max_length"), help="Prompt + completion tokens; completions are clipped."),
    temperature: float | None = typer.Option(None, help="Must equal the capture temperature (read from traces)."),
    lora_r: int = typer.Option(_d("lora_r"), help="LoRA rank; 0 trains every weight. Merged into the checkpoint."),
    lora_alpha: int = typer.Option(_d("lora_alpha"), help="LoRA alpha (0: 2 x rank)."),
    lora_dropout: float = typer.Option(_d("lora_dropout")),
    dtype: str = typer.Option(
        _d("dtype"),
        help=f"Compute dtype, {', '.join(DTYPES)} (auto: bf16 autocast on a capable GPU, else fp32); weights stay fp32.",
    ),
    gradient_checkpointing: bool = typer.Option(_d("gradient_checkpointing"), help="Trade compute for memory."),
    seed: int = typer.Option(_d("seed")),
    resume: Path | None = typer.Option(None, help="Resume from OUTPUT/checkpoint-N of an earlier run."),
    save_steps: int = typer.Option(_d("save_steps"), help="Write OUTPUT/checkpoint-N every N steps (0: only the end)."),
    plot: bool = typer.Option(_d("plot"), help="Write training_curves.png."),
    progress: bool = typer.Option(_d("progress"), help="Rich progress bar."),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Log which traces each process trains at each step "
        "(to stderr; with `accelerate launch`, one line per process).",
    ),
    overwrite: bool = typer.Option(False, help="Replace OUTPUT if it exists and is not empty (as `polar build`)."),
) -> None:
    """Train the policy with GRPO (TRL) on captured traces; write a checkpoint, metrics.jsonl and curves."""
    from rich.console import Console

    _check_model_and_output(model, output, overwrite=overwrite, resume=resume)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from polar_cli.terminal import markup_safe
    from polar_cli.train.dataset import NothingToTrain, TemperatureMismatch
    from polar_cli.train.run import run_training

    cfg = TrainConfig(
        inputs=inputs, model=model, output=output, strategy=strategy, broadcast_rewards=broadcast_rewards,
        eot_token_id=eot_token_id, retokenized=retokenized, learning_rate=learning_rate, optim=optim,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler, epochs=epochs,
        max_steps=max_steps, groups_per_step=groups_per_step,
        grad_accum=grad_accum, num_iterations=num_iterations, clip_against=clip_against, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        tis_cap=tis_cap, cispo_cap=cispo_cap, warmup_ratio=warmup_ratio, current_weight_version=current_weight_version,
        max_staleness=max_staleness, beta=beta, loss_type=loss_type, scale_rewards=scale_rewards,
        drop_zero_advantage=not keep_zero_advantage, max_length=max_length, temperature=temperature,
        lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, dtype=dtype,
        gradient_checkpointing=gradient_checkpointing, seed=seed, resume=resume, save_steps=save_steps,
        plot=plot, progress=progress,
    )  # fmt: skip
    console = Console(stderr=True)
    if verbose:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("polar.train: %(message)s"))
        logging.getLogger("polar.train").addHandler(handler)
        logging.getLogger("polar.train").setLevel(logging.INFO)
    try:
        result = run_training(cfg)
    except NothingToTrain as exc:
        console.print(f"[yellow]nothing to train:[/] {markup_safe(exc)}")
        raise typer.Exit(EXIT_NOTHING_TO_TRAIN) from exc
    except TemperatureMismatch as exc:
        console.print(f"[bold red]temperature mismatch:[/] {markup_safe(exc)}")
        raise typer.Exit(2) from exc
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[bold red]cannot train:[/] {markup_safe(exc)}")
        raise typer.Exit(2) from exc
    if int(os.environ.get("RANK", "0")) != 0:
        return
    s = result.stats
    console.print(
        f"traces {s['traces']} -> rows {s['rows']} in {s['groups']} groups / {s['sessions']} sessions "
        f"(dropped: untrainable {s['untrainable']}, zero advantage {s['zero_advantage']}, "
        f"overlong prompt {s['overlong_prompt']}, no trainable token {s['no_trainable_tokens']}; "
        f"clipped {s['clipped']}); temperature {result.temperature:g}"
    )
    procs = "process" if result.num_processes == 1 else "processes"
    console.print(f"{result.steps} steps in {result.train_seconds:.1f} s on {result.num_processes} {procs}")
    typer.echo(f"checkpoint: {result.output}")
    typer.echo(f"metrics: {result.metrics_path}")
    if result.plot_path:
        typer.echo(f"curves: {result.plot_path}")


def _check_model_and_output(model: str, output: Path, *, overwrite: bool, resume: Path | None) -> None:
    """Fail before any heavy import: a mistyped --model would otherwise end in a model-hub lookup, and an
    existing --output would be silently mixed with the new checkpoint."""
    path = Path(model).expanduser()
    if not path.exists():
        raise typer.BadParameter(
            f"{model} does not exist (resolved to {path.resolve()}); give a model directory", param_hint="--model"
        )
    if not (path / "config.json").is_file():
        raise typer.BadParameter(f"{model} is not a model directory (no config.json)", param_hint="--model")
    if resume is None and output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not overwrite:
            raise typer.BadParameter(
                f"{output} exists and is not empty (use --overwrite, or --resume)", param_hint="--output"
            )
        if output.is_dir():
            shutil.rmtree(output)
        else:
            output.unlink()


def register(app: typer.Typer) -> None:
    app.command("train")(train)
