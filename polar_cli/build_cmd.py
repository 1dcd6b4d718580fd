"""`polar build`, `polar stats`, `polar view`: the store-facing shell over polar_cli.build.

Reads shards with polar_addon.store's reader API, turns its session rows into
``build.SessionInfo`` and hands everything to the pure builder.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

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
    "A sampled turn the next prompt re-tokenized (same text, other token ids): merge (the paper's rule, longer "
    "traces) or break the chain there. The later turns were sampled after the re-tokenized ids, so merged traces "
    "are slightly off-policy from that point (first-step importance ratios not 1); break keeps every trace "
    "exactly on-policy at the cost of more, shorter traces. Needs a tokenizer to tell re-tokenizations apart."
)


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
        raise typer.BadParameter(f"use one of {', '.join(STRATEGIES)}", param_hint="--strategy")


def merge_retokenized(retokenized: str) -> bool:
    """``--retokenized merge|break`` as the builder's ``merge_retokenized``."""
    if retokenized not in RETOKENIZED_CHOICES:
        raise typer.BadParameter(f"use one of {', '.join(RETOKENIZED_CHOICES)}", param_hint="--retokenized")
    return retokenized == "merge"


def build(
    shards: str = typer.Argument(
        ..., help="Trace store: a directory or a pyarrow filesystem URI.", callback=existing_store
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for the trace dataset (Parquet)."),
    strategy: str = typer.Option("prefix_merging", help=STRATEGY_HELP),
    tokenizer: Path | None = typer.Option(None, help=TOKENIZER_HELP),
    eot_token_id: int | None = typer.Option(None, help=EOT_HELP),
    retokenized: str = typer.Option("merge", help=RETOKENIZED_HELP),
    broadcast_rewards: bool = typer.Option(
        False,
        "--broadcast-rewards",
        help="per_request only: give every call its session's outcome reward (the paper saw reward hacking "
        "from this). Without it per_request traces are not trainable.",
    ),
    session: list[str] = typer.Option([], "--session", help="Only these sessions (repeatable)."),
    overwrite: bool = typer.Option(False, help="Replace OUT if it exists."),
    rows_per_file: int = typer.Option(1024, help="Traces per Parquet file."),
) -> None:
    """Reconstruct training traces from captured calls into a Parquet dataset (TRL / datasets ready)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from polar_addon.store import iter_records
    from polar_cli.build import BuildReport, iter_session_builds
    from polar_cli.build.output import STATS_FILE, TraceWriter
    from polar_cli.build.stats import report_table

    _check_strategy(strategy)
    merge = merge_retokenized(retokenized)
    console = Console(stderr=True)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise typer.BadParameter(f"{out} exists and is not empty (use --overwrite)", param_hint="--out")
        shutil.rmtree(out)
    tok, source = load_tokenizer(tokenizer, shards)
    console.print(source, markup=False)
    sessions = _sessions(shards)
    wanted = set(session) or None
    total = len(wanted) if wanted else len(sessions)
    writer = TraceWriter(out, rows_per_file=rows_per_file)
    report = BuildReport()
    eot: int | None = eot_token_id
    started = time.perf_counter()
    with Progress(
        TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("sessions", total=total)
        records = iter_records(shards, session_ids=wanted)
        for built in iter_session_builds(
            records,
            sessions,
            strategy,
            eot_token_id=eot_token_id,
            decode=_decode(tok),
            broadcast_rewards=broadcast_rewards,
            fallback_eot_token_id=_tokenizer_eot(tok),
            merge_retokenized=merge,
        ):
            writer.write(built.traces)
            report.add(built.harness, built.stats)
            eot = built.eot_token_id
            progress.advance(task)
    elapsed = time.perf_counter() - started
    writer.close(
        report,
        {"strategy": strategy, "eot_token_id": eot, "tokenizer": source, "shards": shards,
         "broadcast_rewards": broadcast_rewards, "retokenized": retokenized, "seconds": round(elapsed, 3)},
    )  # fmt: skip
    console.print(report_table(report, title=f"polar build ({strategy})"))
    if not report.total.traces:
        console.print("[yellow]no traces built: the store holds no usable calls (the dataset is empty)")
    if strategy == "per_request" and not broadcast_rewards and report.total.traces:
        console.print("[yellow]per_request traces carry no reward without --broadcast-rewards: none is trainable")
    typer.echo(
        f"{report.total.traces} traces ({report.total.traces_trainable} trainable) from "
        f"{report.total.sessions} sessions in {len(writer.files)} files under {out} "
        f"({elapsed:.1f} s; stats in {out / STATS_FILE})"
    )


def stats(
    shards: str = typer.Argument(
        ..., help="Trace store: a directory or a pyarrow filesystem URI.", callback=existing_store
    ),
    strategy: str = typer.Option("prefix_merging", help=STRATEGY_HELP + " Token counts follow it."),
    tokenizer: Path | None = typer.Option(None, help=TOKENIZER_HELP),
    eot_token_id: int | None = typer.Option(None, help=EOT_HELP),
    retokenized: str = typer.Option("merge", help=RETOKENIZED_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the stats as JSON instead of a table."),
) -> None:
    """How well the captured sessions merge, per harness: chains, merge rate and every break's cause; and the mask
    rate per group (sessions never trained for their status: error or running)."""
    import orjson
    from rich.console import Console

    from polar_addon.store import iter_records
    from polar_cli.build import BuildReport, iter_session_builds
    from polar_cli.build.stats import group_masks, mask_table, masks_to_dict, report_table
    from polar_cli.terminal import markup_safe

    _check_strategy(strategy)
    merge = merge_retokenized(retokenized)
    console = Console()
    tok, source = load_tokenizer(tokenizer, shards)
    report = BuildReport()
    sessions = _sessions(shards)
    for built in iter_session_builds(
        iter_records(shards),
        sessions,
        strategy,
        eot_token_id=eot_token_id,
        decode=_decode(tok),
        fallback_eot_token_id=_tokenizer_eot(tok),
        merge_retokenized=merge,
    ):
        report.add(built.harness, built.stats)
    masks = group_masks(sessions.values())
    if as_json:
        data = {**report.to_dict(), "masks": masks_to_dict(masks)}
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    Console(stderr=True).print(source, markup=False)
    console.print(report_table(report, title=f"polar stats: {markup_safe(shards)}"))
    console.print(mask_table(masks))


def view(
    shards: str = typer.Argument(
        ..., help="Trace store: a directory or a pyarrow filesystem URI.", callback=existing_store
    ),
    session: str = typer.Option(..., "--session", help="The session to show."),
    out: Path = typer.Option(Path("trace.html"), "--out", "-o", help="HTML file to write."),
    tokenizer: Path | None = typer.Option(None, help="Shows token text (else ids). " + TOKENIZER_HELP),
    eot_token_id: int | None = typer.Option(None, help=EOT_HELP),
    retokenized: str = typer.Option("merge", help=RETOKENIZED_HELP),
) -> None:
    """Write one session's merged traces as a self-contained HTML page (open it in any browser)."""
    from polar_addon.store import read_records
    from polar_cli.build import build_session, detect_eot
    from polar_cli.view import render_session

    merge = merge_retokenized(retokenized)
    records = read_records(shards, session_ids=[session])
    if not records:
        raise typer.BadParameter(f"no calls captured for session {session!r}", param_hint="--session")
    tok, source = load_tokenizer(tokenizer, shards)
    eot = eot_token_id if eot_token_id is not None else detect_eot(records)
    if eot is None:
        eot = _tokenizer_eot(tok)
    info = _sessions(shards).get(session)
    built = build_session(session, records, info, eot_token_id=eot, decode=_decode(tok), merge_retokenized=merge)
    out.write_text(render_session(built, records, info, tokenizer=tok), encoding="utf-8")
    typer.echo(f"{out}: {len(built.traces)} traces from {len(records)} calls ({source})")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
    app.command("stats")(stats)
    app.command("view")(view)
