"""Journal entries: how one append is laid out inside a journal segment.

A call entry holds the whole record: the prompt as int32 or as the engine's own id text (token_ids.IdText),
the response ids as int32, the logprobs as float64 (exact: JSON has no NaN and would round-trip floats
through text). It is built on the latency path, between the engine's answer and the harness's, so it
does as little as possible: scalar checks, packing what is not packed yet, a small JSON header. Prefix compaction
happens later, when a sealed segment becomes shards (``compaction.encode_segment``). Session and reward entries are
small JSON rows.

    call:   b"C" or b"T" <u32 header length> <u32 prompt bytes> <u32 response tokens>
            <header JSON: the plain fields, seq included> <prompt: int32s (C) or the engine's id text (T)>
            <response int32s> <logprob float64s> <messages JSON, the rest>
    other:  b"J" <JSON {"k": kind, "r": row}>
"""

from __future__ import annotations

import array
import struct
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

from polar_addon.capture import CaptureRecord
from polar_addon.store.shards import CALLS, SCHEMAS
from polar_addon.token_ids import IdText, pack_token_ids

_CALL = b"C"  # prompt as int32
_CALL_TEXT = b"T"  # prompt as the engine's JSON text of it (token_ids.IdText), parsed at shard time
_ROW = b"J"
_CALL_HEAD = struct.Struct("<III")

# Stored as they are; token arrays and messages travel separately (see compaction.encode_call).
PLAIN_FIELDS = (
    "record_id",
    "session_id",
    "seq",
    "api",
    "status",
    "task_id",
    "group_id",
    "sample_index",
    "harness",
    "requested_model",
    "served_model",
    "engine",
    "started_at",
    "engine_latency_s",
    "finished_at",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "finish_reason",
    "matched_stop",
    "weight_version",
    "tools_json",
    "tool_choice_json",
    "response_json",
    "error",
    "prompt_source",
    "prompt_reason",
    "parse_failures",
    "tool_call_parser",
    "role",
    "role_reason",
    "weight_versions_json",
)


@dataclass
class JournaledCall:
    """A call as its journal entry holds it: every array whole, the prompt still packed."""

    row: dict[str, Any]  # PLAIN_FIELDS
    prompt: bytes  # native int32, 4 bytes a token
    response: bytes  # the same for response_ids, as the entry held them (the tip of later calls needs them)
    response_ids: list[int]
    logprobs: list[float]
    messages_json: str


def _scalar_kinds(schema: pa.Schema) -> list[tuple[str, str]]:
    kinds = []
    for f in schema:
        if pa.types.is_integer(f.type):
            kinds.append((f.name, "int"))
        elif pa.types.is_floating(f.type):
            kinds.append((f.name, "float"))
        elif pa.types.is_string(f.type):
            kinds.append((f.name, "str"))
    return kinds


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SCALARS = {kind: _scalar_kinds(schema) for kind, schema in SCHEMAS.items()}


def coerce_scalars(kind: str, row: dict[str, Any]) -> None:
    """Fail at append time, not at shard time, when a field has the wrong type."""
    for name, expected in _SCALARS[kind]:
        value = row.get(name)
        if value is None:
            continue
        if expected == "str":
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        elif expected == "float":
            row[name] = float(value)
        else:
            if isinstance(value, float):
                if not value.is_integer():
                    raise TypeError(f"{name} must be an integer, got {value!r}")
                value = row[name] = int(value)
            if not _INT64_MIN <= value <= _INT64_MAX:
                # Acknowledged, it would stop the shard writer for every later record (issue 11).
                raise ValueError(f"{name} {value} does not fit the store's int64 column")


def call_entry(record: CaptureRecord, seq: int) -> bytes:
    row = {name: getattr(record, name) for name in PLAIN_FIELDS}
    row["seq"] = seq
    coerce_scalars(CALLS, row)
    if not isinstance(record.messages_json, str):
        raise TypeError("messages_json must be a string")
    if isinstance(record.prompt_ids, IdText):
        tag, prompt = _CALL_TEXT, record.prompt_ids.text
    else:
        tag, prompt = _CALL, pack_token_ids(record.prompt_ids, "prompt_ids")
    response = pack_token_ids(record.response_ids, "response_ids")
    if len(record.logprobs) != len(record.response_ids):
        raise ValueError(f"{len(record.logprobs)} logprobs for {len(record.response_ids)} response tokens")
    try:
        logprobs = array.array("d", record.logprobs).tobytes()
    except TypeError as exc:
        raise TypeError(f"logprobs must hold numbers: {exc}") from exc
    header = orjson.dumps(row)
    return b"".join(
        (
            tag,
            _CALL_HEAD.pack(len(header), len(prompt), len(response) // 4),
            header,
            prompt,
            response,
            logprobs,
            record.messages_json.encode(),
        )
    )


def row_entry(kind: str, row: dict[str, Any]) -> bytes:
    coerce_scalars(kind, row)
    return _ROW + orjson.dumps({"k": kind, "r": row})


def entry_header(payload: bytes) -> tuple[str, dict[str, Any]]:
    """The kind and the scalar fields of an entry, without unpacking any array (session ids, seqs)."""
    if payload[:1] in (_CALL, _CALL_TEXT):
        header_len = _CALL_HEAD.unpack_from(payload, 1)[0]
        start = 1 + _CALL_HEAD.size
        return CALLS, orjson.loads(payload[start : start + header_len])
    entry = orjson.loads(payload[1:])
    return entry["k"], entry["r"]


def decode_entry(payload: bytes) -> tuple[str, JournaledCall | dict[str, Any]]:
    tag = payload[:1]
    if tag not in (_CALL, _CALL_TEXT):
        return entry_header(payload)
    header_len, prompt_bytes, n_response = _CALL_HEAD.unpack_from(payload, 1)
    pos = 1 + _CALL_HEAD.size
    row = orjson.loads(payload[pos : pos + header_len])
    pos += header_len
    prompt = payload[pos : pos + prompt_bytes]
    pos += prompt_bytes
    response = payload[pos : pos + 4 * n_response]
    response_ids = array.array("i", response).tolist()
    pos += 4 * n_response
    logprobs = array.array("d", payload[pos : pos + 8 * n_response]).tolist()
    pos += 8 * n_response
    call = JournaledCall(row, prompt, response, response_ids, logprobs, payload[pos:].decode())
    if tag == _CALL_TEXT:
        try:
            call.prompt = IdText(prompt).tobytes()
        except ValueError as exc:
            # The one thing the capture path does not check (an id past int32: see IdText) shows here,
            # after the call was answered: keep the call, as failed, rather than block the segment.
            row.update(status="failed", error=f"engine answer unusable: prompt_token_ids: {exc}")
            call.prompt, call.response, call.response_ids, call.logprobs = b"", b"", [], []
    return CALLS, call
