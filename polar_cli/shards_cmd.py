"""`polar shards inspect|validate` and `polar reward`: the store-facing commands over polar_addon.store."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.settings import SettingsError, command, option, reuse
from polar_cli.store_arg import existing_store

shards_app = typer.Typer(
    help="Look into and check a trace store (a directory or a pyarrow URI such as s3://...).", no_args_is_help=True
)

STORE_HELP = "The trace store: the proxy's polar_out (a directory or a URI such as s3://bucket/prefix)."


@dataclass
class ShardsInspectSettings:
    """`polar shards inspect`'s command line."""

    store: str = option(argument=True, help=STORE_HELP, callback=existing_store)
    limit: int = option(20, help="Sessions to list (0: none, -1: all).")


@dataclass
class ShardsValidateSettings:
    """`polar shards validate`'s command line."""

    store: str = reuse(ShardsInspectSettings, "store")


@dataclass
class RewardSettings:
    """`polar reward`'s command line: one reward with --session/--value, or many with --file."""

    store: str = reuse(ShardsInspectSettings, "store", callback=None)  # a write: the store may hold nothing yet
    session: str | None = option(None, flags=("--session",), help="Session id to reward.")
    value: float | None = option(None, flags=("--value",), help="The reward value.")
    status: str | None = option(
        None,
        flags=("--status",),
        help="Also record how the session(s) ended: completed, timeout, agent_error (the policy's failures train "
        "with reward 0) or error (infrastructure: never trained on). "
        "Without it a reward marks a running session completed.",
    )
    name: str = option("reward", flags=("--name",), help="Reward name (several named rewards may coexist).")
    file: Path | None = option(None, flags=("--file",), help='JSONL lines {"session_id", "value", "name"?}.')
    source: str = option("cli", help="Recorded as the reward's source.")
    allow_unknown: bool = option(False, flags=("--allow-unknown",), help="Accept session ids the store has not seen.")
    journal_dir: Path | None = option(None, help="Journal directory (default: the store's).")

    def validate(self) -> None:
        from polar_addon.store.trace_store import SESSION_STATUSES

        if self.file is not None and (self.session is not None or self.value is not None):
            raise SettingsError("give either --file or --session with --value")
        if self.file is None and (self.session is None or (self.value is None and self.status is None)):
            raise SettingsError("give --session with --value and/or --status (or --file)")
        outcomes = [s for s in SESSION_STATUSES if s != "running"]
        if self.status is not None and self.status not in outcomes:
            raise SettingsError(f"use one of {', '.join(outcomes)}", "status")


