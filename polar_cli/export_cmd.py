"""`polar export`: a store's sessions as Harbor ATIF trajectories or OpenAI chat JSONL (the shell over
polar_cli.export)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.settings import SettingsError, command, option
from polar_cli.store_arg import existing_store

FORMAT_HELP = (
    "atif: Harbor's Agent Trajectory Interchange Format, one JSON file per session in OUT (token ids and logprobs "
    "of every sampled turn included); openai-jsonl: one OpenAI chat example {messages, tools} per chain, one per "
    "line of the file OUT (for SFT)."
)


@dataclass
class ExportSettings:
    """`polar export`'s command line."""

    shards: str = option(
        argument=True, help="Trace store: a directory or a pyarrow filesystem URI.", callback=existing_store
    )
    format: str = option(flags=("--format",), help=FORMAT_HELP)
    out: Path = option(
        flags=("--out", "-o"), help="Where to write: a directory (atif) or a .jsonl file (openai-jsonl)."
    )
    session: list[str] = option(default_factory=list, flags=("--session",), help="Only these sessions (repeatable).")
    roles: str = option(
        "agent,auxiliary",
        help="openai-jsonl: the chains to write, by role (agent, auxiliary: a harness's side jobs such as titles and "
        "compaction); e.g. --roles agent for the agent's own turns only. Retried calls are never written; ATIF "
        "trajectories hold every chain and name its role.",
    )
    overwrite: bool = option(False, help="Replace OUT if it exists.")

    def validate(self) -> None:
        from polar_cli.build_cmd import check_roles
        from polar_cli.export import FORMATS

        if self.format not in FORMATS:
            raise SettingsError(f"use one of {', '.join(FORMATS)}", "format")
        check_roles(self.roles)
        exists = self.out.exists() and (self.out.is_file() or any(self.out.iterdir()))
        if exists and not self.overwrite:
            raise SettingsError(f"{self.out} exists and is not empty (use --overwrite)", "out")


@command
def export(settings: ExportSettings) -> None:
    """Export captured sessions for other tools: Harbor ATIF trajectories or OpenAI chat JSONL for SFT."""
    from itertools import groupby

    import orjson

    from polar_addon.store import iter_records
    from polar_cli.build.inputs import session_infos
    from polar_cli.build_cmd import check_roles
    from polar_cli.export import session_examples, session_trajectory
    from polar_cli.export.atif import trajectory_file_name

    settings.validate()
    s = settings
    if s.out.is_dir():
        shutil.rmtree(s.out)
    elif s.out.exists():
        s.out.unlink()
    sessions = session_infos(s.shards)
    records = iter_records(s.shards, session_ids=set(s.session) or None)
    exported = skipped = 0
    if s.format == "atif":
        s.out.mkdir(parents=True)
        for session_id, group in groupby(records, key=lambda r: r.session_id):
            trajectory = session_trajectory(session_id, list(group), sessions.get(session_id))
            if trajectory is None:
                skipped += 1
                continue
            (s.out / trajectory_file_name(session_id)).write_bytes(orjson.dumps(trajectory, option=orjson.OPT_INDENT_2))
            exported += 1
        what = f"{exported} ATIF trajectories"
    else:
        s.out.parent.mkdir(parents=True, exist_ok=True)
        with s.out.open("wb") as f:
            for session_id, group in groupby(records, key=lambda r: r.session_id):
                examples = session_examples(session_id, list(group), roles=check_roles(s.roles))
                skipped += not examples
                for example in examples:
                    f.write(orjson.dumps(example) + b"\n")
                    exported += 1
        what = f"{exported} chat examples"
    note = f" ({skipped} sessions without a usable call left out)" if skipped else ""
    typer.echo(f"{what} written to {s.out}{note}")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
