"""`polar build`, `polar stats`, `polar view`: the store-facing shell over polar_cli.build.

Reads shards with polar_addon.store's reader API, turns its session rows into
``build.SessionInfo`` and hands everything to the pure builder.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from polar_cli.build.rewards import TOOL_CALL_REWARD_HELP, check_tool_call_reward
from polar_cli.settings import SettingsError, command, option, reuse
from polar_cli.store_arg import existing_store

if TYPE_CHECKING:
    from polar_cli.build import Decode, SessionInfo

STRATEGY_HELP = "prefix_merging (one trace per chain of prefix-extending calls) or per_request (one per call)."
TOKENIZER_HELP = (
    "Tokenizer directory (e.g. the served model). Lets the build tell a re-tokenized sampled turn (merged) "
    "from a template re-render (a break); default: the records' served model or local engine directory, if "
    "it is a directory here."
)
EOT_HELP = "End-of-turn token id; default: the last token of the first call that stopped by itself."
RETOKENIZED_CHOICES = ("merge", "break")
RETOKENIZED_HELP = (
    "A sampled turn the next prompt re-tokenized (same text, other token ids): break the chain there (the default: "
    "every trace exactly on-policy, each later turn at the very ids it was sampled after, first-step importance "
    "ratios 1) or merge (the paper's rule: longer traces, but OFF-POLICY from that turn on, since the later turns "
    "were sampled after the re-tokenized ids, not after the merged sampled ones). Needs a tokenizer to tell "
    "re-tokenizations apart. With token continuity (polar_tito) a linear session has none to break."
)

ROLES_HELP = (
    "Which calls to train, comma-separated: agent (the main loop and its sub-agents), auxiliary (a harness's side "
    "jobs: titles, classifiers, quota probes, next-speaker checks, memory, compaction), discarded (answers the "
    "harness threw away: retries). Traces of the others are built but not trainable; an auxiliary call inside an "
    "agent chain keeps its context but not its tokens in the loss. `polar stats` counts every role."
)


def check_roles(roles: str, name: str = "roles") -> frozenset[str]:
    from polar_addon.call_roles import parse_roles

    try:
        return parse_roles(roles)
    except ValueError as exc:
        raise SettingsError(str(exc), name) from exc


def load_tokenizer(tokenizer: Path | None, shards: str) -> tuple[Any | None, str]:
    """A Hugging Face tokenizer and a line saying where it came from (or why there is none)."""
    from polar_cli.build.inputs import NoTokenizerThere, find_tokenizer

    try:
        return find_tokenizer(tokenizer, shards)
    except NoTokenizerThere as exc:
        raise typer.BadParameter(str(exc), param_hint="--tokenizer") from exc


def _decode(tok: Any | None) -> Decode | None:
    return None if tok is None else tok.decode


def _sessions(shards: str) -> dict[str, SessionInfo]:
    from polar_cli.build.inputs import session_infos

    return session_infos(shards)


def _tokenizer_eot(tok: Any | None) -> int | None:
    from polar_cli.build.inputs import tokenizer_eot

    return tokenizer_eot(tok)


def _check_strategy(strategy: str) -> None:
    from polar_cli.build import STRATEGIES

    if strategy not in STRATEGIES:
        raise SettingsError(f"use one of {', '.join(STRATEGIES)}", "strategy")


def _check_retokenized(retokenized: str) -> None:
    if retokenized not in RETOKENIZED_CHOICES:
        raise SettingsError(f"use one of {', '.join(RETOKENIZED_CHOICES)}", "retokenized")


@dataclass
class BuildSettings:
    """`polar build`'s command line; `polar stats` and `polar view` reuse its store and builder options."""

    shards: str = option(
        argument=True, help="Trace store: a directory or a pyarrow filesystem URI.", callback=existing_store
    )
    out: Path = option(flags=("--out", "-o"), help="Output directory for the trace dataset (Parquet).")
    strategy: str = option("prefix_merging", help=STRATEGY_HELP)
    tokenizer: Path | None = option(None, help=TOKENIZER_HELP)
    eot_token_id: int | None = option(None, help=EOT_HELP)
    retokenized: str = option("break", help=RETOKENIZED_HELP)
    broadcast_rewards: bool = option(
        False,
        flags=("--broadcast-rewards",),
        help="per_request only: give every call its session's outcome reward (the paper saw reward hacking "
        "from this). Without it per_request traces are not trainable.",
    )
    roles: str = option("agent", help=ROLES_HELP)
    tool_call_reward: float = option(0.0, help=TOOL_CALL_REWARD_HELP)
    session: list[str] = option(default_factory=list, flags=("--session",), help="Only these sessions (repeatable).")
    overwrite: bool = option(False, help="Replace OUT if it exists.")
    rows_per_file: int = option(1024, help="Traces per Parquet file.")

    @property
    def merge_retokenized(self) -> bool:
        """``--retokenized merge|break`` as the builder's ``merge_retokenized``."""
        return self.retokenized == "merge"

    @property
    def trained_roles(self) -> frozenset[str]:
        return check_roles(self.roles)

    def validate(self) -> None:
        _check_strategy(self.strategy)
        _check_retokenized(self.retokenized)
        check_roles(self.roles)
        try:
            check_tool_call_reward(self.tool_call_reward)
        except ValueError as exc:
            raise SettingsError(str(exc), "tool_call_reward") from exc
        if self.out.exists() and any(self.out.iterdir()) and not self.overwrite:
            raise SettingsError(f"{self.out} exists and is not empty (use --overwrite)", "out")


