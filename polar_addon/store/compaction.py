"""Prefix references: a session of T calls costs O(T) tokens on disk instead of O(T^2).

An agent's call k usually re-sends call k-1's prompt and response, then a few new messages. The writer keeps
the last few calls of each session in memory ("tips") and stores a new call's prompt as
``(prompt_ref, prompt_prefix_len, prompt_tail)``: the first prompt_prefix_len tokens of the referenced call's
prompt followed by its response, then the tail. Messages are stored the same way, counted in messages: the
referenced call's messages followed by its response rendered as an OpenAI assistant message, then a JSON
array tail. The reference is the tip with the longest common prefix, so an interleaved side call (a title
generator, a sub-agent) does not break the main chain.

Everything here is pure: ``encode_call`` on the write side, ``expand_session`` on the read side.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from polar_addon.canonical import AssistantMessage
from polar_addon.capture import CaptureRecord

# How many recent calls per session a new call may reference.
TIPS_PER_SESSION = 3


class ShardIntegrityError(Exception):
    """Shards contradict themselves (e.g. a prefix reference that resolves to nothing)."""


@dataclass
class Tip:
    record_id: str
    tokens: bytes  # prompt_ids + response_ids packed as int32, 4 bytes a token (Python ints would cost ~36)
    parts: list[bytes] | None  # each message as JSON, then the response message; None if not canonical


def _common_prefix(a: bytes, b: bytes) -> int:
    """Tokens in common at the start of two packed int32 sequences (bytes compare like memcmp)."""
    n = min(len(a), len(b)) // 4
    if a[: 4 * n] == b[: 4 * n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi], in tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_count(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def response_part(response_json: str) -> bytes | None:
    """The JSON of a call's response as the next call's history would carry it."""
    data = orjson.loads(response_json or "null")
    if not isinstance(data, dict):
        return None
    return orjson.dumps(AssistantMessage.from_dict(data).to_openai())


def message_parts(messages_json: str) -> list[bytes] | None:
    """Each message's JSON, or None when re-serializing would not give back the exact text."""
    try:
        messages = orjson.loads(messages_json)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(messages, list):
        return None
    parts = [orjson.dumps(m) for m in messages]
    if b"[" + b",".join(parts) + b"]" != messages_json.encode():
        return None
    return parts


def _pack(ids: list[int], name: str) -> bytes:
    # struct both checks the int32 range and packs in C: array.array("i", ids) took ~1 ms for 32k ids.
    try:
        return struct.pack(f"={len(ids)}i", *ids)
    except struct.error as exc:
        if "not an integer" in str(exc):
            raise TypeError(f"{name} must hold integers: {exc}") from exc
        raise ValueError(f"{name} holds a token id outside int32: {exc}") from exc


_PLAIN_FIELDS = (
    "record_id", "session_id", "seq", "api", "status", "task_id", "group_id", "sample_index", "harness",
    "requested_model", "served_model", "engine", "started_at", "engine_latency_s", "finished_at",
    "temperature", "top_p", "top_k", "max_tokens", "response_ids", "logprobs", "finish_reason",
    "matched_stop", "weight_version", "tools_json", "tool_choice_json", "response_json", "error",
)


def encode_call(record: CaptureRecord, tips: Sequence[Tip]) -> tuple[dict[str, Any], Tip | None]:
    """The stored row of a call (see shards.CALLS_SCHEMA) and the tip it becomes for later calls."""
    row = {name: getattr(record, name) for name in _PLAIN_FIELDS}
    prompt = record.prompt_ids
    prompt_arr = _pack(prompt, "prompt_ids")
    response_arr = _pack(record.response_ids, "response_ids")

    best_tokens, best_ref = 0, None
    if prompt:
        for tip in reversed(tips):  # latest first: on a tie the most recent call wins
            n = _common_prefix(prompt_arr, tip.tokens)
            if n > best_tokens:
                best_tokens, best_ref = n, tip.record_id
    row["prompt_len"] = len(prompt)
    row["prompt_ref"] = best_ref
    row["prompt_prefix_len"] = best_tokens
    row["prompt_tail"] = prompt[best_tokens:] if best_tokens else prompt

    parts = message_parts(record.messages_json)
    best_msgs, best_msg_ref = 0, None
    if parts is not None:
        for tip in reversed(tips):
            if tip.parts is not None:
                n = _common_count(parts, tip.parts)
                if n > best_msgs:
                    best_msgs, best_msg_ref = n, tip.record_id
    row["messages_count"] = len(parts) if parts is not None else None
    row["messages_ref"] = best_msg_ref
    row["messages_prefix_len"] = best_msgs
    row["messages_tail_json"] = (
        (b"[" + b",".join(parts[best_msgs:]) + b"]").decode() if best_msgs else record.messages_json
    )

    tip = None
    if record.status == "ok" and prompt:
        tip_parts = None
        if parts is not None:
            extra = response_part(record.response_json)
            tip_parts = parts + ([extra] if extra is not None else [])
        tip = Tip(record.record_id, prompt_arr + response_arr, tip_parts)
    return row, tip


def expand_session(rows: Sequence[dict[str, Any]]) -> Iterator[CaptureRecord]:
    """Rebuild full records from one session's stored rows, given in seq order."""
    tokens: dict[str, tuple[list[int], list[int]]] = {}
    messages: dict[str, tuple[str, str]] = {}
    parts_cache: dict[str, list[bytes]] = {}

    def tip_parts(ref: str) -> list[bytes]:
        cached = parts_cache.get(ref)
        if cached is None:
            messages_json, response_json = messages[ref]
            cached = [orjson.dumps(m) for m in orjson.loads(messages_json)]
            extra = response_part(response_json)
            if extra is not None:
                cached.append(extra)
            parts_cache[ref] = cached
        return cached

    for row in rows:
        rid = row["record_id"]
        tail = row["prompt_tail"] or []
        ref = row["prompt_ref"]
        if ref is None:
            prompt = list(tail)
        else:
            if ref not in tokens:
                raise ShardIntegrityError(f"call {rid}: prompt_ref {ref} is not an earlier call of its session")
            base_prompt, base_response = tokens[ref]
            n = row["prompt_prefix_len"]
            if n > len(base_prompt) + len(base_response):
                raise ShardIntegrityError(f"call {rid}: prompt_prefix_len {n} exceeds call {ref}")
            if n <= len(base_prompt):
                prompt = base_prompt[:n] + tail
            else:
                prompt = base_prompt + base_response[: n - len(base_prompt)] + tail
        response = row["response_ids"] or []
        tokens[rid] = (prompt, response)

        mref = row["messages_ref"]
        if mref is None:
            messages_json = row["messages_tail_json"]
        else:
            if mref not in messages:
                raise ShardIntegrityError(f"call {rid}: messages_ref {mref} is not an earlier call of its session")
            base = tip_parts(mref)
            n = row["messages_prefix_len"]
            if n > len(base):
                raise ShardIntegrityError(f"call {rid}: messages_prefix_len {n} exceeds call {mref}")
            tail_parts = [orjson.dumps(m) for m in orjson.loads(row["messages_tail_json"])]
            messages_json = (b"[" + b",".join(base[:n] + tail_parts) + b"]").decode()
        messages[rid] = (messages_json, row["response_json"])

        yield CaptureRecord(
            **{name: row[name] for name in _PLAIN_FIELDS if name not in ("response_ids", "logprobs")},
            prompt_ids=prompt,
            response_ids=response,
            logprobs=row["logprobs"] or [],
            messages_json=messages_json,
        )
