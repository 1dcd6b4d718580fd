"""What a build reads besides records (inputs.py) and the reconstruction stats it reports (stats.py).

The stats are what an operator reads to judge a build (merge rate, breaks, masked sessions), so every figure is
checked for its exact value, summed across sessions and harnesses, and as the table shows it.
"""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from polar_addon.capture import CaptureRecord
from polar_addon.store import SessionRecord, TraceStore
from polar_cli.build.inputs import (
    NO_TOKENIZER,
    NoTokenizerThere,
    _tokenizer_candidates,
    find_tokenizer,
    session_info,
    session_infos,
    tokenizer_eot,
)
from polar_cli.build.rewards import SessionInfo
from polar_cli.build.stats import (
    NO_GROUP,
    BuildReport,
    BuildStats,
    GroupMask,
    group_masks,
    harness_name,
    mask_table,
    masks_to_dict,
    report_table,
    role_counts,
    side_jobs,
    top_reasons,
)

# ---- inputs -------------------------------------------------------------------------------------------------------


def test_session_info_takes_every_field_and_an_unreported_status_is_completed() -> None:
    row = SessionRecord(
        "s1", task_id="t", group_id="g", sample_index=0, harness="codex", status="timeout", rewards={"reward": 0.25}
    )
    assert session_info(row) == SessionInfo("s1", "t", "g", 0, "codex", "timeout", 0.25)
    assert session_info(SessionRecord("s2")) == SessionInfo("s2", None, None, None, None, "completed", None)


def call(session_id: str, seq: int, *, status: str = "ok", served_model: str | None = None, engine: str | None = None):
    return CaptureRecord(
        record_id=f"{session_id}-{seq}",
        session_id=session_id,
        seq=seq,
        api="openai_chat",
        status=status,
        served_model=served_model,
        engine=engine,
        prompt_ids=[1, 2] if status == "ok" else [],
        response_ids=[3] if status == "ok" else [],
        logprobs=[-0.5] if status == "ok" else [],
    )


def write_store(root: Path, records: list[CaptureRecord], sessions: dict[str, dict[str, Any]] | None = None) -> str:
    async def main() -> None:
        async with TraceStore(str(root)) as store:
            for record in records:
                await store.append(record)
            for session_id, fields in (sessions or {}).items():
                reward = fields.pop("reward", None)
                await store.session_update(session_id, **fields)
                if reward is not None:
                    await store.add_reward(session_id, reward)

    asyncio.run(main())
    return str(root)