@shards_app.command("inspect")
@command
def inspect(settings: ShardsInspectSettings) -> None:
    """Sessions, calls, tokens, harnesses, rewards and failures in a store."""
    from rich.console import Console
    from rich.table import Table

    from polar_addon.store.summary import summarize
    from polar_cli.terminal import markup_safe as safe

    store, limit = settings.store, settings.limit
    s = summarize(store)
    console = Console()
    overview = Table(title=f"polar store {safe(store)}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    overview.add_row("sessions", str(len(s.sessions)))
    overview.add_row("calls ok", str(s.calls_ok))
    overview.add_row("calls failed", str(s.calls_failed))
    overview.add_row("prompt tokens", f"{s.prompt_tokens:,}")
    overview.add_row("  stored (prefix references)", f"{s.stored_prompt_tokens:,}")
    overview.add_row("response tokens", f"{s.response_tokens:,}")
    overview.add_row(
        "shards (calls/sessions/rewards)", "/".join(str(s.shards[k]) for k in ("calls", "sessions", "rewards"))
    )
    overview.add_row("shard bytes", f"{s.shard_bytes:,}")
    if s.journal_segments:
        overview.add_row("journal segments (counted above, not in shards yet)", str(s.journal_segments))
    console.print(overview)

    for title, key, unit, counts in (
        ("harnesses", "harness", "calls", s.harnesses),
        ("session status", "status", "sessions", s.statuses),
    ):
        if counts:
            table = Table(title=title)
            table.add_column(key)
            table.add_column(unit, justify="right")
            for name, n in counts.most_common():
                table.add_row(safe(name), str(n))
            console.print(table)
    if s.rewards:
        table = Table(title="rewards (latest per session)")
        for col in ("name", "sessions", "mean", "min", "max"):
            table.add_column(col, justify="left" if col == "name" else "right")
        for r in s.rewards:
            table.add_row(safe(r.name), str(r.sessions), f"{r.mean:.4g}", f"{r.minimum:.4g}", f"{r.maximum:.4g}")
        console.print(table)
    if s.failures:
        table = Table(title="failed calls")
        table.add_column("error")
        table.add_column("calls", justify="right")
        for error, n in s.failures.most_common(15):
            table.add_row(safe(error), str(n))
        console.print(table)
    shown = s.sessions if limit < 0 else s.sessions[:limit]
    if shown:
        table = Table(title=f"sessions ({len(shown)} of {len(s.sessions)})")
        table.add_column("session", overflow="fold")
        table.add_column("task/group/sample", overflow="fold")
        table.add_column("harness", overflow="fold")
        table.add_column("status", no_wrap=True)
        table.add_column("ok/failed", justify="right", no_wrap=True)
        table.add_column("tokens", justify="right", no_wrap=True)
        table.add_column("reward", justify="right", no_wrap=True)
        for x in shown:
            sample = "-" if x.sample_index is None else str(x.sample_index)
            table.add_row(
                safe(x.session_id),
                safe(f"{x.task_id or '-'}/{x.group_id or '-'}/{sample}"),
                safe(x.harness or "-"),
                safe(x.status or "-"),
                f"{x.calls - x.failed_calls}/{x.failed_calls}",
                f"{x.prompt_tokens + x.response_tokens:,}",
                "-" if x.reward is None else f"{x.reward:.4g}",
            )
        console.print(table)


@shards_app.command("validate")
@command
def validate(settings: ShardsValidateSettings) -> None:
    """Check schemas, one logprob per response token, contiguous seq per session, unique record ids,
    resolvable prefix references, token-free failed calls; exit 1 listing every violation."""
    from polar_addon.store.summary import summarize
    from polar_addon.store.validate import validate_store
    from polar_cli.terminal import printable

    store = settings.store
    problems = validate_store(store)
    if problems:
        typer.echo(f"{len(problems)} violation(s) in {printable(store)}:", err=True)
        for problem in problems:
            typer.echo(f"  - {printable(problem)}", err=True)
        raise typer.Exit(1)
    s = summarize(store)
    typer.echo(f"valid: {s.calls_ok + s.calls_failed} calls ({s.calls_failed} failed) in {len(s.sessions)} sessions")


@command
def reward(settings: RewardSettings) -> None:
    """Record rewards for sessions: one with --session/--value, or many with --file; --status sets how they ended.

    A reward is an outcome: a session still "running" counts as completed once it has one.
    """
    from polar_addon.store import TraceStore, read_sessions
    from polar_addon.store.rewards import RewardInput, check_reward, parse_rewards_jsonl
    from polar_addon.store.shards import Output
    from polar_addon.store.summary import journal_session_ids
    from polar_addon.store.trace_store import default_journal_dir
    from polar_cli.terminal import printable

    settings.validate()
    store, session, value, status, file = (
        settings.store,
        settings.session,
        settings.value,
        settings.status,
        settings.file,
    )
    try:
        if file is not None:
            rewards = parse_rewards_jsonl(file)
        else:
            rewards = []
            if value is not None:
                checked_value, checked_name = check_reward(value, settings.name)
                rewards = [RewardInput(session, checked_value, checked_name)]  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {printable(exc)}", err=True)
        raise typer.Exit(2) from exc
    targets = sorted({r.session_id for r in rewards} | ({session} if session else set()))
    journal_dir = settings.journal_dir
    journal_root = str(journal_dir) if journal_dir else default_journal_dir(Output.from_uri(store))
    if not settings.allow_unknown:
        known = {s.session_id for s in read_sessions(store)} | journal_session_ids(journal_root)
        unknown = sorted(set(targets) - known)
        if unknown:
            typer.echo(
                f"error: unknown session(s) in {printable(store)}: {printable(', '.join(unknown[:10]))}"
                f"{' ...' if len(unknown) > 10 else ''} (--allow-unknown to record anyway)",
                err=True,
            )
            raise typer.Exit(2)

    async def record() -> None:
        async with TraceStore(store, journal_dir=journal_root) as trace_store:
            await asyncio.gather(
                *(trace_store.add_reward(r.session_id, r.value, r.name, settings.source) for r in rewards)
            )
            if status is not None:
                ended = time.time()
                await asyncio.gather(*(trace_store.session_update(s, status=status, ended_at=ended) for s in targets))

    asyncio.run(record())
    typer.echo(f"recorded {len(rewards)} reward(s) in {store}")
    if status is not None:
        typer.echo(f"marked {len(targets)} session(s) {status}")
