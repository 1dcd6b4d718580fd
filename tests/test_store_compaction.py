"""Prefix references on hand-made calls (polar_addon/store/compaction.py): which earlier call a call
references, what it stores, and how reading rebuilds it exactly. Pure functions, no store."""

from __future__ import annotations

import array
from typing import Any

import orjson
import pytest

from polar_addon.capture import CaptureRecord
from polar_addon.store.compaction import (
    TIPS_PER_SESSION,
    SessionTips,
    ShardIntegrityError,
    Tip,
    _common_count,
    _common_prefix,
    encode_call,
    encode_segment,
    expand_session,
    message_parts,
    response_part,
)
from polar_addon.store.entries import call_entry, decode_entry, row_entry

SYS = {"role": "system", "content": "agent"}
TASK = {"role": "user", "content": "fix it"}


def packed(ids: list[int]) -> bytes:
    return array.array("i", ids).tobytes()


def record(
    seq: int,
    prompt: list[int],
    messages: list[dict[str, Any]] | None = None,
    *,
    status: str = "ok",
    response: tuple[int, ...] = (7, 8),
    content: str = "ok",
    sid: str = "s",
) -> CaptureRecord:
    return CaptureRecord(
        record_id=f"r{seq}",
        session_id=sid,
        seq=seq,
        api="openai_chat",
        status=status,
        prompt_ids=prompt,
        response_ids=list(response),
        logprobs=[-0.5] * len(response),
        messages_json=orjson.dumps(messages if messages is not None else [SYS, TASK]).decode(),
        response_json=orjson.dumps({"content": content, "reasoning": None, "tool_calls": []}).decode(),
    )


def journaled(rec: CaptureRecord):  # noqa: ANN201 - a JournaledCall
    return decode_entry(call_entry(rec, rec.seq))[1]


def test_common_prefix_counts_tokens_not_bytes() -> None:
    assert _common_prefix(packed([1, 2, 3]), packed([1, 2, 3])) == 3
    assert _common_prefix(packed([1, 2, 3, 4]), packed([1, 2])) == 2
    assert _common_prefix(packed([1, 2]), packed([1, 2, 3, 4])) == 2
    for k in range(6):  # every position of the first difference, through the binary search
        a = list(range(1, 7))
        b = a[:k] + [99] + a[k + 1 :]
        assert _common_prefix(packed(a), packed(b)) == k
    assert _common_prefix(packed([256]), packed([257])) == 0  # a difference in any byte of the first token
    assert _common_prefix(b"", packed([1])) == 0


def test_common_count_stops_at_the_first_different_part() -> None:
    assert _common_count([b"a", b"b", b"c"], [b"a", b"x", b"c"]) == 1
    assert _common_count([b"a", b"b"], [b"a", b"b", b"c"]) == 2
    assert _common_count([], [b"a"]) == 0


def test_response_part_is_the_assistant_message_the_next_call_carries() -> None:
    assert response_part("null") is None and response_part("") is None and response_part("[1]") is None
    message = {"content": "hi", "reasoning": "r", "tool_calls": [{"id": "c", "name": "bash", "arguments": "{}"}]}
    assert orjson.loads(response_part(orjson.dumps(message).decode())) == {
        "role": "assistant",
        "content": "hi",
        "reasoning_content": "r",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{}"}}],
    }


def test_message_parts_only_when_reserializing_gives_back_the_exact_text() -> None:
    assert message_parts('[{"role":"user","content":"a"},{"a":1}]') == [b'{"role":"user","content":"a"}', b'{"a":1}']
    assert message_parts("[]") == []
    assert message_parts('[{"role": "user"}]') is None  # spaces: the parts would not join back to the text
    assert message_parts('{"role":"user"}') is None
    assert message_parts("[{") is None