@dataclass
class StatsSettings:
    """`polar stats`'s command line."""

    shards: str = reuse(BuildSettings, "shards")
    strategy: str = reuse(BuildSettings, "strategy", help=STRATEGY_HELP + " Token counts follow it.")
    tokenizer: Path | None = reuse(BuildSettings, "tokenizer")
    eot_token_id: int | None = reuse(BuildSettings, "eot_token_id")
    retokenized: str = reuse(BuildSettings, "retokenized")
    roles: str = reuse(BuildSettings, "roles", help=ROLES_HELP + " Here: which traces count as trainable.")
    as_json: bool = option(False, flags=("--json",), help="Print the stats as JSON instead of a table.")

    @property
    def merge_retokenized(self) -> bool:
        return self.retokenized == "merge"

    def validate(self) -> None:
        _check_strategy(self.strategy)
        _check_retokenized(self.retokenized)
        check_roles(self.roles)


@dataclass
class ViewSettings:
    """`polar view`'s command line."""

    shards: str = reuse(BuildSettings, "shards")
    session: str = option(flags=("--session",), help="The session to show.")
    out: Path = reuse(BuildSettings, "out", default=Path("trace.html"), help="HTML file to write.")
    tokenizer: Path | None = reuse(BuildSettings, "tokenizer", help="Shows token text (else ids). " + TOKENIZER_HELP)
    eot_token_id: int | None = reuse(BuildSettings, "eot_token_id")
    retokenized: str = reuse(BuildSettings, "retokenized")

    @property
    def merge_retokenized(self) -> bool:
        return self.retokenized == "merge"

    def validate(self) -> None:
        _check_retokenized(self.retokenized)


