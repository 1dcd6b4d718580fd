"""The read side against what an agent could put into a store: a bad row is reported and skipped,
and ids, harness names, reward names and errors are printed as text (no rich markup, no escapes)."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from polar_addon.store import TraceStore, read_sessions
from polar_addon.store.shards import REWARDS, SCHEMAS, SESSIONS, Output
from polar_cli.app import app
from polar_cli.terminal import markup_safe, printable
from tests.test_store_basic import Agent, make_record

runner = CliRunner()

EVIL_SESSION = "[/bold]evil\x1b]0;pwned\x07\x1b[2J"
EVIL_HARNESS = "[bold red]agent[/]\x1b[31m/1.0"
# The raw sequences planted above (rich's own progress bar may move the cursor in a test terminal).
PLANTED = ("\x1b]0;pwned", "\x1b[2J", "\x1b[31m", "\x1b[5m", "\x1b]8;;", "\x07")


def no_planted_escape(output: str) -> bool:
    return not any(seq in output for seq in PLANTED)


def _sessions_row(session_id: str, metadata_json: str | None, status: str | None = None) -> dict:
    row = {name: None for name in SCHEMAS[SESSIONS].names}
    row.update(session_id=session_id, updated_at=9e9, metadata_json=metadata_json, status=status)
    return row


@pytest.fixture
def hostile_store(tmp_path: Path) -> Path:
    rng = random.Random(5)

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as st:
            for sid, harness in (("good", "claude-cli/2.1"), (EVIL_SESSION, EVIL_HARNESS)):
                agent = Agent(sid, rng)
                await st.session_update(sid, harness=harness, status="running", started_at=1.0)
                for _ in range(2):
                    await st.append(agent.next_call())
            failed = make_record(EVIL_SESSION, [], [], [], status="failed")
            failed.error = "500 [/red] \x1b]8;;http://x\x07link"
            await st.append(failed)
            await st.add_reward("good", 1.0)

    asyncio.run(main())
    out = Output.from_uri(str(tmp_path))
    # What an older proxy let a status post write, and a reward name it did not check.
    out.write_shard(
        SESSIONS,
        "9000-bad-metadata",
        pa.Table.from_pylist(
            [
                _sessions_row("good", "5", "error"),
                _sessions_row("good", "{not json"),
                _sessions_row(EVIL_SESSION, '{"k": 1}', "completed"),
            ],
            schema=SCHEMAS[SESSIONS],
        ),
    )
    out.write_shard(
        REWARDS,
        "9001-evil-name",
        pa.Table.from_pylist(
            [
                {
                    "reward_id": "r-evil",
                    "session_id": EVIL_SESSION,
                    "name": "[/]\x1b[5mblink",
                    "value": 0.5,
                    "source": "x",
                    "created_at": 3.0,
                }
            ],
            schema=SCHEMAS[REWARDS],
        ),
    )
    return tmp_path


def test_a_bad_metadata_row_is_reported_and_skipped(hostile_store: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="polar"):
        sessions = {s.session_id: s for s in read_sessions(str(hostile_store))}
    assert sessions["good"].status == "completed"  # its reward ended it; the bad row's "error" was not applied
    assert sessions[EVIL_SESSION].metadata == {"k": 1} and sessions[EVIL_SESSION].status == "completed"
    assert sum("skipped a sessions row" in r.message for r in caplog.records) == 2
    validate = runner.invoke(app, ["shards", "validate", str(hostile_store)])
    assert validate.exit_code == 1
    assert "metadata_json is a int, not a JSON object" in validate.output
    assert "metadata_json is not valid JSON" in validate.output
    assert no_planted_escape(validate.output)


def test_inspect_build_and_stats_print_store_text_as_text(hostile_store: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["shards", "inspect", str(hostile_store), "--limit", "-1"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output  # inspect prints no escape at all
    for shown in (
        "[/bold]evil\\x1b]0;pwned\\x07",
        "[bold red]agent[/]\\x1b[31m/1.0",
        "[/]\\x1b[5mblink",
        "500 [/red] \\x1b]8;;http://x\\x07link",
    ):
        assert shown in result.output, (shown, result.output)
    build = runner.invoke(app, ["build", str(hostile_store), "-o", str(tmp_path / "traces")])
    assert build.exit_code == 0, build.output
    assert no_planted_escape(build.output) and "[bold" in build.output
    stats = runner.invoke(app, ["stats", str(hostile_store)], env={"COLUMNS": "400"})
    assert stats.exit_code == 0 and no_planted_escape(stats.output) and "[bold" in stats.output


def test_printable_and_markup_safe() -> None:
    assert printable("a\x1b[31mb\x9b\u202ec\n") == "a\\x1b[31mb\\x9b\\u202ec\\n"
    assert markup_safe("[/bold]") == "\\[/bold]"
    from rich.text import Text

    assert Text.from_markup(markup_safe("[bold]x[/bold]\x1b")).plain == "[bold]x[/bold]\\x1b"
