"""The `polar` command line: a thin Typer shell over polar_addon and polar_cli's pure modules.

Each command group lives in its own module; this file only assembles them.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.settings import command, option

app = typer.Typer(
    name="polar",
    help="Train unmodified coding agents with RL: capture token-exact model calls through the polar "
    "mitmproxy addon, build trajectories from the Parquet shards, and train with TRL's GRPOTrainer.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """polar: capture, build, train."""
    # Every command stops its children and seals its shards on SIGINT/SIGTERM. A blocked signal survives exec: a
    # parent that blocked them (Ray does so in the processes it starts) would leave polar stoppable only by SIGKILL.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


@dataclass
class TinyModelSettings:
    """`polar tiny-model`'s command line (build_tiny_model checks the choices)."""

    out_dir: Path = option(argument=True, help="Directory to write the model and tokenizer into.")
    seed: int = option(0, help="Weight-init seed; the same seed gives the same files.")
    generation_defaults: str = option(
        "none", help="Sampling defaults in generation_config.json: none, or qwen3 (T=0.6, top_p 0.95, top_k 20)."
    )
    dtype: str = option("float32", help="Stored weight dtype: float32 or bfloat16 (as released checkpoints).")
    size: str = option("tiny", help="Shape: tiny (tests), small (CPU bench), 0.5b (Qwen3-0.6B's shape).")


@app.command("tiny-model")
@command
def tiny_model(settings: TinyModelSettings) -> None:
    """Build a tiny random-init Qwen3 model with a local BPE tokenizer and ChatML tool template (offline)."""
    from polar_cli.tiny_model import build_tiny_model

    try:
        path = build_tiny_model(
            settings.out_dir,
            seed=settings.seed,
            generation_defaults=settings.generation_defaults,
            dtype=settings.dtype,
            size=settings.size,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"tiny model written to {path}")


# Command groups register below (one line each).
from polar_cli.train_cmd import register as register_train  # noqa: E402  (train)

register_train(app)
from polar_cli.proxy_cmd import proxy  # noqa: E402  (proxy)

app.command("proxy")(proxy)
from polar_cli.engine_cmd import engine_app  # noqa: E402  (engine serve|reload|stop)

app.add_typer(engine_app, name="engine")
from polar_cli.build_cmd import register as register_build  # noqa: E402  (build, stats, view)

register_build(app)
from polar_cli.shards_cmd import reward, shards_app  # noqa: E402  (shards inspect|validate, reward)

app.add_typer(shards_app, name="shards")
app.command("reward")(reward)
from polar_cli.rollout_cmd import rollout  # noqa: E402  (rollout)

app.command("rollout")(rollout)
from polar_cli.eval_cmd import eval_tasks  # noqa: E402  (eval)

app.command("eval")(eval_tasks)
from polar_cli.loop_cmd import register as register_loop  # noqa: E402  (loop)

register_loop(app)
from polar_cli.model_cmd import model_app  # noqa: E402  (model import-gguf)

app.add_typer(model_app, name="model")
from polar_cli.export_cmd import register as register_export  # noqa: E402  (export)

register_export(app)
from polar_cli.dashboard_cmd import register as register_dashboard  # noqa: E402  (dashboard)

register_dashboard(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