def test_session_infos_reads_every_session_of_a_store(tmp_path: Path) -> None:
    store = write_store(
        tmp_path,
        [call("a", 0), call("b", 0)],
        {"a": {"task_id": "t1", "group_id": "g1", "sample_index": 3, "status": "agent_error", "reward": 1.0}},
    )
    infos = session_infos(store)
    assert infos == {
        "a": SessionInfo("a", "t1", "g1", 3, None, "agent_error", 1.0),
        "b": SessionInfo("b", None, None, None, None, "completed", None),
    }


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The directories AutoTokenizer was asked to load (a stand-in module: loading a real one is not the point)."""
    asked: list[str] = []

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path: str) -> str:
            asked.append(path)
            return f"tokenizer of {path}"

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=AutoTokenizer))
    return asked


def tokenizer_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_a_given_tokenizer_directory_is_loaded_or_refused(tmp_path: Path, loaded: list[str]) -> None:
    given = tokenizer_dir(tmp_path / "tok")
    assert find_tokenizer(given, "unused") == (f"tokenizer of {given}", f"tokenizer: {given}")
    assert loaded == [str(given)]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoTokenizerThere) as refused:
        find_tokenizer(empty, str(tmp_path / "store"))
    assert str(refused.value) == f"{empty} holds no tokenizer (tokenizer_config.json)"
    # A file named tokenizer_config.json's directory, not a directory of that name.
    (tmp_path / "odd" / "tokenizer_config.json").mkdir(parents=True)
    with pytest.raises(NoTokenizerThere):
        find_tokenizer(tmp_path / "odd", "unused")


def test_without_a_tokenizer_the_first_ok_calls_model_then_engine_directory(tmp_path: Path, loaded: list) -> None:
    model = tokenizer_dir(tmp_path / "model")
    engine_dir = tokenizer_dir(tmp_path / "engine-dir")
    # The served model name is tried first.
    failed = call("a", 0, status="failed", served_model=str(tmp_path))
    store = write_store(
        tmp_path / "s1", [failed, call("a", 1, served_model=str(model), engine=f"local:{engine_dir}?max_len=64")]
    )
    assert find_tokenizer(None, store) == (f"tokenizer of {model}", f"tokenizer: {model}")
    # A served model name that is no directory here: the local engine's directory, its options cut off.
    store = write_store(tmp_path / "s2", [call("a", 0, served_model="Qwen/Qwen3-8B", engine=f"local:{engine_dir}")])
    assert find_tokenizer(None, store) == (f"tokenizer of {engine_dir}", f"tokenizer: {engine_dir}")
    # Only the first ok call is looked at, even when a later one names a tokenizer.
    remote = call("a", 0, served_model="remote", engine="sglang:http://h:1")
    store = write_store(tmp_path / "s3", [remote, call("a", 1, served_model=str(model))])
    assert find_tokenizer(None, store) == (None, NO_TOKENIZER)
    # An engine text that is no spec names no directory: the served model still counts.
    store = write_store(tmp_path / "s4", [call("a", 0, served_model=str(model), engine="not a spec")])
    assert find_tokenizer(None, store)[1] == f"tokenizer: {model}"
    assert _tokenizer_candidates(store) == [str(model)]
    store = write_store(tmp_path / "s5", [call("a", 0, served_model=None, engine="bogus:x")])
    assert find_tokenizer(None, store) == (None, NO_TOKENIZER)
    assert loaded == [str(model), str(engine_dir), str(model)]


def test_only_the_first_64_calls_are_searched(tmp_path: Path, loaded: list[str]) -> None:
    model = tokenizer_dir(tmp_path / "model")
    failed = [call("a", i, status="failed") for i in range(63)]
    within = write_store(tmp_path / "within", [*failed, call("a", 63, served_model=str(model))])
    assert find_tokenizer(None, within)[1] == f"tokenizer: {model}"
    late = call("a", 64, served_model=str(model))
    beyond = write_store(tmp_path / "beyond", [*failed, call("a", 63, status="failed"), late])
    assert find_tokenizer(None, beyond) == (None, NO_TOKENIZER)


def test_no_tokenizer_says_what_breaks_and_what_to_pass() -> None:
    assert NO_TOKENIZER == (
        "no tokenizer: a re-tokenized sampled turn cannot be told from a template re-render, so both break "
        "their chain as 'other' (pass --tokenizer DIR)"
    )


class Tok:
    def __init__(self, eos_token: str | None) -> None:
        self.eos_token = eos_token

    def convert_tokens_to_ids(self, token: str) -> int:
        return {"<|im_end|>": 151645, "</s>": 2}[token]


def test_tokenizer_eot_is_the_eos_tokens_id() -> None:
    assert tokenizer_eot(Tok("<|im_end|>")) == 151645
    assert tokenizer_eot(Tok("</s>")) == 2
    assert tokenizer_eot(Tok(None)) is None
    assert tokenizer_eot(Tok("")) is None
    assert tokenizer_eot(None) is None


# ---- stats --------------------------------------------------------------------------------------------------------


def test_merge_rate_and_processed_tokens() -> None:
    assert BuildStats().merge_rate == 0.0
    assert BuildStats(calls=4, calls_merged=3).merge_rate == 0.75
    assert BuildStats(prompt_tokens=100, completion_tokens=23).processed_tokens == 123


def stats(**kw: Any) -> BuildStats:
    return BuildStats(**kw)


def test_add_sums_every_figure_and_merges_every_count() -> None:
    mine = stats(sessions=1, calls=3, breaks={"other": 1, "compaction": 2}, roles={"agent": 3}, prompt_tokens=10)
    mine.add(stats(sessions=2, calls=5, breaks={"compaction": 1, "sub_agent": 4}, trainable_tokens=7))
    assert mine == stats(
        sessions=3,
        calls=8,
        breaks={"compaction": 3, "other": 1, "sub_agent": 4},
        roles={"agent": 3},
        prompt_tokens=10,
        trainable_tokens=7,
    )
    assert list(mine.breaks) == ["compaction", "other", "sub_agent"]  # sorted, whatever order they came in
    every = BuildStats(
        **{name: (1 if isinstance(value, int) else {"k": 1}) for name, value in vars(BuildStats()).items()}
    )
    total = BuildStats()
    total.add(every)
    total.add(every)
    assert vars(total) == {name: (2 if isinstance(value, int) else {"k": 2}) for name, value in vars(every).items()}


def test_stats_round_trip_through_their_dict() -> None:
    one = stats(sessions=1, calls=4, calls_merged=3, breaks={"other": 1}, reward_reasons={"outcome reward": 1})
    data = one.to_dict()
    assert data["merge_rate"] == 0.75 and data["calls"] == 4 and data["breaks"] == {"other": 1}
    assert set(data) == {*vars(BuildStats()), "merge_rate"}
    assert BuildStats.from_dict(data) == one
    assert BuildStats.from_dict({"calls": 2, "unknown_figure": 9}) == BuildStats(calls=2)


def test_report_sums_per_harness_and_in_total() -> None:
    report = BuildReport()
    report.add("pi", stats(sessions=1, calls=2))
    report.add("claude-cli", stats(sessions=1, calls=5))
    report.add("pi", stats(sessions=1, calls=1))
    assert report.total == stats(sessions=3, calls=8)
    assert report.by_harness == {"pi": stats(sessions=2, calls=3), "claude-cli": stats(sessions=1, calls=5)}
    data = report.to_dict()
    assert list(data["by_harness"]) == ["claude-cli", "pi"]
    assert data["total"]["sessions"] == 3 and data["by_harness"]["pi"]["calls"] == 3
    back = BuildReport.from_dict(data)
    assert back.total == report.total and back.by_harness == report.by_harness


@pytest.mark.parametrize(
    ("session_harness", "user_agent", "name"),
    [
        ("claude-code", "claude-cli/2.1.197 (external, cli)", "claude-code"),
        (None, "claude-cli/2.1.197 (external, cli)", "claude-cli"),
        ("", "OpenAI/Python 2.8.1", "OpenAI"),
        (None, None, "unknown"),
        ("   ", None, "unknown"),
        (None, "/1.0", "unknown"),
        ("pi", None, "pi"),
    ],
)
def test_harness_name(session_harness: str | None, user_agent: str | None, name: str) -> None:
    assert harness_name(session_harness, user_agent) == name


def test_top_reasons_counts_by_kind_most_frequent_first() -> None:
    reasons = {"no_delta: tools changed": 2, "no_delta: system edited": 2, "first_call": 3, "state_lost": 1, "b": 1}
    assert top_reasons(reasons) == "no_delta 4, first_call 3, b 1"
    assert top_reasons(reasons, n=5) == "no_delta 4, first_call 3, b 1, state_lost 1"
    assert top_reasons({"x: a: b": 1}) == "x 1"
    assert top_reasons({}) == "-"


def test_role_counts_in_role_order_without_zeros() -> None:
    roles = {"discarded: failed": 1, "auxiliary: claude-code title": 2, "agent": 5, "auxiliary: codex compaction": 1}
    assert role_counts(roles) == "agent 5, auxiliary 3, discarded 1"
    assert role_counts({"discarded: retried": 2, "discarded: failed": 1}) == "discarded 3"
    assert role_counts({}) == "-"


def test_side_jobs_are_the_auxiliary_kinds_most_frequent_first() -> None:
    roles = {
        "agent": 9,
        "discarded: failed": 5,
        "auxiliary: claude-code title": 2,
        "auxiliary: qwen-code next_speaker": 1,
        "auxiliary: a": 1,
        "auxiliary: codex compaction": 3,
        "auxiliary: z": 1,
    }
    assert side_jobs(roles) == "codex compaction 3, claude-code title 2, a 1, qwen-code next_speaker 1"
    assert side_jobs(roles, n=2) == "codex compaction 3, claude-code title 2"
    assert side_jobs({"agent": 1, "auxiliaryX": 1}) == "-"


def cells(table: Any) -> dict[str, list[str]]:
    """Row label -> the row's cells, one per column after the label."""
    columns = [list(c.cells) for c in table.columns]
    return {label: [col[i] for col in columns[1:]] for i, label in enumerate(columns[0])}


