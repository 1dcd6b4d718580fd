"""The validator (polar_addon.store.validate) on forged shards: every finding with its exact line, the boundaries
of what a reference may hold (at the limit and one past it), shards it cannot trust left unread, and rows that
would make the reader rebuild a call differently from what the row says (a negative prefix length, a reference
without its length)."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from polar_addon.store import journal
from polar_addon.store.entries import call_entry, row_entry
from polar_addon.store.shards import CALLS, REWARDS, SCHEMAS, SESSIONS, Output
from polar_addon.store.trace_store import SESSION_STATUSES
from polar_addon.store.validate import validate_store
from tests.support.store_rows import stored_row
from tests.test_store_basic import Agent, make_record


def _chain(session_id: str, n: int, seed: int = 1) -> list[dict]:
    """``n`` calls of one session as the writer stores them: each references the one before."""
    agent = Agent(session_id, random.Random(seed))
    rows, tips = [], []
    for seq in range(n):
        row, tip = stored_row(agent.next_call(), seq, tips)
        rows.append(row)
        tips = [*tips, tip]
    return rows


def _write(store: Path, kind: str, name: str, rows: list[dict]) -> None:
    Output.from_uri(str(store)).write_shard(kind, name, pa.Table.from_pylist(rows, schema=SCHEMAS[kind]))


def _where(row: dict) -> str:
    return f"call {row['record_id']} (session {row['session_id']}, seq {row['seq']})"


def _validate(store: Path, rows: list[dict]) -> list[str]:
    _write(store, CALLS, "0001", rows)
    return validate_store(str(store))


def test_a_writers_store_is_valid(tmp_path: Path) -> None:
    failed, _ = stored_row(make_record("f", [], [], [], status="failed"), 0)
    assert _validate(tmp_path, [*_chain("s", 3), failed]) == []
    _write(tmp_path, SESSIONS, "0001", [{"session_id": "s", "status": "completed"}, {"session_id": "t"}])
    _write(tmp_path, REWARDS, "0001", [{"reward_id": "r", "session_id": "t", "value": -1.5}])
    assert validate_store(str(tmp_path)) == []


def test_each_row_finding_names_the_call(tmp_path: Path) -> None:
    rows = _chain("s", 3)
    rows[0]["status"] = "weird"
    rows[1]["logprobs"] = rows[1]["logprobs"][:-1]
    rows[2]["prompt_len"] += 1
    p = _chain("p", 2, seed=2)
    p[1]["prompt_ref"] = None  # the prefix length stays: the reader would take the tail alone
    m = _chain("m", 2, seed=3)
    m[1]["messages_prefix_len"] = 0
    m[1]["messages_ref"] = m[0]["record_id"]
    assert _validate(tmp_path, [*rows, *p, *m]) == [
        f"{_where(rows[0])}: status 'weird' is neither ok nor failed",
        f"{_where(rows[1])}: 5 logprobs for 6 response tokens",
        f"{_where(rows[2])}: prompt_len {rows[2]['prompt_len']} != prefix {rows[2]['prompt_prefix_len']} + tail "
        f"{len(rows[2]['prompt_tail'])}",
        f"{_where(p[1])}: prompt_ref and prompt_prefix_len disagree",
        f"{_where(m[1])}: messages_ref and messages_prefix_len disagree",
        f"call {m[1]['record_id']}: rebuilt messages count differs from messages_count",
        f"call {p[1]['record_id']}: rebuilt prompt length {len(p[1]['prompt_tail'])} differs from prompt_len "
        f"{p[1]['prompt_len']}",
        f"call {rows[2]['record_id']}: rebuilt prompt length {rows[2]['prompt_len'] - 1} differs from prompt_len "
        f"{rows[2]['prompt_len']}",
    ]


def test_a_failed_call_holds_no_tokens_and_says_why(tmp_path: Path) -> None:
    def failed(**fields) -> dict:
        row, _ = stored_row(make_record(fields.pop("sid"), [], [], [], status="failed"), 0)
        row.update(fields)
        return row

    rows = [
        failed(sid="a"),
        failed(sid="b", prompt_len=2, prompt_tail=[1, 2]),
        failed(sid="c", response_ids=[1], logprobs=[]),  # no logprob count finding for a failed call
        failed(sid="d", logprobs=[-1.0]),
        failed(sid="e", error=""),
        failed(sid="g", error=None),
    ]
    assert _validate(tmp_path, rows) == [
        f"{_where(rows[1])}: a failed call has tokens",
        f"{_where(rows[2])}: a failed call has tokens",
        f"{_where(rows[3])}: a failed call has tokens",
        f"{_where(rows[4])}: a failed call has no error",
        f"{_where(rows[5])}: a failed call has no error",
    ]


def test_seqs_must_run_from_zero_without_gaps_and_findings_list_at_most_ten(tmp_path: Path) -> None:
    rows = _chain("s", 2)
    for row in rows:
        row.update(prompt_ref=None, prompt_prefix_len=0, messages_ref=None, messages_prefix_len=0)
        row["prompt_tail"] = [1] * row["prompt_len"]
        row["messages_tail_json"] = "[]"
        row["messages_count"] = 0
    rows[0]["seq"], rows[1]["seq"] = 1, 14
    late = dict(_chain("t", 1)[0], seq=0)
    dup = [dict(late, record_id=f"d{i}", seq=i // 2) for i in range(24)]  # 0,0,1,1,...,11,11
    gap = [dict(late, session_id="u", record_id=f"u{seq}", seq=seq) for seq in (0, 2)]  # the one before the last
    problems = _validate(tmp_path, [*rows, *dup, *gap])
    assert problems == [
        "session s: seq not contiguous from 0 (duplicated [], missing [0, 2, 3, 4, 5, 6, 7, 8, 9, 10])",
        "session t: seq not contiguous from 0 (duplicated [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], missing [])",
        "session u: seq not contiguous from 0 (duplicated [], missing [1])",
    ]


def test_a_duplicated_record_id_is_one_finding_and_its_session_is_not_rebuilt(tmp_path: Path) -> None:
    rows = _chain("s", 2)
    copy = dict(rows[1], seq=2)
    copy["messages_count"] = 99  # would be a rebuild finding, were the session rebuilt
    later = _chain("t", 1, seed=2)
    later[0]["messages_count"] = 99  # a later session is still rebuilt
    problems = _validate(tmp_path, [*rows, copy, *later])
    assert problems == [
        f"record_id {rows[1]['record_id']} appears 2 times",
        f"call {later[0]['record_id']}: rebuilt messages count differs from messages_count",
    ]


def test_a_reference_may_reach_exactly_what_its_call_holds_and_not_one_more(tmp_path: Path) -> None:
    rows = _chain("s", 2)
    base, row = rows
    held = base["prompt_len"] + len(base["response_ids"])
    shift = held - row["prompt_prefix_len"]
    row["prompt_prefix_len"] = held
    row["prompt_tail"] = row["prompt_tail"][shift:]
    assert _validate(tmp_path / "at", rows) == []
    row["prompt_prefix_len"] += 1
    row["prompt_len"] += 1
    assert _validate(tmp_path / "past", rows) == [
        f"{_where(row)}: prompt_prefix_len {held + 1} exceeds what {base['record_id']} holds ({held})",
        f"session s: cannot rebuild records (call {row['record_id']}: prompt_prefix_len {held + 1} exceeds call "
        f"{base['record_id']})",
    ]


def test_a_messages_reference_may_reach_the_referenced_answer_and_not_one_more(tmp_path: Path) -> None:
    rows = _chain("s", 2)
    base, row = rows
    held = base["messages_count"] + 1  # its messages, then its answer as an assistant message
    assert row["messages_prefix_len"] == held
    assert _validate(tmp_path / "at", rows) == []
    row["messages_prefix_len"] = held + 1
    row["messages_count"] = None
    assert _validate(tmp_path / "past", rows) == [
        f"{_where(row)}: messages_prefix_len {held + 1} exceeds what {base['record_id']} holds ({held})",
        f"session s: cannot rebuild records (call {row['record_id']}: messages_prefix_len {held + 1} exceeds call "
        f"{base['record_id']})",
    ]
    # Without a messages_count the referenced call holds one message: its answer.
    base["messages_count"] = None
    row["messages_prefix_len"] = 1
    problems = _validate(tmp_path / "uncounted", rows)
    assert f"{_where(row)}: messages_prefix_len 1 exceeds" not in " ".join(problems)
    row["messages_prefix_len"] = 2
    assert f"{_where(row)}: messages_prefix_len 2 exceeds what {base['record_id']} holds (1)" in _validate(
        tmp_path / "uncounted2", rows
    )


def test_a_reference_to_a_later_call_or_another_session_does_not_resolve(tmp_path: Path) -> None:
    rows = _chain("s", 3)
    other = _chain("t", 1, seed=2)
    rows[1]["messages_ref"] = rows[2]["record_id"]
    rows[2]["prompt_ref"] = other[0]["record_id"]
    problems = _validate(tmp_path, [*rows, *other])
    assert problems[:2] == [
        f"{_where(rows[1])}: messages_ref {rows[2]['record_id']} does not resolve to an earlier call of the session",
        f"{_where(rows[2])}: prompt_ref {other[0]['record_id']} does not resolve to an earlier call of the session",
    ]
    assert problems[2].startswith("session s: cannot rebuild records (call ") and len(problems) == 3


def test_both_references_of_a_call_are_checked_whatever_the_first_one_is(tmp_path: Path) -> None:
    rows = _chain("s", 4)
    # A whole prompt (no prompt reference) with a messages reference past what its call holds.
    rows[1].update(prompt_ref=None, prompt_prefix_len=0, prompt_tail=[1] * rows[1]["prompt_len"])
    rows[1]["messages_prefix_len"] += 1
    # A prompt reference that resolves to nothing, and a messages reference that is negative.
    rows[3]["prompt_ref"] = "0" * 32
    rows[3]["messages_prefix_len"] = -2
    problems = _validate(tmp_path, rows)
    assert problems[:3] == [
        f"{_where(rows[1])}: messages_prefix_len {rows[1]['messages_prefix_len']} exceeds what "
        f"{rows[0]['record_id']} holds ({rows[1]['messages_prefix_len'] - 1})",
        f"{_where(rows[3])}: prompt_ref {'0' * 32} does not resolve to an earlier call of the session",
        f"{_where(rows[3])}: messages_prefix_len -2 is negative",
    ]


def test_messages_that_are_not_json_cannot_be_rebuilt(tmp_path: Path) -> None:
    rows = _chain("s", 2)
    rows[1]["messages_tail_json"] = "[not json"
    [problem] = _validate(tmp_path, rows)
    assert problem.startswith("session s: cannot rebuild records (")


def test_a_negative_prefix_length_is_a_finding_not_a_silently_shorter_call(tmp_path: Path) -> None:
    rows = _chain("s", 3)
    row = rows[2]
    # Consistent on its face (prompt_len = prefix + tail), but the reader would take the referenced call's tokens
    # up to three from its end: a prompt other than the one the row states.
    row["prompt_prefix_len"] = -3
    row["prompt_len"] = -3 + len(row["prompt_tail"])
    problems = _validate(tmp_path / "prompt", rows)
    assert f"{_where(row)}: prompt_prefix_len -3 is negative" in problems
    # The reader refuses it too (compaction.expand_session): training never sees the shorter prompt.
    rebuild = f"session s: cannot rebuild records (call {row['record_id']}: prompt_prefix_len -3 is negative)"
    assert rebuild in problems
    rows = _chain("s", 3)
    rows[2]["messages_prefix_len"] = -1  # drops the referenced call's answer
    rows[2]["messages_count"] = None
    assert _validate(tmp_path / "messages", rows) == [
        f"{_where(rows[2])}: messages_prefix_len -1 is negative",
        f"session s: cannot rebuild records (call {rows[2]['record_id']}: messages_prefix_len -1 is negative)",
    ]


def test_a_reference_without_its_length_or_a_base_without_prompt_len_is_reported_not_a_crash(tmp_path: Path) -> None:
    rows = _chain("s", 2)
    rows[1]["prompt_prefix_len"] = None
    rows[1]["messages_prefix_len"] = -1  # still checked after the prompt reference without its length
    problems = _validate(tmp_path / "len", rows)
    assert f"{_where(rows[1])}: prompt_ref and prompt_prefix_len disagree" in problems
    assert f"{_where(rows[1])}: messages_prefix_len -1 is negative" in problems
    assert problems[-1].startswith("session s: cannot rebuild records (")
    rows = _chain("s", 2)
    rows[0]["prompt_len"] = None
    problems = _validate(tmp_path / "base", rows)
    assert problems[0] == f"{_where(rows[0])}: prompt_len None != prefix 0 + tail {len(rows[0]['prompt_tail'])}"


def test_shards_of_the_wrong_layout_are_reported_and_left_unread(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "0001.parquet").write_bytes(b"PAR1")
    no_seq = pa.Table.from_pylist(_chain("a", 1), schema=SCHEMAS[CALLS]).drop_columns(["seq"])
    pq.write_table(no_seq, str(tmp_path / "calls" / "0002.parquet"))
    # Written by a polar from before the role columns: valid, its rows read with nulls there.
    old = pa.Table.from_pylist(_chain("b", 2), schema=SCHEMAS[CALLS]).drop_columns(["role", "role_reason"])
    pq.write_table(old, str(tmp_path / "calls" / "0003.parquet"))
    # A later column missing is no finding, and does not hide an older one missing after it.
    foreign = pa.Table.from_pylist(_chain("c", 1), schema=SCHEMAS[CALLS]).drop_columns(["min_p", "finish_reason"])
    pq.write_table(foreign, str(tmp_path / "calls" / "0004.parquet"))
    wrong = pa.Table.from_pylist(
        [{"reward_id": "r1", "session_id": "ghost", "name": "n", "value": "1", "source": "s", "created_at": 1.0}]
    )
    out.write_shard(REWARDS, "0001", wrong)
    out.write_shard(
        REWARDS, "0002", pa.Table.from_pylist([{"reward_id": "r2", "session_id": "b", "value": 1.0}], SCHEMAS[REWARDS])
    )
    problems = validate_store(str(tmp_path))
    assert problems[0].startswith("calls/0001.parquet: unreadable Parquet (")
    assert problems[1:] == [
        "calls/0002.parquet: missing column seq",
        "calls/0004.parquet: missing column finish_reason",
        "rewards/0001.parquet: column value is string, expected double",
    ]


def test_session_rows_quarantine_and_rewards_are_checked(tmp_path: Path) -> None:
    _write(tmp_path, CALLS, "0001", _chain("s", 1))
    _write(
        tmp_path,
        SESSIONS,
        "0001",
        [
            {"session_id": "s", "status": "finished"},
            {"session_id": "u", "metadata_json": "[1]"},
            {"session_id": "v", "status": "error", "metadata_json": '{"k": 1}'},
        ],
    )
    _write(
        tmp_path,
        REWARDS,
        "0001",
        [
            {"reward_id": "r1", "session_id": "s", "value": 1.0},
            {"reward_id": "r1", "session_id": "u", "value": float("inf")},
            {"reward_id": "r2", "session_id": "v", "value": None},
            {"reward_id": "r3", "session_id": "ghost", "value": 0.0},
        ],
    )
    Output.from_uri(str(tmp_path)).write_quarantine(
        "0009", orjson.dumps({"segment": "0009", "entry": 3, "reason": "ValueError: big"}) + b"\n"
    )
    assert validate_store(str(tmp_path)) == [
        f"session s: status 'finished' not in {SESSION_STATUSES}",
        "session u: metadata_json is a list, not a JSON object (readers skip this row)",
        "quarantined: segment 0009 entry 3 could not become a row (ValueError: big); kept in _quarantine/0009.jsonl",
        "reward_id r1 appears 2 times",
        "reward r1 (session u): value inf not finite",
        "reward r2 (session v): value None not finite",
        "reward r3: unknown session ghost",
    ]


def test_the_journals_rows_are_checked_unless_their_segment_is_in_shards(tmp_path: Path) -> None:
    writer = tmp_path / "_journal" / "w-x"
    writer.mkdir(parents=True)

    def segment(name: str, payloads: list[bytes]) -> None:
        (writer / f"{name}{journal.SEGMENT_SUFFIX}").write_bytes(
            journal.MAGIC + b"".join(journal.frame(p) for p in payloads)
        )

    record = make_record("j", [1, 2], [3], [])
    segment("0001", [call_entry(record, 0)])
    segment("0002", [row_entry(SESSIONS, {"session_id": "j", "status": "running"})])
    segment("0003", [row_entry(REWARDS, {"reward_id": "r", "session_id": "j", "value": 1.0})])
    assert validate_store(str(tmp_path)) == []
    # The call's segment became a shard that is unreadable: its journal copy is not read in its place.
    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "0001.parquet").write_bytes(b"junk")
    _write(tmp_path, REWARDS, "0003", [{"reward_id": "r", "session_id": "j", "value": 1.0}])
    problems = validate_store(str(tmp_path))
    assert problems[0].startswith("calls/0001.parquet: unreadable Parquet") and len(problems) == 1
    # A journaled reward of a session nobody knows is a finding too.
    segment("0004", [row_entry(REWARDS, {"reward_id": "q", "session_id": "nobody", "value": 1.0})])
    assert validate_store(str(tmp_path))[1:] == ["reward q: unknown session nobody"]


def test_a_remote_stores_shards_are_checked_through_its_own_filesystem(tmp_path: Path, monkeypatch) -> None:
    import pyarrow.fs as pafs

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    fs = pafs.SubTreeFileSystem(str(bucket), pafs.LocalFileSystem())
    monkeypatch.setattr(Output, "from_uri", classmethod(lambda cls, uri: cls(uri, fs, "traces", False)))
    monkeypatch.setenv("POLAR_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.chdir(tmp_path)  # "traces/calls/..." is no local path from here
    rows = _chain("s", 2)
    rows[1]["seq"] = 5
    Output.from_uri("mem://traces").write_shard(CALLS, "0001", pa.Table.from_pylist(rows, schema=SCHEMAS[CALLS]))
    assert validate_store("mem://traces") == [
        "session s: seq not contiguous from 0 (duplicated [], missing [1, 2, 3, 4])"
    ]
