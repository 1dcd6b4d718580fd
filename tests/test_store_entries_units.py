"""Journal entries (polar_addon.store.entries): what a field's type must be at append time, the int64 bounds, the
byte layout of a call entry, and what decoding gives back, including an engine's prompt text that cannot be
stored."""

from __future__ import annotations

import array
import math
import struct

import orjson
import pyarrow as pa
import pytest

from polar_addon.capture import CaptureRecord, new_record_id
from polar_addon.store.entries import (
    PLAIN_FIELDS,
    JournaledCall,
    _scalar_kinds,
    call_entry,
    coerce_scalars,
    decode_entry,
    entry_header,
    row_entry,
)
from polar_addon.store.shards import CALLS, REWARDS, SESSIONS
from polar_addon.token_ids import IdText

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _record(**fields) -> CaptureRecord:
    values = dict(
        record_id=new_record_id(),
        session_id="s",
        seq=-1,
        api="openai_chat",
        status="ok",
        prompt_ids=[1, 2, 70000],
        response_ids=[4, 5],
        logprobs=[-0.5, float("-inf")],
        messages_json='[{"role":"user","content":"é"}]',
        temperature=1,
        max_tokens=64,
    )
    values.update(fields)
    return CaptureRecord(**values)


def test_the_checked_scalar_columns_are_a_schemas_integers_floats_and_strings() -> None:
    schema = pa.schema(
        [
            ("a", pa.int64()),
            ("b", pa.list_(pa.int32())),
            ("c", pa.float64()),
            ("d", pa.string()),
            ("e", pa.int32()),
            ("f", pa.bool_()),
            ("g", pa.float32()),
        ]
    )
    assert _scalar_kinds(schema) == [("a", "int"), ("c", "float"), ("d", "str"), ("e", "int"), ("g", "float")]
    assert _scalar_kinds(pa.schema([])) == []


def test_each_scalar_column_takes_its_own_type_and_numbers_are_normalised() -> None:
    row = {"record_id": "r", "session_id": "s", "seq": 3.0, "temperature": 1, "top_k": 40, "api": None}
    coerce_scalars(CALLS, row)
    assert row == {"record_id": "r", "session_id": "s", "seq": 3, "temperature": 1.0, "top_k": 40, "api": None}
    assert type(row["seq"]) is int and type(row["temperature"]) is float and type(row["top_k"]) is int
    reward = {"reward_id": "r", "session_id": "s", "value": 1}
    coerce_scalars(REWARDS, reward)
    assert type(reward["value"]) is float
    session = {"session_id": "s", "sample_index": 2.0, "updated_at": 5}
    coerce_scalars(SESSIONS, session)
    assert session == {"session_id": "s", "sample_index": 2, "updated_at": 5.0} and type(session["sample_index"]) is int


@pytest.mark.parametrize(
    ("kind", "row", "error", "message"),
    [
        (CALLS, {"api": 3}, TypeError, "api must be a string, got int"),
        (CALLS, {"session_id": b"s"}, TypeError, "session_id must be a string, got bytes"),
        (CALLS, {"top_k": True}, TypeError, "top_k must be a number, got True"),
        (CALLS, {"temperature": False}, TypeError, "temperature must be a number, got False"),
        (CALLS, {"temperature": "1.0"}, TypeError, "temperature must be a number, got '1.0'"),
        (CALLS, {"max_tokens": 2.5}, TypeError, "max_tokens must be an integer, got 2.5"),
        (CALLS, {"max_tokens": float("nan")}, TypeError, "max_tokens must be an integer, got nan"),
        (CALLS, {"max_tokens": float("inf")}, TypeError, "max_tokens must be an integer, got inf"),
        (CALLS, {"max_tokens": INT64_MAX + 1}, ValueError, f"max_tokens {INT64_MAX + 1} does not fit"),
        (CALLS, {"seq": INT64_MIN - 1}, ValueError, f"seq {INT64_MIN - 1} does not fit the store's int64 column"),
        (CALLS, {"max_tokens": 2.0**63}, ValueError, f"max_tokens {2**63} does not fit"),
        (SESSIONS, {"sample_index": 2**63}, ValueError, "sample_index 9223372036854775808 does not fit"),
        (REWARDS, {"value": "1"}, TypeError, "value must be a number, got '1'"),
        (REWARDS, {"name": 1.0}, TypeError, "name must be a string, got float"),
    ],
)
def test_a_field_of_the_wrong_type_or_past_int64_fails_at_append(kind, row, error, message) -> None:
    with pytest.raises(error) as caught:
        coerce_scalars(kind, dict(row))
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_int64_bounds_themselves_are_accepted() -> None:
    for value in (INT64_MAX, INT64_MIN, 0, -1):
        row = {"max_tokens": value}
        coerce_scalars(CALLS, row)
        assert row == {"max_tokens": value}