def test_tips_keep_the_last_calls_of_the_most_recent_sessions() -> None:
    tips = SessionTips(max_sessions=2)
    staged = tips.staged()
    for i in range(TIPS_PER_SESSION + 1):
        staged.push("a", Tip(f"a{i}", b"", None))
    assert [t.record_id for t in staged.get("a")] == [f"a{i}" for i in range(1, TIPS_PER_SESSION + 1)]
    assert tips.staged().get("a") == []  # nothing is visible before the commit
    staged.push("b", Tip("b0", b"", None))
    tips.commit(staged)
    later = tips.staged()
    assert [t.record_id for t in later.get("b")] == ["b0"] and len(later.get("a")) == TIPS_PER_SESSION
    later.push("a", Tip("a9", b"", None))
    later.push("c", Tip("c0", b"", None))
    tips.commit(later)  # a was touched again after b: b is the least recent and goes
    after = tips.staged()
    assert after.get("b") == [] and after.get("a")[-1].record_id == "a9" and after.get("c")[0].record_id == "c0"
    after.end("a")
    assert after.get("a") == []
    tips.commit(after)
    assert tips.staged().get("a") == [] and tips.staged().get("c")[0].record_id == "c0"
    # ending a session never seen, then more changes in the same conversion: all of them apply
    last = tips.staged()
    last.end("never-seen")
    last.push("d", Tip("d0", b"", None))
    tips.commit(last)
    assert tips.staged().get("d")[0].record_id == "d0"


def test_tips_are_kept_for_1024_sessions_by_default() -> None:
    tips = SessionTips()
    staged = tips.staged()
    for i in range(1025):
        staged.push(f"s{i}", Tip(f"r{i}", b"", None))
    tips.commit(staged)
    assert tips.staged().get("s0") == [] and tips.staged().get("s1")[0].record_id == "r1"


def test_a_call_references_the_tip_sharing_the_longest_prefix_latest_on_a_tie() -> None:
    first = journaled(record(0, [1, 2, 3]))
    _, tip0 = encode_call(first, [])
    side = journaled(record(1, [1, 2, 9], [SYS, TASK, {"role": "user", "content": "title?"}]))
    _, tip1 = encode_call(side, [tip0])
    assert tip0 is not None and tip1 is not None and tip0.tokens == packed([1, 2, 3, 7, 8])
    nxt = journaled(record(2, [1, 2, 3, 7, 8, 4], [SYS, TASK, {"role": "assistant", "content": "ok"}, TASK, TASK]))
    row, tip2 = encode_call(nxt, [tip0, tip1])
    assert (row["prompt_ref"], row["prompt_prefix_len"], row["prompt_tail"], row["prompt_len"]) == ("r0", 5, [4], 6)
    assert type(row["prompt_len"]) is int
    assert (row["messages_ref"], row["messages_prefix_len"], row["messages_count"]) == ("r0", 3, 5)
    assert row["messages_tail_json"] == orjson.dumps([TASK, TASK]).decode()
    assert tip2 is not None and tip2.parts is not None and len(tip2.parts) == 6
    # the same prefix with two tips: the later one is referenced
    twin = journaled(record(3, [1, 2, 3], [SYS, TASK]))
    _, tip3 = encode_call(twin, [])
    again, _ = encode_call(journaled(record(4, [1, 2, 3, 7, 8, 5], [SYS, TASK, TASK])), [tip0, tip3])
    assert again["prompt_ref"] == "r3" and again["messages_ref"] == "r3"


def test_a_call_sharing_nothing_is_stored_whole() -> None:
    _, tip0 = encode_call(journaled(record(0, [1, 2])), [])
    messages = [{"role": "system", "content": "other"}]
    row, _ = encode_call(journaled(record(1, [5, 6], messages)), [tip0])
    assert (row["prompt_ref"], row["prompt_prefix_len"], row["prompt_tail"]) == (None, 0, [5, 6])
    assert (row["messages_ref"], row["messages_prefix_len"]) == (None, 0)
    assert row["messages_tail_json"] == orjson.dumps(messages).decode()


def test_failed_or_promptless_calls_are_no_tips_and_odd_json_is_stored_as_is() -> None:
    assert encode_call(journaled(record(0, [1, 2], status="failed")), [])[1] is None
    assert encode_call(journaled(record(1, [])), [])[1] is None
    spaced = record(2, [1, 2])
    spaced.messages_json = '[{"role": "user", "content": "a"}]'
    row, tip = encode_call(journaled(spaced), [])
    assert tip is not None and tip.parts is None
    assert (row["messages_count"], row["messages_tail_json"]) == (None, spaced.messages_json)
    no_response = record(3, [1, 2])
    no_response.response_json = "null"
    _, tip = encode_call(journaled(no_response), [])
    assert tip is not None and tip.parts == [orjson.dumps(SYS), orjson.dumps(TASK)]


