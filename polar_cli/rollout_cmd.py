"""`polar rollout`: a thin Typer shell over :func:`polar_cli.rollout.runner.run_rollout` (options -> RolloutConfig,
a live rich display, the summary and manifest files, the exit code)."""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import typer

from polar_cli.rollout.redact import control_tokens, write_json
from polar_cli.rollout.tasks import TaskFileError
from polar_cli.set_option import parse_set_options

EXIT_ALL_FAILED = 1


def rollout(
    tasks: Path = typer.Argument(
        ...,
        help="The task set: a JSONL file (or a directory of *.jsonl), a Harbor task "
        "directory (task.toml, instruction.md, tests/test.sh), or a directory of them.",
    ),
    harness: str = typer.Option(
        ...,
        "--harness",
        "-H",
        help="claude-code, codex, qwen-code, pi, gemini-cli, or "
        "cmd:'ANY COMMAND {instruction}' ({instruction} becomes one shell-quoted word).",
    ),
    samples: int = typer.Option(1, "--samples", "-n", help="Sessions per task (one GRPO group per task)."),
    out: str | None = typer.Option(
        None,
        "--out",
        "-o",
        help="The trace store the started proxy writes (a "
        "directory or s3://...). With --proxy: the running proxy's store, for the report.",
    ),
    engine: str | None = typer.Option(
        None,
        "--engine",
        "-e",
        help="Start a proxy with this engine: vllm:URL, sglang:URL, local:MODEL_DIR, scripted:SCRIPT.json.",
    ),
    proxy: str | None = typer.Option(
        None,
        "--proxy",
        help="Use a running `polar proxy` instead: its forward URL "
        "http://127.0.0.1:PORT (needs its control token). Probed first: a proxy that "
        "relays non-model traffic (to a loopback listener, by absolute URL, CONNECT "
        "or a reverse Host: header) is refused before any session.",
    ),
    reverse_url: str | None = typer.Option(None, help="With --proxy: its reverse listener (default: PORT + 1)."),
    control_token: str | None = typer.Option(
        None,
        envvar="POLAR_CONTROL_TOKEN",
        show_envvar=True,
        help="With --proxy: the proxy's control token (to register sessions and post rewards).",
    ),
    trust_claimed_sessions: bool = typer.Option(
        False,
        "--trust-claimed-sessions",
        help="With --proxy: use it even if it runs polar_sessions="
        "claimed (the default of `polar proxy`), where an agent can write "
        "calls into another session and relabel task, group and sample; "
        "only for trusted agents. Without it such a proxy is refused: start "
        "it with --set polar_sessions=registered.",
    ),
    runtime: str | None = typer.Option(
        None,
        help="Where sessions run: bwrap (bubblewrap, the default where it "
        "works here; network proxy-only), oci (podman/docker, for tasks with an "
        "image), local (a subprocess with its own HOME and workspace copy; NO "
        "isolation: needs --trust-agent). Where bwrap does not work the command "
        "says why and asks for an explicit choice.",
    ),
    trust_agent: bool = typer.Option(
        False,
        "--trust-agent",
        help="Allow --runtime local: the agent then runs as you, unsandboxed, "
        "and can read the proxy's control token and the store (and so set its own "
        "reward) and reach any address. Only for agents you trust.",
    ),
    network: str | None = typer.Option(
        None,
        help="host, or proxy-only (the agent reaches the model API and "
        "nothing else; bwrap/oci). Default: the runtime's (local: host).",
    ),
    concurrency: int = typer.Option(4, "--concurrency", "-c", help="Harness runs at once (RUN slots)."),
    ready: int | None = typer.Option(
        None,
        help="Sessions prepared ahead (started sandbox, setup done, harness "
        "configured) so a free RUN slot starts at once. Default: --concurrency; 0: off.",
    ),
    timeout: float | None = typer.Option(
        None,
        help="Seconds per harness run (default: each task's agent "
        "timeout). A timed-out session keeps its traces, status timeout.",
    ),
    early_stop: int | None = typer.Option(
        None,
        help="Once M sessions of a group are usable (completed, failed "
        "or timeout), cancel its stragglers (masked); with --ray, on every "
        "node.",
    ),
    tasks_limit: int | None = typer.Option(None, help="Only the first K tasks."),
    seed: int | None = typer.Option(None, help="Fixes session ids and task order (same seed, same ids)."),
    model: str = typer.Option("policy", help="The model name harnesses ask for."),
    context_window: int | None = typer.Option(
        None,
        min=1,
        help="The context window each harness is told (its "
        "compaction and token budgets). Default: what --engine serves (local: "
        "the model's max_position_embeddings, or ?max_len=N; vllm/sglang: "
        "max_model_len on /v1/models); with --proxy: the harness's own.",
    ),
    max_output_tokens: int | None = typer.Option(
        None,
        min=1,
        help="The output cap each harness is told. Default: "
        "--set polar_max_tokens=N when given, else the harness's own.",
    ),
    confdir: Path = typer.Option(Path("~/.mitmproxy"), help="mitmproxy's configuration directory (its CA)."),
    option: list[str] = typer.Option(
        [],
        "--set",
        help="Extra mitmdump option KEY=VALUE for the started proxy (repeatable), e.g. --set polar_max_tokens=512.",
    ),
    report_dir: Path | None = typer.Option(
        None,
        help="Where rollout-summary.json, rollout-manifest.json and "
        "per-session logs go (default: STORE/rollouts/RUN_ID for a local store; "
        "./polar-rollouts/RUN_ID otherwise).",
    ),
    work_dir: Path | None = typer.Option(
        None, help="Scratch for session workspaces and homes (default: a temporary directory)."
    ),
    keep_sessions: bool = typer.Option(False, help="Keep each session's workspace and home (debugging)."),
    init_attempts: int = typer.Option(3, help="Tries of a session's INIT (sandbox, workspace, setup)."),
    max_patch_mb: int = typer.Option(
        64,
        min=1,
        help="Largest agent patch (and workspace growth) in MiB; past it the "
        "session is failed, reward 0, and the runner never reads the patch.",
    ),
    read_only: list[Path] = typer.Option(
        [],
        "--read-only",
        help="A host path the sandboxes see read-only at the "
        "same path (repeatable), e.g. a virtualenv a cmd: agent runs from.",
    ),
    display: bool = typer.Option(True, "--progress/--no-progress", help="Live progress display."),
    ray_address: str | None = typer.Option(
        None,
        "--ray",
        help="Run the sessions on a Ray cluster (its address, "
        "e.g. 127.0.0.1:6379, or auto): one worker per node, each with its own "
        "proxy writing to --out, which every node must see (a shared directory "
        "or s3://...). --concurrency and --ready are then per node. Needs "
        "Ray (the pip extra fleet). Refused with --proxy (every node starts "
        "its own proxy: give --engine). --early-stop counts a group's usable "
        "sessions over every node and cancels its stragglers on all of them. With s3://, each node writes "
        "with its own credentials (the environment `ray start` ran with, "
        "~/.aws, an instance role): the driver's AWS_* are not shipped. "
        "Ctrl-C stops the run on every node.",
    ),
    ray_resource: str | None = typer.Option(
        None,
        help="With --ray: only the nodes offering this custom resource "
        "(ray start --resources); default: every node with a CPU.",
    ),
) -> None:
    """Run a harness over a task set: SAMPLES sessions per task, each in its own sandbox, verified in a fresh one,
    rewarded by the verifier only, grouped by task; every model call is captured into the store.

    Stages: INIT (sandbox, workspace, setup, harness config; retried)
    -> READY (up to --ready prepared sessions)
    -> RUN (--concurrency slots, one --timeout)
    -> POSTRUN (the agent's git diff verified in a fresh sandbox; reward and status posted).

    Sessions run in bwrap (network proxy-only) unless --runtime says otherwise; --runtime local needs --trust-agent.
    The proxy's control token never enters a sandbox. A harness that exits non-zero, is killed from inside or
    produces nothing is failed (reward 0, trained as agent_error); only infrastructure is error (masked); the
    summary gives each group's mask rate. Exit status 1 when no session was usable, 2 on bad input.
    Ctrl-C (SIGINT) or SIGTERM: no new session starts, running ones are killed and stored as error (metadata
    cancelled), the summary is written, exit status 130 (143). Killed outright (SIGKILL, OOM killer): its proxy,
    harnesses and containers die with it (a guardian process watching a pipe only this process holds).

    On a Ray cluster (--ray ADDRESS): the same stages on every node, the queue on this machine; a node that dies
    loses only the sessions it held (stored as error, metadata reason worker_lost); the others are run elsewhere.
    """
    from polar_cli.rollout.proxy import ExternalProxy
    from polar_cli.rollout.runner import RolloutConfig, RolloutProgress, run_rollout
    from polar_cli.rollout.tasks import load_tasks, task_set_hash

    if (engine is None) == (proxy is None):
        raise typer.BadParameter("give --engine (start a proxy) or --proxy (use a running one)", param_hint="--engine")
    if engine is not None and not out:
        raise typer.BadParameter("--engine needs --out (the trace store)", param_hint="--out")
    if ray_address is not None and engine is None:
        raise typer.BadParameter("--ray starts a proxy on every node: give --engine (not --proxy)", param_hint="--ray")
    if proxy is not None and not control_token:
        raise typer.BadParameter(
            "--proxy needs the proxy's control token (--control-token or POLAR_CONTROL_TOKEN): "
            "rewards are posted with it",
            param_hint="--control-token",
        )
    if network not in (None, "host", "proxy-only"):
        raise typer.BadParameter("host or proxy-only", param_hint="--network")
    runtime = choose_runtime(runtime, trust_agent)
    options = parse_set_options(option)
    try:
        task_list = load_tasks(tasks, limit=tasks_limit)
    except (TaskFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    from polar_cli.rollout.harnesses import get_preset

    try:
        preset = get_preset(harness)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--harness") from exc
    external = None
    if proxy is not None:
        from polar_cli.rollout.proxy import ControlError, check_sessions_mode, proxy_sessions_mode

        external = ExternalProxy(
            proxy,
            control_token or "",
            reverse_url,
            confdir / "mitmproxy-ca-cert.pem",
            trust_claimed=trust_claimed_sessions,
        )
        try:
            ends = external.endpoints()
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy") from exc
        from polar_cli.rollout.proxy_check import ProxyNotABoundary, check_blocks_other

        try:
            # Before any session: a proxy that relays other traffic is no boundary for a proxy-only sandbox.
            check_blocks_other(proxy, ends.forward_port, ends.reverse_port)
        except ProxyNotABoundary as exc:
            typer.echo(f"error: --proxy: {exc}", err=True)
            raise typer.Exit(2) from exc
        try:
            warning = check_sessions_mode(proxy_sessions_mode(external), trust_claimed_sessions)
        except ControlError as exc:
            typer.echo(f"error: --proxy {proxy}: {exc}", err=True)
            raise typer.Exit(2) from exc
        if warning:
            typer.echo(warning, err=True)

    import secrets

    run_id = f"r{seed}" if seed is not None else f"r{secrets.token_hex(4)}"
    report = report_dir or _default_report_dir(out, run_id)
    report.mkdir(parents=True, exist_ok=True)
    progress = RolloutProgress()
    config = RolloutConfig(
        tasks=task_list, harness=preset, samples=samples, out=out, engine=engine, proxy=external, runtime=runtime,
        network=network, concurrency=concurrency, ready=ready, timeout_s=timeout, early_stop=early_stop, seed=seed,
        model=model, context_window=context_window, max_output_tokens=max_output_tokens, init_attempts=init_attempts,
        max_patch_bytes=max_patch_mb * 1024 * 1024,
        work_dir=work_dir, keep_sessions=keep_sessions, read_only=[p.resolve() for p in read_only],
        logs_dir=report / "logs", confdir=confdir, proxy_options=options, run_id=run_id, progress=progress,
    )  # fmt: skip
    manifest = {
        # Never a secret (write_json redacts the given token out of the command line): only whether one was given.
        "command": sys.argv, "control_token_given": bool(control_token), "run_id": run_id, "seed": seed, "tasks": str(tasks), "task_count": len(task_list),
        "task_set_hash": task_set_hash(task_list), "harness": harness, "harness_version": _harness_version(preset),
        "runtime": runtime, "network": network, "engine": engine, "proxy": proxy, "store": out, "samples": samples,
        "model": model, "context_window": context_window, "max_output_tokens": max_output_tokens,
        "concurrency": concurrency, "ready": ready, "timeout_s": timeout, "early_stop": early_stop,
        "ray": ray_address, "ray_resource": ray_resource,
        "versions": _versions(), "started_at": time.time(),
    }  # fmt: skip
    write_json(report / "rollout-manifest.json", manifest, [control_token])
    try:
        if ray_address is not None:
            from polar_cli.rollout.ray_backend import RayOptions, run_rollout_ray

            job = run_rollout_ray(config, RayOptions(ray_address, ray_resource))
        else:
            job = run_rollout(config)
        result = asyncio.run(_run_with_display(job, progress, display))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except (RuntimeError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    summary = result.summary()
    summary["task_set_hash"] = manifest["task_set_hash"]
    summary_path = report / "rollout-summary.json"
    # The reasons quote the harness's output, which a trusted local agent could fill with the control token.
    known = control_tokens(out, confdir, control_token)
    write_json(summary_path, summary, known)
    manifest.update(ended_at=result.ended_at, interrupted=result.interrupted)
    write_json(report / "rollout-manifest.json", manifest, known)
    counts = ", ".join(f"{n} {s}" for s, n in result.counts().items() if n)
    mean = summary["reward_mean"]
    typer.echo(
        f"polar rollout {run_id}: {len(result.sessions)} sessions ({counts}); reward mean "
        f"{'-' if mean is None else f'{mean:.3f}'}; {summary['sessions_per_minute']:.1f} sessions/min; "
        f"summary {summary_path}"
    )
    if result.interrupted:
        typer.echo(
            f"error: interrupted by {result.interrupted}: the sessions it caught are cancelled (stored as "
            "error with metadata.cancelled)",
            err=True,
        )
        raise typer.Exit(interrupted_exit_code(result.interrupted))
    if result.all_failed:
        typer.echo(
            f"error: no session was usable (see the errors in the summary and the logs in {report / 'logs'})", err=True
        )
        raise typer.Exit(EXIT_ALL_FAILED)


LOCAL_WARNING = (
    "WARNING: --runtime local --trust-agent: the agent runs unsandboxed with your rights; it can read "
    "the proxy's control token and the store (and so set its own reward), read and write your files "
    "and reach any address; polar kills what a session leaves running, nothing else is contained"
)


def choose_runtime(runtime: str | None, trust_agent: bool) -> str:
    """The runtime to use: bwrap when none is named and it works here; ``local`` only with ``--trust-agent`` (and a
    warning on stderr); exit 2 with the reason otherwise."""
    if runtime is None:
        why = bwrap_unusable()
        if why is not None:
            typer.echo(
                f"error: the default runtime, bwrap, does not work here ({why}). Choose one explicitly: "
                "--runtime oci (a container; tasks with an image), or --runtime local --trust-agent (no "
                "isolation: only for agents you trust)",
                err=True,
            )
            raise typer.Exit(2)
        return "bwrap"
    if runtime == "local":
        if not trust_agent:
            typer.echo(
                "error: --runtime local does not isolate the agent: it could read the proxy's control token "
                "and set its own reward. Pass --trust-agent if you trust it, or use --runtime bwrap or oci",
                err=True,
            )
            raise typer.Exit(2)
        typer.echo(LOCAL_WARNING, err=True)
    return runtime


def bwrap_unusable() -> str | None:
    """Why the bwrap runtime cannot start a sandbox on this machine (no binary, no socat, namespaces refused), or
    None when it can."""
    from polar_cli.rollout.runtimes.base import RuntimeUnavailable
    from polar_cli.rollout.runtimes.bwrap import BwrapRuntime

    try:
        asyncio.run(BwrapRuntime()._check())
    except RuntimeUnavailable as exc:
        return str(exc)
    return None


def interrupted_exit_code(signal_name: str) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended (130 for SIGINT)."""
    import signal

    return 128 + int(signal.Signals[signal_name])


def _default_report_dir(out: str | None, run_id: str) -> Path:
    from polar_addon.store.shards import Output

    root = Output.local_root(out) if out else None
    return Path(root) / "rollouts" / run_id if root else Path("polar-rollouts") / run_id


def _harness_version(preset: Any) -> str | None:
    """The preset's own answer, else its CLI's ``--version`` (on PATH or in the repository's .harness)."""
    import shutil
    import subprocess

    from polar_cli.mitm import REPO

    known = preset.version()
    if known or not preset.binaries:
        return known
    binary = shutil.which(preset.binaries[0]) or shutil.which(
        preset.binaries[0], path=str(REPO / ".harness" / "node_modules" / ".bin")
    )
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _versions() -> dict[str, Any]:
    import importlib.metadata as metadata

    versions: dict[str, Any] = {"python": platform.python_version()}
    for package in ("polar", "mitmproxy", "openai"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


async def _run_with_display(job: Any, progress: Any, display: bool) -> Any:
    if not display or not sys.stderr.isatty() or os.environ.get("TERM") == "dumb":
        return await job
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=True)
    with Live(_render(progress), console=console, refresh_per_second=4, transient=False) as live:
        task = asyncio.ensure_future(job)
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            live.update(_render(progress))
        return task.result()


def _render(progress: Any) -> Any:
    from rich.table import Table

    from polar_cli.rollout.runner import MASKED

    stages = progress.stages
    table = Table.grid(padding=(0, 2))
    table.add_row(
        "[bold]stages[/]",
        "  ".join(f"{name} {stages.get(name, 0)}" for name in ("pending", "init", "ready", "run", "postrun", "done")),
    )
    table.add_row("[bold]statuses[/]", "  ".join(f"{k} {v}" for k, v in sorted(progress.statuses.items())) or "-")
    done = sum(progress.statuses.values())
    masked = sum(progress.statuses.get(status, 0) for status in MASKED)
    table.add_row("[bold]masked[/]", f"{masked} of {done} ({masked / done:.0%})" if done else "-")
    table.add_row("[bold]rate[/]", f"{progress.sessions_per_minute():.1f} sessions/min")
    if progress.nodes:
        table.add_row("[bold]nodes[/]", "  ".join(f"{node} {n}" for node, n in sorted(progress.nodes.items())))
    for group, rewards in list(progress.group_rewards.items())[-8:]:
        mean = f"{sum(rewards) / len(rewards):.2f}" if rewards else "-"
        table.add_row(f"  {group[:40]}", f"reward mean {mean} over {len(rewards)}")
    for session, reason in progress.errors:
        table.add_row(f"[red]error[/] {session}", reason[:120])
    return table