def test_a_call_entry_is_laid_out_as_documented_and_decodes_back_exactly() -> None:
    record = _record()
    payload = call_entry(record, 7)
    header_len, prompt_bytes, n_response = struct.unpack_from("<III", payload, 1)
    assert payload[:1] == b"C" and (prompt_bytes, n_response) == (12, 2)
    header = orjson.loads(payload[13 : 13 + header_len])
    assert list(header) == list(PLAIN_FIELDS)
    assert header["seq"] == 7 and header["record_id"] == record.record_id and header["temperature"] == 1.0
    body = payload[13 + header_len :]
    assert body[:12] == array.array("i", [1, 2, 70000]).tobytes()
    assert body[12:20] == array.array("i", [4, 5]).tobytes()
    assert body[20:36] == array.array("d", [-0.5, float("-inf")]).tobytes()
    assert body[36:].decode() == record.messages_json

    kind, call = decode_entry(payload)
    assert kind == CALLS and isinstance(call, JournaledCall)
    assert call.row == header
    assert call.prompt == array.array("i", [1, 2, 70000]).tobytes()
    assert call.response == array.array("i", [4, 5]).tobytes()
    assert call.response_ids == [4, 5]
    assert call.logprobs[0] == -0.5 and math.isinf(call.logprobs[1]) and call.logprobs[1] < 0
    assert call.messages_json == record.messages_json
    assert entry_header(payload) == (CALLS, header)


def test_token_ids_are_kept_as_given_over_the_whole_int32_range() -> None:
    ids = [0, -1, 2**31 - 1, -(2**31)]
    _, call = decode_entry(call_entry(_record(prompt_ids=ids, response_ids=ids, logprobs=[0.0] * 4), 0))
    assert call.response_ids == ids and array.array("i", call.prompt).tolist() == ids


def test_an_empty_call_decodes_to_empty_arrays() -> None:
    record = _record(status="failed", prompt_ids=[], response_ids=[], logprobs=[], messages_json="", error="down")
    kind, call = decode_entry(call_entry(record, 0))
    assert kind == CALLS and (call.prompt, call.response, call.response_ids, call.logprobs) == (b"", b"", [], [])
    assert call.messages_json == "" and call.row["status"] == "failed" and call.row["error"] == "down"


def test_a_prompt_as_the_engines_id_text_is_stored_as_text_and_packed_when_decoded() -> None:
    payload = call_entry(_record(prompt_ids=IdText(b"1,2,70000")), 0)
    header_len, prompt_bytes, _ = struct.unpack_from("<III", payload, 1)
    assert payload[:1] == b"T" and prompt_bytes == len(b"1,2,70000")
    assert payload[13 + header_len : 13 + header_len + prompt_bytes] == b"1,2,70000"
    _, call = decode_entry(payload)
    assert call.prompt == array.array("i", [1, 2, 70000]).tobytes()
    assert call.response_ids == [4, 5] and call.row["status"] == "ok" and call.row["error"] is None
    assert entry_header(payload)[1]["status"] == "ok"


def test_an_id_text_past_int32_keeps_the_call_as_failed_without_tokens() -> None:
    record = _record(prompt_ids=IdText(b"1,2147483648"))
    _, call = decode_entry(call_entry(record, 4))
    assert call.row["status"] == "failed" and call.row["seq"] == 4 and call.row["record_id"] == record.record_id
    assert call.row["error"] == "engine answer unusable: prompt_token_ids: a token id does not fit int32"
    assert (call.prompt, call.response, call.response_ids, call.logprobs) == (b"", b"", [], [])
    assert call.messages_json == record.messages_json
    # The largest int32 id is stored.
    _, call = decode_entry(call_entry(_record(prompt_ids=IdText(b"2147483647")), 0))
    assert call.prompt == array.array("i", [2147483647]).tobytes() and call.row["status"] == "ok"


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"messages_json": None}, TypeError, "messages_json must be a string"),
        ({"logprobs": [-0.5]}, ValueError, "1 logprobs for 2 response tokens"),
        ({"logprobs": [-0.5, -0.5, -0.5]}, ValueError, "3 logprobs for 2 response tokens"),
        ({"logprobs": [-0.5, "x"]}, TypeError, "logprobs must hold numbers: "),
        ({"response_ids": [1, 2**31], "logprobs": [0.0, 0.0]}, ValueError, "response_ids holds a token id outside"),
        ({"prompt_ids": [1.5]}, TypeError, "prompt_ids must hold integers"),
        ({"temperature": "hot"}, TypeError, "temperature must be a number, got 'hot'"),
    ],
)
def test_a_call_that_cannot_be_stored_fails_at_append(fields, error, message) -> None:
    with pytest.raises(error) as caught:
        call_entry(_record(**fields), 0)
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_row_entry_is_its_kind_and_its_checked_row() -> None:
    payload = row_entry(REWARDS, {"reward_id": "r", "session_id": "s", "value": 1})
    assert payload == b'J{"k":"rewards","r":{"reward_id":"r","session_id":"s","value":1.0}}'
    assert entry_header(payload) == (REWARDS, {"reward_id": "r", "session_id": "s", "value": 1.0})
    assert decode_entry(payload) == (REWARDS, {"reward_id": "r", "session_id": "s", "value": 1.0})
    with pytest.raises(TypeError, match="value must be a number"):
        row_entry(REWARDS, {"reward_id": "r", "session_id": "s", "value": "1"})
