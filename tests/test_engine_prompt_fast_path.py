"""The prompt ids of an engine answer kept as the engine's text (IdText): the same ids the general JSON path
reads, any answer the fast path is not sure about goes down the general path, and the journal keeps them."""

from __future__ import annotations

import json
import random
from array import array

import orjson
import pytest

from polar_addon.capture import CaptureRecord
from polar_addon.engines.openai_compat import cut_prompt_ids, parse_chat_response
from polar_addon.store.compaction import SessionTips, encode_segment
from polar_addon.store.entries import call_entry
from polar_addon.token_ids import IdText
from tests.test_engine_sglang import IDS, PROMPT, sglang_answer


def _vllm_answer(prompt: list[int]) -> dict:
    return sglang_answer(token_ids=IDS) | {"prompt_token_ids": prompt}


def test_fast_path_reads_exactly_what_the_json_path_reads() -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(0, 2**31) for _ in range(5000)] + [0, 2**31 - 1, 151_643]
    for answer in (_vllm_answer(prompt), sglang_answer(prompt_token_ids=prompt, token_ids=IDS)):
        content = orjson.dumps(answer)
        cut = cut_prompt_ids(content)
        assert cut is not None
        rest, ids = cut
        assert isinstance(ids, IdText) and len(ids) == len(prompt) and list(ids) == prompt and ids == prompt
        fast = parse_chat_response(orjson.loads(rest), prompt_ids=ids)
        general = parse_chat_response(orjson.loads(content))
        assert list(fast.prompt_ids) == list(general.prompt_ids) == prompt
        assert (fast.response_ids, fast.logprobs, fast.message) == (
            general.response_ids,
            general.logprobs,
            general.message,
        )


def test_spaced_json_takes_the_general_path() -> None:
    for text in (json.dumps(_vllm_answer(PROMPT)), json.dumps(_vllm_answer(PROMPT), indent=2)):
        assert cut_prompt_ids(text.encode()) is None


@pytest.mark.parametrize(
    "array_text",
    [
        b"1.5,2",
        b"1,2,",
        b"1,2, ",
        b"1,,2",
        b",1",
        b"1 2",
        b"--1",
        b"1,-",
        b"-",
        b"-5,1",
        b"+5",
        b"true,1",
        b"null",
        b'"1",2',
        b"[1],2",
    ],
)
def test_anything_unusual_takes_the_general_path(array_text: bytes) -> None:
    content = b'{"choices":[],"prompt_token_ids":[' + array_text + b"]}"
    assert cut_prompt_ids(content) is None


def test_key_twice_or_not_an_array_takes_the_general_path() -> None:
    twice = orjson.dumps(sglang_answer(prompt_token_ids=PROMPT) | {"prompt_token_ids": PROMPT})
    assert cut_prompt_ids(twice) is None
    as_value = orjson.dumps(sglang_answer(input_token_ids=PROMPT, name="prompt_token_ids"))
    assert cut_prompt_ids(as_value) is None
    assert cut_prompt_ids(b'{"prompt_token_ids":null}') is None
    # Inside a string the quotes are escaped, so the key never matches there.
    in_text = orjson.dumps(_vllm_answer(PROMPT) | {"note": 'say "prompt_token_ids": [9, 9]'})
    _, ids = cut_prompt_ids(in_text)  # type: ignore[misc]
    assert list(ids) == PROMPT


def test_empty_prompt_is_cut_as_empty_and_then_refused() -> None:
    content = orjson.dumps(_vllm_answer([]))  # "prompt_token_ids":[]
    rest, ids = cut_prompt_ids(content)  # type: ignore[misc]
    assert len(ids) == 0
    with pytest.raises(Exception, match="no prompt token ids"):
        parse_chat_response(orjson.loads(rest), prompt_ids=ids)


def test_id_text_checks_syntax_at_once_and_range_on_use() -> None:
    assert len(IdText(b"")) == 0 and list(IdText(b"")) == []
    ids = IdText(b"5,0,151643")
    assert len(ids) == 3 and ids[2] == 151643 and ids[1:] == array("i", [0, 151643]) and ids == [5, 0, 151643]
    assert ids == IdText(b"5,0,151643") and ids != [5, 0] and ids.tobytes() == array("i", [5, 0, 151643]).tobytes()
    for bad in (b"1,", b",1", b"1,,2", b",,", b"1 ,2", b"-1", b"1.0", b"1e3"):
        assert IdText.parse(bad) is None, bad
    huge = IdText(b"1,2147483648")  # passes the capture-time check; the value fails when read
    assert len(huge) == 2
    with pytest.raises(ValueError, match="int32"):
        huge.tobytes()


def _record(prompt, seq: int) -> CaptureRecord:
    return CaptureRecord(
        record_id=f"r{seq}",
        session_id="s",
        seq=seq,
        api="openai_chat",
        status="ok",
        prompt_ids=prompt,
        response_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        messages_json="[]",
    )


def test_journal_keeps_the_text_and_the_shard_writer_reads_it() -> None:
    entries = [
        call_entry(_record(IdText(b"1,2,3"), 0), 0),
        call_entry(_record(IdText(b"1,2,3,7,8,4"), 1), 1),
        call_entry(_record([1, 2, 3, 7, 8, 4, 9], 2), 2),
    ]
    rows = encode_segment(entries, SessionTips().staged())["calls"]
    assert [r["prompt_len"] for r in rows] == [3, 6, 7]
    assert rows[0]["prompt_tail"] == [1, 2, 3] and rows[1]["prompt_ref"] == "r0" and rows[1]["prompt_tail"] == [4]
    assert rows[2]["prompt_ref"] == "r1" and rows[2]["prompt_tail"] == [9]


def test_an_id_past_int32_makes_that_call_failed_not_the_segment() -> None:
    entries = [call_entry(_record(IdText(b"1,4294967296"), 0), 0), call_entry(_record(IdText(b"1,2"), 1), 1)]
    huge, good = encode_segment(entries, SessionTips().staged())["calls"]
    assert huge["status"] == "failed" and "int32" in huge["error"] and huge["prompt_len"] == 0
    assert huge["response_ids"] == [] and huge["logprobs"] == []
    assert good["status"] == "ok" and good["prompt_tail"] == [1, 2]
