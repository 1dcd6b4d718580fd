"""`polar engine serve|reload|stop`: a thin Typer shell over polar_cli.serving, with progress while waiting."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.settings import command, option, reuse

engine_app = typer.Typer(
    help="Serve, reload and stop inference engines for the train -> rollout loop.", no_args_is_help=True
)

STATE_DIR_HELP = "Where polar remembers the engines it started (env POLAR_STATE_DIR; default ./.polar/engines)."


def _state_dir(value: Path | None) -> Path:
    from polar_cli.serving import DEFAULT_STATE_DIR

    return value or DEFAULT_STATE_DIR


@contextmanager
def _waiting(what: str) -> Iterator[Callable[[float, str], None]]:
    """A live status line on stderr (seconds waited and the engine's last log line) while ``what`` runs."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    with console.status(what) as status:

        def progress(seconds: float, line: str) -> None:
            status.update(f"{what} ({seconds:.0f} s)  [dim]{escape(line[:100])}[/]")
            if not console.is_terminal and int(seconds) % 15 == 0:
                console.print(f"{what} ({seconds:.0f} s)")

        yield progress


@dataclass
class EngineServeSettings:
    """`polar engine serve`'s command line."""

    model: str = option(argument=True, help="Model directory to serve.")
    port: int = option(8000, help="Port on 127.0.0.1.")
    served_model_name: str | None = option(None, help="Name clients ask for; kept across reloads.")
    dtype: str = option("auto", help="vLLM --dtype (float32 on CPU).")
    max_model_len: int | None = option(None, help="vLLM --max-model-len.")
    tool_call_parser: str = option("hermes", help="vLLM --tool-call-parser for the model's tool-call format.")
    memory_fraction: str | None = option(
        None, help="vLLM --gpu-memory-utilization (without a GPU: the share of RAM; default 0.2 there)."
    )
    kvcache_gib: str | None = option(
        None, help="VLLM_CPU_KVCACHE_SPACE in GiB for vLLM's CPU backend (default 2, or the environment's)."
    )
    python: str | None = option(None, help="Interpreter with vLLM (default: .venv-vllm if present).")
    vllm_arg: list[str] = option(
        default_factory=list,
        flags=("--vllm-arg",),
        help="Extra vLLM flag (repeatable, wins over polar's), e.g. --vllm-arg=--enforce-eager.",
    )
    state_dir: Path | None = option(None, help=STATE_DIR_HELP)
    timeout: float = option(600.0, help="Seconds to wait until it answers.")
    push: str = option(
        "restart",
        help="How `polar engine reload` gives it new weights: restart (a new server), in-place (vLLM's "
        "reload_weights; turns on vLLM's development endpoints on 127.0.0.1, which anything that reaches that "
        "port can call: keep agents in a proxy-only sandbox) or adapter (MODEL stays loaded and each reload "
        "swaps in the checkpoint's LoRA adapter, saved by `polar train --lora-r`, served as NAME-adapter: "
        "the spec the reload prints says so; the same endpoints plus vLLM's runtime LoRA loading).",
    )
    lora_rank: int = option(
        0, help="--push adapter: the LoRA rank of the adapters it will load (polar train --lora-r)."
    )


@dataclass
class EngineReloadSettings:
    """`polar engine reload`'s command line."""

    checkpoint: Path = option(argument=True, help="Checkpoint directory written by `polar train`.")
    engine: str = option(flags=("--engine", "-e"), help="sglang:URL, vllm:URL (started by `polar engine serve`).")
    weight_version: str | None = option(None, help="Policy version tag later captures will carry.")
    state_dir: Path | None = reuse(EngineServeSettings, "state_dir")
    timeout: float = reuse(EngineServeSettings, "timeout", help="Seconds to wait for the engine.")


@dataclass
class EngineStopSettings:
    """`polar engine stop`'s command line."""

    engine: str = reuse(EngineReloadSettings, "engine", help="vllm:URL of an engine started by `polar engine serve`.")
    state_dir: Path | None = reuse(EngineServeSettings, "state_dir")


@engine_app.command("serve")
@command
def engine_serve(settings: EngineServeSettings) -> None:
    """Start vLLM in the background (tool-call parser, processed logprobs, no generation_config defaults) so
    that `polar engine reload` can restart it with new weights; `polar engine stop` ends it."""
    from polar_cli.serving import EngineError, serve_vllm

    s = settings
    try:
        with _waiting(f"starting vLLM with {s.model} on port {s.port}") as progress:
            server = serve_vllm(
                s.model, port=s.port, served_model_name=s.served_model_name, state_dir=_state_dir(s.state_dir),
                python=s.python, dtype=s.dtype, max_model_len=s.max_model_len, extra_args=s.vllm_arg,
                ready_timeout_s=s.timeout, tool_call_parser=s.tool_call_parser, memory_fraction=s.memory_fraction,
                kvcache_gib=s.kvcache_gib, progress=progress, push=s.push, lora_rank=s.lora_rank,
            )  # fmt: skip
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"serving {server.served_model_name!r} (pid {server.pid}, log {server.log})")
    typer.echo(server.spec)


@engine_app.command("reload")
@command
def engine_reload(settings: EngineReloadSettings) -> None:
    """Point a running engine at new weights: SGLang loads them in place; vLLM too when served with --push in-place
    (else, or when that fails, it is restarted); one served with --push adapter loads the checkpoint's LoRA adapter
    (the line printed names the spec that samples it)."""
    from polar_addon.canonical import PolarError
    from polar_cli.serving import EngineError, reload_engine

    s = settings
    try:
        with _waiting(f"loading {s.checkpoint} into {s.engine}") as progress:
            line = reload_engine(
                s.engine, s.checkpoint, state_dir=_state_dir(s.state_dir), weight_version=s.weight_version,
                timeout_s=s.timeout, progress=progress,
            )  # fmt: skip
    except (EngineError, PolarError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(line)


@engine_app.command("stop")
@command
def engine_stop(settings: EngineStopSettings) -> None:
    """Stop an engine started by `polar engine serve`."""
    from polar_addon.engines.spec import EngineSpec
    from polar_cli.serving import EngineError, stop_engine

    try:
        spec = EngineSpec.parse(settings.engine)
        kind = spec.kind
        server, running = stop_engine(spec.target, state_dir=_state_dir(settings.state_dir))
    except (ValueError, EngineError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if running:
        typer.echo(f"stopped {kind} on port {server.port} (pid {server.pid})")
    else:
        typer.echo(f"{kind} on port {server.port} had already exited (pid {server.pid}); forgot it")
