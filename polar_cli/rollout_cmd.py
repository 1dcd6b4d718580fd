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

from polar_cli.rollout.config import RolloutSettings, make_run_id
from polar_cli.rollout.redact import control_tokens, write_json
from polar_cli.rollout.tasks import TaskFileError
from polar_cli.settings import command
from polar_cli.settings import manifest as settings_manifest

EXIT_ALL_FAILED = 1


@command
def rollout(settings: RolloutSettings) -> None:
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
    from polar_cli.rollout.progress_file import progress_file
    from polar_cli.rollout.proxy import ExternalProxy
    from polar_cli.rollout.runner import RolloutProgress, run_rollout
    from polar_cli.rollout.tasks import load_tasks, task_set_hash

    s = settings
    s.validate()
    s.runtime = choose_runtime(s.runtime, s.trust_agent)
    try:
        task_list = load_tasks(s.tasks, limit=s.tasks_limit)
    except (TaskFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    from polar_cli.rollout.harnesses import get_preset

    try:
        preset = get_preset(s.harness)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--harness") from exc
    external = None
    if s.proxy is not None:
        from polar_cli.rollout.proxy import ControlError, check_sessions_mode, proxy_sessions_mode

        external = ExternalProxy(
            s.proxy,
            s.control_token or "",
            s.reverse_url,
            s.confdir / "mitmproxy-ca-cert.pem",
            trust_claimed=s.trust_claimed_sessions,
        )
        try:
            ends = external.endpoints()
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy") from exc
        from polar_cli.rollout.proxy_check import ProxyNotABoundary, check_blocks_other

        try:
            # Before any session: a proxy that relays other traffic is no boundary for a proxy-only sandbox.
            check_blocks_other(s.proxy, ends.forward_port, ends.reverse_port)
        except ProxyNotABoundary as exc:
            typer.echo(f"error: --proxy: {exc}", err=True)
            raise typer.Exit(2) from exc
        try:
            warning = check_sessions_mode(proxy_sessions_mode(external), s.trust_claimed_sessions)
        except ControlError as exc:
            typer.echo(f"error: --proxy {s.proxy}: {exc}", err=True)
            raise typer.Exit(2) from exc
        if warning:
            typer.echo(warning, err=True)

    run_id = make_run_id(s.seed)
    report = s.report_dir or _default_report_dir(s.out, run_id)
    report.mkdir(parents=True, exist_ok=True)
    progress = RolloutProgress()
    config = s.to_config(task_list, preset, external, logs_dir=report / "logs", run_id=run_id, progress=progress)
    # Every setting (the control token redacted; write_json also redacts it out of the command line), and what the
    # run resolved: only whether a token was given, the task set's identity, the harness's version.
    manifest = {
        **settings_manifest(s), "command": sys.argv, "control_token_given": bool(s.control_token), "run_id": run_id,
        "task_count": len(task_list), "task_set_hash": task_set_hash(task_list),
        "harness_version": _harness_version(preset), "store": s.out, "versions": _versions(), "started_at": time.time(),
    }  # fmt: skip
    write_json(report / "rollout-manifest.json", manifest, [s.control_token])
    try:
        if s.ray is not None:
            from polar_cli.rollout.ray_backend import RayOptions, run_rollout_ray

            job = run_rollout_ray(config, RayOptions(s.ray, s.ray_resource))
        else:
            job = run_rollout(config)
        with progress_file(report, progress, lambda: control_tokens(s.out, s.confdir, s.control_token)):
            result = asyncio.run(_run_with_display(job, progress, s.progress))
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
    known = control_tokens(s.out, s.confdir, s.control_token)
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