def test_report_table_one_column_per_harness_and_the_total() -> None:
    report = BuildReport()
    report.add(
        "pi",
        stats(
            sessions=2,
            calls=4,
            calls_unusable={"failed": 1, "empty": 2},
            chains_total=3,
            chains_full=2,
            chains_truncated=1,
            calls_merged=1,
            retokenized_merges=1,
            breaks={"compaction": 1},
            prompt_sources={"continuity": 3, "fresh": 1},
            fresh_reasons={"no_delta: x": 1},
            parse_failed_calls=2,
            tool_call_parsers={"hermes": 3},
            roles={"agent": 3, "auxiliary: pi title": 1},
            traces=3,
            traces_trainable=2,
            prompt_tokens=1500,
            completion_tokens=100,
            trainable_tokens=1234,
        ),
    )
    report.add("[b]codex", stats(sessions=1, calls=1, chains_total=1, chains_full=1, traces=1))
    table = report_table(report, title="Rebuilt")
    assert table.title == "Rebuilt"
    assert [c.header for c in table.columns] == ["", r"\[b]codex", "pi", "total"]
    assert table.columns[3].style == "bold" and table.columns[1].style == table.columns[2].style == ""
    assert all(c.justify == "right" for c in table.columns[1:])
    rows = cells(table)
    assert rows["sessions"] == ["1", "2", "3"]
    assert rows["calls"] == ["1", "4", "5"]
    assert rows["unusable calls"] == ["0", "3", "3"]
    assert rows["chains"] == ["1", "3", "4"]
    assert rows["  fully merged"] == ["1", "2", "3"]
    assert rows["  truncated"] == ["0", "1", "1"]
    assert rows["merge rate"] == ["0.0%", "25.0%", "20.0%"]
    assert rows["re-tokenized merges"] == ["0", "1", "1"]
    assert rows["break: compaction"] == ["0", "1", "1"]
    assert rows["break: other"] == ["0", "0", "0"]
    assert [label for label in rows if label.startswith("break: ")] == [
        "break: template_rerender",
        "break: retokenized",
        "break: rewritten_history",
        "break: compaction",
        "break: sub_agent",
        "break: other",
    ]
    assert rows["prompt: continuity"] == ["0", "3", "3"]
    assert rows["prompt: fresh"] == ["0", "1", "1"]
    assert rows["  top fresh reasons"] == ["-", "no_delta 1", "no_delta 1"]
    assert rows["failed tool-call parses"] == ["0", "2", "2"]
    assert rows["  tool calls found by"] == ["-", "hermes 3", "hermes 3"]
    assert rows["calls by role"] == ["-", "agent 3, auxiliary 1", "agent 3, auxiliary 1"]
    assert rows["  side jobs"] == ["-", "pi title 1", "pi title 1"]
    assert rows["traces (trainable)"] == ["1 (0)", "3 (2)", "4 (2)"]
    assert rows["tokens processed"] == ["0", "1,600", "1,600"]
    assert rows["tokens trained"] == ["0", "1,234", "1,234"]
    assert len(rows) == 24


