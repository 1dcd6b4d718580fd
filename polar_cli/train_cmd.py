"""`polar train`: a thin Typer shell over polar_cli.train.

Heavy imports (torch, TRL) happen inside the commands so `polar --help` stays fast.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import typer

from polar_cli.settings import command
from polar_cli.train.config import TrainConfig

# Exit status when every trace was dropped (e.g. equal rewards everywhere): not an error for a loop.
EXIT_NOTHING_TO_TRAIN = 3


@command
def train(
    cfg: TrainConfig,
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

    _check_model_and_output(cfg.model, cfg.output, overwrite=overwrite, resume=cfg.resume)
    _check_trackers(cfg)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from polar_cli.terminal import markup_safe
    from polar_cli.train.dataset import NothingToTrain, TemperatureMismatch
    from polar_cli.train.run import run_training

    console = Console(stderr=True)
    if verbose:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("polar.train: %(message)s"))
        logging.getLogger("polar.train").addHandler(handler)
        logging.getLogger("polar.train").setLevel(logging.INFO)
    try:
        result = run_training(cfg, echo=lambda line: console.print(markup_safe(line)))
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


def _check_trackers(cfg: TrainConfig) -> None:
    """An unknown or uninstalled --report-to tracker is refused before any heavy import, with how to install it."""
    from polar_cli.trackers import TrackerError, check_installed

    try:
        check_installed(cfg.trackers)
    except TrackerError as exc:
        raise typer.BadParameter(str(exc), param_hint="--report-to") from exc


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
