"""What the trainer reads as a session's reward and status: a reward's checks, the sessions view's precedence
(latest reward per name, an explicit update over the calls, ``error`` final, a reward ending a running session),
the status vocabulary, and `polar shards inspect`'s counts. An agent under training may post rewards and statuses:
every boundary here is one it could probe."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from polar_addon.store import summary as summary_mod
from polar_addon.store.rewards import REWARD_LIMIT, RewardInput, RewardRecord, check_reward, parse_rewards_jsonl
from polar_addon.store.sessions import SessionRecord, merge_sessions, row_metadata
from polar_addon.store.status import (
    MASKED,
    REWARDED,
    RUNNER_STATUSES,
    STORE_MASKED,
    STORED_STATUSES,
    USABLE,
    SessionStatus,
)
from polar_cli.rollout.verify import NoReward, outcome

NAME_RULE = "reward name must match ^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$"


# --- check_reward -------------------------------------------------------------------------------------------------


def test_a_reward_at_the_limit_passes_and_one_past_it_fails() -> None:
    assert REWARD_LIMIT == 1e6
    assert check_reward(1_000_000) == (1e6, "reward")
    assert check_reward(-1_000_000.0, "x") == (-1e6, "x")
    for value in (1_000_001, -1_000_001, 1e6 + 0.5):
        with pytest.raises(ValueError) as exc:
            check_reward(value)
        assert str(exc.value) == "reward value must be a finite number within +-1e+06"


def test_a_reward_value_is_returned_as_a_float() -> None:
    value, name = check_reward(3, "pass@1")
    assert (value, type(value), name) == (3.0, float, "pass@1")
    assert check_reward(0.25) == (0.25, "reward")


@pytest.mark.parametrize("value", [True, False, "1", None, [1], {"v": 1}])
def test_only_json_numbers_are_rewards(value: Any) -> None:
    with pytest.raises(ValueError) as exc:
        check_reward(value)
    assert str(exc.value) == "reward value must be a JSON number"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_fail(value: float) -> None:
    with pytest.raises(ValueError) as exc:
        check_reward(value)
    assert str(exc.value) == "reward value must be a finite number within +-1e+06"


def test_an_integer_too_big_for_a_float_fails_with_the_limit() -> None:
    with pytest.raises(ValueError) as exc:
        check_reward(10**400)
    assert str(exc.value) == "reward value must be within +-1e+06"
    assert exc.value.__suppress_context__ and exc.value.__cause__ is None


def test_reward_names_at_64_characters_pass_and_at_65_fail() -> None:
    assert check_reward(1, "a" * 64) == (1.0, "a" * 64)
    assert check_reward(1, "Z9_.:@-z") == (1.0, "Z9_.:@-z")
    assert check_reward(1, "7") == (1.0, "7")
    for name in ("a" * 65, "", "_x", "-x", ".x", "a b", "a/b", "é", 5, None):
        with pytest.raises(ValueError) as exc:
            check_reward(1, name)
        assert str(exc.value) == NAME_RULE


def test_a_reward_name_with_a_trailing_newline_fails() -> None:
    # `$` lets re.match end before a final newline: "reward\n" was a second, invisible "reward" (a verifier's file or
    # a control post could add it beside the real one).
    with pytest.raises(ValueError, match="reward name must match"):
        check_reward(1, "reward\n")
    with pytest.raises(NoReward, match=r"reward names \['reward\\n'\] do not match"):
        outcome({"reward\n": 1.0}, "reward.json")


# --- parse_rewards_jsonl ------------------------------------------------------------------------------------------


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "rewards.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_rewards_file_gives_each_line_in_order_with_the_default_name(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        '{"session_id": "a", "value": 1}',
        "",
        "   ",
        '{"session_id": "b", "value": -0.5, "name": "pass@1"}',
        '{"session_id": "c", "value": 2, "name": ""}',
    )
    assert parse_rewards_jsonl(path) == [
        RewardInput("a", 1.0, "reward"),
        RewardInput("b", -0.5, "pass@1"),
        RewardInput("c", 2.0, "reward"),
    ]
    assert parse_rewards_jsonl(_jsonl(tmp_path, "")) == []


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"session_id": "", "value": 1}', "session_id must be a non-empty string"),
        ('{"session_id": 7, "value": 1}', "session_id must be a non-empty string"),
        ('{"session_id": "a", "value": true}', "reward value must be a JSON number"),
        ('{"session_id": "a", "value": 1e7}', "reward value must be a finite number within +-1e+06"),
        ('{"session_id": "a", "value": 1, "name": "a b"}', NAME_RULE),
        ('{"session_id": "a"}', "'value'"),
        ('{"value": 1}', "'session_id'"),
    ],
)
def test_a_bad_line_fails_the_file_naming_its_number(tmp_path: Path, line: str, said: str) -> None:
    # Line 3 after a good line and a blank one: numbers count every line, blank ones included.
    path = _jsonl(tmp_path, '{"session_id": "ok", "value": 1}', "", line)
    with pytest.raises(ValueError) as exc:
        parse_rewards_jsonl(path)
    assert str(exc.value) == f"{path}:3: {said}"


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '"a"', "3", "null"])
def test_a_line_that_is_no_json_object_fails_naming_its_number(tmp_path: Path, line: str) -> None:
    path = _jsonl(tmp_path, line)
    with pytest.raises(ValueError) as exc:
        parse_rewards_jsonl(path)
    assert str(exc.value).startswith(f"{path}:1: ")


# --- the status vocabulary ----------------------------------------------------------------------------------------


def test_what_the_store_records_for_each_runner_status() -> None:
    stored = {s.value: s.stored.value for s in SessionStatus}
    assert stored == {
        "running": "running",
        "completed": "completed",
        "failed": "agent_error",
        "agent_error": "agent_error",
        "timeout": "timeout",
        "error": "error",
        "cancelled": "error",
    }


def test_which_statuses_train_which_are_rewarded_and_which_are_masked() -> None:
    table = {s.value: (s.usable, s.rewarded, s.masked) for s in SessionStatus}
    assert table == {
        "running": (False, False, False),
        "completed": (True, True, False),
        "failed": (True, True, False),
        "agent_error": (False, False, False),
        "timeout": (True, False, False),
        "error": (False, False, True),
        "cancelled": (False, False, True),
    }
    assert USABLE == {"completed", "failed", "timeout"}
    assert REWARDED == {"completed", "failed"}
    assert MASKED == {"error", "cancelled"}
    assert STORE_MASKED == {"error", "running"}


def test_the_status_orders_summaries_and_errors_list() -> None:
    assert RUNNER_STATUSES == ("completed", "failed", "timeout", "error", "cancelled")
    assert STORED_STATUSES == ("running", "completed", "timeout", "error", "agent_error")
    assert SessionStatus.FAILED == "failed" and isinstance(SessionStatus.CANCELLED.stored, SessionStatus)


# --- row_metadata -------------------------------------------------------------------------------------------------


def test_row_metadata_reads_a_json_object_and_nothing_else() -> None:
    assert row_metadata({}) is None
    assert row_metadata({"metadata_json": ""}) is None
    assert row_metadata({"metadata_json": None}) is None
    assert row_metadata({"metadata_json": '{"a": 1}'}) == {"a": 1}
    assert row_metadata({"metadata_json": "{}"}) == {}
    for text, said in [
        ("{", "metadata_json is not valid JSON"),
        ("[1]", "metadata_json is a list, not a JSON object"),
        ("null", "metadata_json is a NoneType, not a JSON object"),
        ('"x"', "metadata_json is a str, not a JSON object"),
    ]:
        with pytest.raises(ValueError) as exc:
            row_metadata({"metadata_json": text})
        assert str(exc.value) == said
        if text == "{":  # the decoder's error is no part of the message
            assert exc.value.__suppress_context__


# --- merge_sessions -----------------------------------------------------------------------------------------------


def _reward(session: str, value: float, name: str = "reward", at: float = 2.0) -> RewardRecord:
    return RewardRecord(f"{session}-{name}-{at}", session, name, value, "cli", at)


def _call(session: str, seq: int, status: str = "ok", **fields: Any) -> dict[str, Any]:
    return {"session_id": session, "seq": seq, "status": status, "prompt_len": 10, "response_len": 3, **fields}


def _by_id(records: list[SessionRecord]) -> dict[str, SessionRecord]:
    return {r.session_id: r for r in records}


def test_the_latest_reward_of_each_name_wins_and_every_event_is_kept() -> None:
    events = [_reward("s", 1.0, at=1), _reward("s", 0.0, "pass@1", at=2), _reward("s", -1.0, at=3)]
    (record,) = merge_sessions([{"session_id": "s", "status": "completed"}], events, [])
    assert record.rewards == {"reward": -1.0, "pass@1": 0.0}
    assert record.reward == -1.0
    assert record.reward_history == events
    assert record.status == "completed"


def test_a_session_without_an_outcome_reward_has_none() -> None:
    (record,) = merge_sessions([], [_reward("s", 1.0, "pass@1")], [])
    assert record.reward is None and record.rewards == {"pass@1": 1.0}
    # A reward alone makes a record, but no status: it never said it was running.
    assert record.status is None


@pytest.mark.parametrize(
    ("statuses", "final"),
    [
        (["running"], "completed"),
        (["running", "timeout"], "timeout"),
        (["running", "agent_error"], "agent_error"),
        (["running", "error", "completed"], "error"),
        (["error", "running"], "error"),
        (["error", "error"], "error"),
        (["completed", "running"], "completed"),  # later over earlier; then the reward ends it
        (["completed", "error"], "error"),
    ],
)
def test_which_status_is_final_with_a_reward_posted(statuses: list[str], final: str) -> None:
    updates = [{"session_id": "s", "status": s} for s in statuses]
    (record,) = merge_sessions(updates, [_reward("s", 1.0)], [])
    assert record.status == final and record.reward == 1.0


def test_without_a_reward_a_running_session_stays_running() -> None:
    (record,) = merge_sessions([{"session_id": "s", "status": "completed"}, {"session_id": "s", "status": "running"}],
                               [], [])  # fmt: skip
    assert record.status == "running"


def test_an_error_row_still_merges_its_other_fields_and_metadata() -> None:
    updates = [
        {"session_id": "s", "status": "error", "ended_at": 2.0, "metadata_json": '{"error": "engine died"}'},
        {"session_id": "s", "status": "completed", "ended_at": 3.0, "harness": "cmd", "metadata_json": '{"k": 1}'},
    ]
    (record,) = merge_sessions(updates, [], [])
    assert (record.status, record.ended_at, record.harness) == ("error", 3.0, "cmd")
    assert record.metadata == {"error": "engine died", "k": 1}


def test_later_updates_win_field_by_field_and_none_never_erases() -> None:
    updates = [
        {"session_id": "s", "task_id": "t1", "group_id": "g", "sample_index": 0, "harness": "h", "status": "running",
         "started_at": 1.0, "ended_at": None, "metadata_json": '{"a": 1, "b": 1}'},
        {"session_id": "s", "task_id": "t2", "group_id": None, "sample_index": 3, "status": None, "ended_at": 5.0,
         "metadata_json": '{"b": 2}'},
    ]  # fmt: skip
    (record,) = merge_sessions(updates, [], [])
    assert (record.task_id, record.group_id, record.sample_index, record.harness) == ("t2", "g", 3, "h")
    assert (record.status, record.started_at, record.ended_at) == ("running", 1.0, 5.0)
    assert record.metadata == {"a": 1, "b": 2}


def test_a_row_with_bad_metadata_is_skipped_whole_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    updates = [
        {"session_id": "s", "status": "running", "task_id": "t"},
        {"session_id": "s", "status": "error", "task_id": "evil", "metadata_json": "[1]"},
        {"session_id": "x", "status": "completed", "metadata_json": "{"},
    ]
    with caplog.at_level(logging.WARNING, logger="polar"):
        records = merge_sessions(updates, [], [])
    assert [(r.session_id, r.status, r.task_id) for r in records] == [("s", "running", "t")]
    assert [r.getMessage() for r in caplog.records] == [
        "polar: skipped a sessions row of session 's': metadata_json is a list, not a JSON object",
        "polar: skipped a sessions row of session 'x': metadata_json is not valid JSON",
    ]


def test_calls_count_and_sum_tokens_of_ok_calls_only() -> None:
    calls = [
        _call("s", 0),
        _call("s", 1, "error"),
        _call("s", 2, prompt_len=None, response_len=None),
        _call("s", 3, prompt_len=7, response_len=2),
        _call("s", 4, "timeout", prompt_len=100, response_len=100),
    ]
    (record,) = merge_sessions([], [], calls)
    assert (record.calls, record.failed_calls) == (5, 2)
    assert (record.prompt_tokens, record.response_tokens) == (17, 5)
    assert record.status is None


def test_calls_fill_only_what_no_update_said_and_the_earliest_call_wins() -> None:
    updates = [{"session_id": "s", "task_id": "explicit", "started_at": 50.0}]
    calls = [  # out of order: merged in seq order
        _call("s", 2, task_id="late", group_id="g-late", sample_index=9, harness="h-late", started_at=1.0),
        _call("s", 1, task_id="first", group_id="g", sample_index=0, harness="h", started_at=5.0),
    ]
    (record,) = merge_sessions(updates, [], calls)
    assert (record.task_id, record.group_id, record.sample_index, record.harness) == ("explicit", "g", 0, "h")
    assert record.started_at == 50.0  # an explicit start is kept even though a call started earlier


def test_without_an_explicit_start_a_session_starts_at_its_earliest_call() -> None:
    calls = [_call("s", 0, started_at=5.0), _call("s", 1, started_at=3.0), _call("s", 2, started_at=4.0),
             _call("s", 3, started_at=None), _call("s", 4, started_at=0.0)]  # fmt: skip
    (record,) = merge_sessions([], [], calls)
    assert record.started_at == 3.0  # 0 and None: not a start time
    (first_later,) = merge_sessions([], [], [_call("t", 0, started_at=2.0), _call("t", 1, started_at=6.0)])
    assert first_later.started_at == 2.0


def test_a_calls_field_of_one_session_never_leaks_into_another() -> None:
    updates = [{"session_id": "b", "task_id": "tb"}]
    calls = [_call("a", 0, task_id="ta"), _call("b", 0, task_id="wrong"), _call("c", 0)]
    records = merge_sessions(updates, [], calls)
    assert [(r.session_id, r.task_id, r.calls) for r in records] == [("a", "ta", 1), ("b", "tb", 1), ("c", None, 1)]


def test_sessions_come_back_sorted_by_id() -> None:
    records = merge_sessions([{"session_id": "b"}], [_reward("c", 1.0)], [_call("a", 0)])
    assert [r.session_id for r in records] == ["a", "b", "c"]


# --- summarize ----------------------------------------------------------------------------------------------------


URI = "mem://store"


class _Out:
    def __init__(self, shards: dict[str, list[str]], sizes: dict[str, int]) -> None:
        self.shards = shards
        self.fs = SimpleNamespace(get_file_info=lambda paths: [self._info(p, sizes) for p in paths])

    @staticmethod
    def _info(path: str, sizes: dict[str, int]) -> SimpleNamespace:
        kind = summary_mod.pafs.FileType.File if path in sizes else summary_mod.pafs.FileType.NotFound
        return SimpleNamespace(size=sizes.get(path, 1000), type=kind)

    def list_shards(self, kind: str) -> list[str]:
        return self.shards.get(kind, [])


def _summarize(monkeypatch: pytest.MonkeyPatch, calls: pa.Table, sessions: list[SessionRecord]) -> Any:
    out = _Out({"calls": ["c1", "c2", "gone"], "rewards": ["r1"]}, {"c1": 100, "c2": 20, "r1": 3})
    # Each reader answers only for the store asked about (and the calls only for the calls kind).
    monkeypatch.setattr(summary_mod.Output, "from_uri", staticmethod(lambda uri: out if uri == URI else None))
    monkeypatch.setattr(summary_mod, "read_sessions", lambda uri: sessions if uri == URI else [])
    monkeypatch.setattr(
        summary_mod,
        "read_table",
        lambda uri, kind, columns: calls.select(columns) if (uri, kind) == (URI, "calls") else None,
    )
    monkeypatch.setattr(summary_mod, "default_journal_dir", lambda o: "J" if o is out else "wrong")
    monkeypatch.setattr(summary_mod, "journal_segments", lambda root: ["s1", "s2"] if root == "J" else [])
    return summary_mod.summarize(URI)


def test_summarize_counts_calls_tokens_statuses_and_rewards(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = pa.table({
        "status": ["ok", "ok", "error", "timeout"],
        "harness": ["cmd", None, "cmd", "cmd"],
        "error": [None, None, "boom", None],
        "prompt_len": [10, 5, 7, 1],
        "prompt_tail": [[1, 2], [3], [], [4]],
        "response_ids": [[9, 9, 9], [9], [], []],
    })  # fmt: skip
    sessions = [
        SessionRecord("a", status="completed", rewards={"reward": 1.0, "pass@1": 1.0}),
        SessionRecord("b", status="completed", rewards={"reward": -0.5}),
        SessionRecord("c", status=None, rewards={"reward": 2.0}),
        SessionRecord("d", status="error"),
    ]
    s = _summarize(monkeypatch, calls, sessions)
    assert (s.uri, s.sessions) == ("mem://store", sessions)
    assert (s.calls_ok, s.calls_failed) == (2, 2)
    assert (s.prompt_tokens, s.stored_prompt_tokens, s.response_tokens) == (23, 4, 4)
    assert s.shards == {"calls": 3, "sessions": 0, "rewards": 1}
    assert s.shard_bytes == 123  # a listed shard gone meanwhile counts nothing
    assert s.harnesses == {"cmd": 3, "(unknown)": 1}
    assert s.failures == {"boom": 1, "(no reason)": 1}
    assert s.statuses == {"completed": 2, "(not reported)": 1, "error": 1}
    assert s.rewards == [
        summary_mod.RewardStats("pass@1", 1, 1.0, 1.0, 1.0),
        summary_mod.RewardStats("reward", 3, 2.5 / 3, -0.5, 2.0),
    ]
    assert s.journal_segments == 2


def test_summarize_of_a_store_without_calls_counts_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = pa.table({"status": pa.array([], pa.string()), "harness": pa.array([], pa.string()),
                      "error": pa.array([], pa.string()), "prompt_len": pa.array([], pa.int64()),
                      "prompt_tail": pa.array([], pa.list_(pa.int64())),
                      "response_ids": pa.array([], pa.list_(pa.int64()))})  # fmt: skip
    s = _summarize(monkeypatch, empty, [])
    assert (s.calls_ok, s.calls_failed, s.prompt_tokens, s.stored_prompt_tokens, s.response_tokens) == (0,) * 5
    assert (s.harnesses, s.failures, s.statuses, s.rewards) == ({}, {}, {}, [])


def test_summarize_of_failed_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = pa.table({"status": ["error"], "harness": ["h"], "error": ["x"], "prompt_len": [4],
                      "prompt_tail": [[1]], "response_ids": [[]]})  # fmt: skip
    s = _summarize(monkeypatch, calls, [])
    assert (s.calls_ok, s.calls_failed, s.prompt_tokens, s.response_tokens) == (0, 1, 4, 0)
    assert s.failures == {"x": 1}


def test_summarize_counts_zero_tokens_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = pa.table({"status": ["ok"], "harness": ["h"], "error": [None], "prompt_len": [0],
                      "prompt_tail": [[]], "response_ids": [[]]})  # fmt: skip
    s = _summarize(monkeypatch, calls, [])
    assert (s.calls_ok, s.prompt_tokens, s.stored_prompt_tokens, s.response_tokens) == (1, 0, 0, 0)


def test_journal_session_ids_reads_every_segment_and_skips_converted_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = {"seg1": [b"a", b"b"], "seg3": [b"c", b"a"]}

    def read_segment(path: str) -> list[bytes]:
        if path not in payloads:
            raise FileNotFoundError(path)
        return payloads[path]

    monkeypatch.setattr(summary_mod, "journal_segments", lambda root: ["seg1", "seg2", "seg3"] if root == "R" else [])
    monkeypatch.setattr(summary_mod.journal, "read_segment", read_segment)
    monkeypatch.setattr(summary_mod, "entry_header", lambda p: ("calls", {"session_id": "sid-" + p.decode()}))
    assert summary_mod.journal_session_ids("R") == {"sid-a", "sid-b", "sid-c"}
    assert json.dumps(sorted(summary_mod.journal_session_ids("other"))) == "[]"