def test_report_table_of_one_harness_has_no_total_column() -> None:
    report = BuildReport()
    report.add("pi", stats(sessions=1))
    table = report_table(report)
    assert table.title == "Reconstruction"
    assert [c.header for c in table.columns] == ["", "pi"]
    # An empty build still shows its (empty) total.
    assert [c.header for c in report_table(BuildReport()).columns] == ["", "total"]


def test_group_masks_count_error_and_running_sessions() -> None:
    sessions = [
        SessionInfo("a", group_id="g2", status="error"),
        SessionInfo("b", group_id="g2", status="completed"),
        SessionInfo("c", group_id="g1", status="running"),
        SessionInfo("d", group_id="g1", status="timeout"),
        SessionInfo("e", group_id="g1", status="agent_error"),
        SessionInfo("f"),
        SessionInfo("g", group_id="", status="error"),
    ]
    masks = group_masks(sessions)
    assert masks == {
        NO_GROUP: GroupMask(2, 1),
        "g1": GroupMask(3, 1),
        "g2": GroupMask(2, 1),
    }
    assert list(masks) == sorted(masks)
    assert NO_GROUP == "(no group)"
    assert GroupMask(3, 1).rate == 1 / 3 and GroupMask(0, 0).rate == 0.0


def test_masks_to_dict_totals_every_group() -> None:
    masks = {"g1": GroupMask(4, 1), "g2": GroupMask(4, 3)}
    assert masks_to_dict(masks) == {
        "mask_rate": 0.5,
        "masked": 4,
        "sessions": 8,
        "groups": {
            "g1": {"sessions": 4, "masked": 1, "mask_rate": 0.25},
            "g2": {"sessions": 4, "masked": 3, "mask_rate": 0.75},
        },
    }
    assert masks_to_dict({}) == {"mask_rate": 0.0, "masked": 0, "sessions": 0, "groups": {}}