def test_a_finished_session_drops_its_tips_a_running_one_keeps_them() -> None:
    tips = SessionTips()
    entries = [
        call_entry(record(0, [1, 2], sid="a"), 0),
        call_entry(record(0, [1, 2], sid="b"), 0),
        row_entry("sessions", {"session_id": "a", "status": "completed"}),
        row_entry("sessions", {"session_id": "b", "status": "running"}),
        row_entry("sessions", {"session_id": "c"}),
    ]
    staged = tips.staged()
    rows = encode_segment(entries, staged)
    assert [r["session_id"] for r in rows["calls"]] == ["a", "b"] and len(rows["sessions"]) == 3
    assert staged.get("a") == [] and [t.record_id for t in staged.get("b")] == ["r0"]


def _rows(records: list[CaptureRecord]) -> list[dict[str, Any]]:
    return encode_segment([call_entry(r, r.seq) for r in records], SessionTips().staged())["calls"]


def test_expand_session_rebuilds_every_call_exactly() -> None:
    history = [SYS, TASK, {"role": "assistant", "content": "ok"}]
    records = [
        record(0, [1, 2, 3]),
        record(1, [1, 2, 3, 7, 8, 4], history + [TASK]),
        record(2, [1, 2], [SYS]),  # a prefix shorter than the referenced prompt
        record(3, [1, 2, 3, 7], history[:2] + [{"role": "assistant", "content": "other"}]),
    ]
    rows = _rows(records)
    assert [r["prompt_ref"] for r in rows] == [None, "r0", "r1", "r1"]
    back = list(expand_session(rows))
    for original, rebuilt in zip(records, back, strict=True):
        assert (list(rebuilt.prompt_ids), rebuilt.messages_json) == (list(original.prompt_ids), original.messages_json)
        assert (rebuilt.response_ids, rebuilt.logprobs, rebuilt.record_id) == (
            original.response_ids,
            original.logprobs,
            original.record_id,
        )


def test_a_prefix_reaching_into_the_referenced_response_takes_only_its_start() -> None:
    rows = _rows([record(0, [1, 2, 3], response=(7, 8)), record(1, [1, 2, 3, 7, 9])])
    assert (rows[1]["prompt_ref"], rows[1]["prompt_prefix_len"]) == ("r0", 4)
    assert [list(r.prompt_ids) for r in expand_session(rows)] == [[1, 2, 3], [1, 2, 3, 7, 9]]


def test_expand_session_refuses_references_that_resolve_to_nothing() -> None:
    rows = _rows([record(0, [1, 2, 3]), record(1, [1, 2, 3, 7, 8, 4], [SYS, TASK, TASK])])
    with pytest.raises(ShardIntegrityError, match="^call r1: prompt_ref r0 is not an earlier call of its session$"):
        list(expand_session(rows[1:]))
    too_long = dict(rows[1], prompt_prefix_len=6)
    with pytest.raises(ShardIntegrityError, match="^call r1: prompt_prefix_len 6 exceeds call r0$"):
        list(expand_session([rows[0], too_long]))
    assert len(list(expand_session([rows[0], dict(rows[1], prompt_prefix_len=5)]))) == 2  # prompt + response: fine
    orphan = dict(rows[1], prompt_ref=None, messages_ref="r9")
    with pytest.raises(ShardIntegrityError, match="^call r1: messages_ref r9 is not an earlier call of its session$"):
        list(expand_session([rows[0], orphan]))
    too_many = dict(rows[1], messages_prefix_len=4)
    with pytest.raises(ShardIntegrityError, match="^call r1: messages_prefix_len 4 exceeds call r0$"):
        list(expand_session([rows[0], too_many]))


def test_expand_session_refuses_a_negative_prefix_length_instead_of_slicing_from_the_end() -> None:
    """A forged or corrupted row with prompt_prefix_len -1 would otherwise train on its referenced call's tokens but
    the last, a prompt the row never stated (the validator reports it too)."""
    rows = _rows([record(0, [1, 2, 3]), record(1, [1, 2, 3, 7, 8, 4], [SYS, TASK, TASK])])
    with pytest.raises(ShardIntegrityError, match="^call r1: prompt_prefix_len -1 is negative$"):
        list(expand_session([rows[0], dict(rows[1], prompt_prefix_len=-1)]))
    with pytest.raises(ShardIntegrityError, match="^call r1: messages_prefix_len -1 is negative$"):
        list(expand_session([rows[0], dict(rows[1], messages_prefix_len=-1)]))
    assert len(list(expand_session([rows[0], dict(rows[1], prompt_prefix_len=0, prompt_tail=[1, 2, 3, 7, 8, 4])])))