@command
def build(settings: BuildSettings) -> None:
    """Reconstruct training traces from captured calls into a Parquet dataset (TRL / datasets ready)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from polar_addon.store import iter_records
    from polar_cli.build import BuildReport, iter_session_builds
    from polar_cli.build.output import STATS_FILE, TraceWriter
    from polar_cli.build.stats import report_table

    settings.validate()
    s = settings
    console = Console(stderr=True)
    if s.out.exists() and any(s.out.iterdir()):  # validate() refused it without --overwrite
        shutil.rmtree(s.out)
    tok, source = load_tokenizer(s.tokenizer, s.shards)
    console.print(source, markup=False)
    sessions = _sessions(s.shards)
    wanted = set(s.session) or None
    total = len(wanted) if wanted else len(sessions)
    writer = TraceWriter(s.out, rows_per_file=s.rows_per_file)
    report = BuildReport()
    eot: int | None = s.eot_token_id
    started = time.perf_counter()
    with Progress(
        TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("sessions", total=total)
        records = iter_records(s.shards, session_ids=wanted)
        for built in iter_session_builds(
            records,
            sessions,
            s.strategy,
            eot_token_id=s.eot_token_id,
            decode=_decode(tok),
            broadcast_rewards=s.broadcast_rewards,
            fallback_eot_token_id=_tokenizer_eot(tok),
            merge_retokenized=s.merge_retokenized,
            roles=s.trained_roles,
            tool_call_reward=s.tool_call_reward,
        ):
            writer.write(built.traces)
            report.add(built.harness, built.stats)
            eot = built.eot_token_id
            progress.advance(task)
    elapsed = time.perf_counter() - started
    writer.close(
        report,
        {"strategy": s.strategy, "eot_token_id": eot, "tokenizer": source, "shards": s.shards,
         "broadcast_rewards": s.broadcast_rewards, "retokenized": s.retokenized, "roles": sorted(s.trained_roles),
         "seconds": round(elapsed, 3)},
    )  # fmt: skip
    console.print(report_table(report, title=f"polar build ({s.strategy})"))
    if not report.total.traces:
        console.print("[yellow]no traces built: the store holds no usable calls (the dataset is empty)")
    if s.strategy == "per_request" and not s.broadcast_rewards and report.total.traces:
        console.print("[yellow]per_request traces carry no reward without --broadcast-rewards: none is trainable")
    typer.echo(
        f"{report.total.traces} traces ({report.total.traces_trainable} trainable) from "
        f"{report.total.sessions} sessions in {len(writer.files)} files under {s.out} "
        f"({elapsed:.1f} s; stats in {s.out / STATS_FILE})"
    )


@command
def stats(settings: StatsSettings) -> None:
    """How well the captured sessions merge, per harness: chains, merge rate and every break's cause; and the mask
    rate per group (sessions never trained for their status: error or running)."""
    import orjson
    from rich.console import Console

    from polar_addon.store import iter_records
    from polar_cli.build import BuildReport, iter_session_builds
    from polar_cli.build.stats import group_masks, mask_table, masks_to_dict, report_table
    from polar_cli.terminal import markup_safe

    settings.validate()
    s = settings
    console = Console()
    tok, source = load_tokenizer(s.tokenizer, s.shards)
    report = BuildReport()
    sessions = _sessions(s.shards)
    for built in iter_session_builds(
        iter_records(s.shards),
        sessions,
        s.strategy,
        eot_token_id=s.eot_token_id,
        decode=_decode(tok),
        fallback_eot_token_id=_tokenizer_eot(tok),
        merge_retokenized=s.merge_retokenized,
        roles=check_roles(s.roles),
    ):
        report.add(built.harness, built.stats)
    masks = group_masks(sessions.values())
    if s.as_json:
        data = {**report.to_dict(), "masks": masks_to_dict(masks)}
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    Console(stderr=True).print(source, markup=False)
    console.print(report_table(report, title=f"polar stats: {markup_safe(s.shards)}"))
    console.print(mask_table(masks))


@command
def view(settings: ViewSettings) -> None:
    """Write one session's merged traces as a self-contained HTML page (open it in any browser)."""

    settings.validate()
    s = settings
    tok, source = load_tokenizer(s.tokenizer, s.shards)
    page = session_page(s.shards, s.session, tok, eot_token_id=s.eot_token_id, merge_retokenized=s.merge_retokenized)
    if page is None:
        raise SettingsError(f"no calls captured for session {s.session!r}", "session")
    markup, traces, calls = page
    s.out.write_text(markup, encoding="utf-8")
    typer.echo(f"{s.out}: {traces} traces from {calls} calls ({source})")


def session_page(
    shards: str, session: str, tok: Any | None, *, eot_token_id: int | None = None, merge_retokenized: bool = False
) -> tuple[str, int, int] | None:
    """`polar view`'s page of one session (also served by `polar dashboard`): (HTML, traces, calls), or None when
    no call of the session is stored."""
    from polar_addon.store import read_records
    from polar_cli.build import build_session, detect_eot
    from polar_cli.view import render_session

    records = read_records(shards, session_ids=[session])
    if not records:
        return None
    eot = eot_token_id if eot_token_id is not None else detect_eot(records)
    if eot is None:
        eot = _tokenizer_eot(tok)
    info = _sessions(shards).get(session)
    built = build_session(
        session, records, info, eot_token_id=eot, decode=_decode(tok), merge_retokenized=merge_retokenized
    )
    return render_session(built, records, info, tokenizer=tok), len(built.traces), len(records)


def register(app: typer.Typer) -> None:
    app.command("build")(build)
    app.command("stats")(stats)
    app.command("view")(view)