def rows_of(table: Any) -> list[list[str]]:
    columns = [list(c.cells) for c in table.columns]
    return [list(row) for row in zip(*columns)]


def test_mask_table_ranks_groups_by_rate_and_cuts_at_the_limit() -> None:
    masks = {"b": GroupMask(2, 1), "a": GroupMask(2, 1), "c": GroupMask(4, 4), "d": GroupMask(3, 0)}
    table = mask_table(masks)
    assert table.title == "Masked sessions (error or running: never trained)"
    assert [c.header for c in table.columns] == ["group", "sessions", "masked", "mask rate"]
    assert [c.justify for c in table.columns] == ["left", "right", "right", "right"]
    assert rows_of(table) == [
        ["c", "4", "4", "100.0%"],
        ["a", "2", "1", "50.0%"],
        ["b", "2", "1", "50.0%"],
        ["d", "3", "0", "0.0%"],
        ["total", "11", "6", "54.5%"],
    ]
    assert table.rows[-1].style == "bold"
    cut = mask_table(masks, limit=2)
    assert rows_of(cut) == [
        ["c", "4", "4", "100.0%"],
        ["a", "2", "1", "50.0%"],
        ["... 2 more groups", "", "", ""],
        ["total", "11", "6", "54.5%"],
    ]
    # At the limit exactly, nothing is cut.
    assert len(rows_of(mask_table(masks, limit=4))) == 5
    assert rows_of(mask_table({"[x]": GroupMask(1, 0)}))[0][0] == r"\[x]"


def test_mask_table_shows_twenty_groups_by_default() -> None:
    masks = {f"g{i:02d}": GroupMask(1, i % 2) for i in range(21)}
    rows = rows_of(mask_table(masks))
    assert len(rows) == 22 and rows[-2] == ["... 1 more groups", "", "", ""]
    assert len(rows_of(mask_table(dict(list(masks.items())[:20])))) == 21


def test_a_role_is_the_text_before_the_first_colon() -> None:
    assert role_counts({"discarded: retried: call 3 sent it again": 2, "agent": 1}) == "agent 1, discarded 2"
