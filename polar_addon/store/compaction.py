"""Prefix references: a session of T calls costs O(T) tokens on disk instead of O(T^2).

An agent's call k usually re-sends call k-1's prompt and response, then a few new messages. The shard writer
keeps the last few calls of each session in memory ("tips") and stores a new call's prompt as
``(prompt_ref, prompt_prefix_len, prompt_tail)``: the first prompt_prefix_len tokens of the referenced call's
prompt followed by its response, then the tail. Messages are stored the same way, counted in messages: the
referenced call's messages followed by its response rendered as an OpenAI assistant message, then a JSON
array tail. The reference is the tip with the longest common prefix, so an interleaved side call (a title
generator, a sub-agent) does not break the main chain.

Compaction runs when a sealed journal segment becomes shards, off the proxy's latency path: the journal
holds whole records. Everything here is pure: ``encode_segment`` / ``encode_call`` on the write side,
``expand_session`` on the read side.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_addon.canonical import AssistantMessage
from polar_addon.capture import CaptureRecord
from polar_addon.store.entries import PLAIN_FIELDS, JournaledCall, decode_entry
from polar_addon.store.shards import KINDS, SESSIONS
from polar_addon.store.status import SessionStatus

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


class SessionTips:
    """The last few calls of each recent session, which later calls of that session may reference.

    Conversions stage their changes and commit them only once their shards are written, so a conversion
    retried after a failed write never lets a call reference itself or a later call.
    """

    def __init__(self, max_sessions: int = 1024) -> None:
        self.max_sessions = max_sessions
        self._tips: OrderedDict[str, list[Tip]] = OrderedDict()

    def staged(self) -> StagedTips:
        return StagedTips(self)

    def commit(self, staged: StagedTips) -> None:
        for sid, tips in staged.changes.items():
            if tips is None:
                self._tips.pop(sid, None)
                continue
            self._tips[sid] = tips
            self._tips.move_to_end(sid)
        while len(self._tips) > self.max_sessions:
            self._tips.popitem(last=False)


@dataclass
class StagedTips:
    base: SessionTips
    changes: dict[str, list[Tip] | None] = field(default_factory=dict)

    def get(self, sid: str) -> list[Tip]:
        if sid in self.changes:
            return self.changes[sid] or []
        return self.base._tips.get(sid, [])

    def push(self, sid: str, tip: Tip) -> None:
        self.changes[sid] = [*self.get(sid)[-(TIPS_PER_SESSION - 1) :], tip]

    def end(self, sid: str) -> None:
        """A session that ended keeps no tips (it is not expected to make more calls)."""
        self.changes[sid] = None


def encode_call(call: JournaledCall, tips: Sequence[Tip]) -> tuple[dict[str, Any], Tip | None]:
    """The stored row of a call (see shards.CALLS_SCHEMA) and the tip it becomes for later calls."""
    row = dict(call.row)
    row["response_ids"] = call.response_ids
    row["logprobs"] = call.logprobs
    prompt_arr = call.prompt
    prompt_len = len(prompt_arr) // 4

    best_tokens, best_ref = 0, None
    if prompt_len:
        for tip in reversed(tips):  # latest first: on a tie the most recent call wins
            n = _common_prefix(prompt_arr, tip.tokens)
            if n > best_tokens:
                best_tokens, best_ref = n, tip.record_id
    row["prompt_len"] = prompt_len
    row["prompt_ref"] = best_ref
    row["prompt_prefix_len"] = best_tokens
    row["prompt_tail"] = array.array("i", prompt_arr[4 * best_tokens :]).tolist()

    parts = message_parts(call.messages_json)
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
        (b"[" + b",".join(parts[best_msgs:]) + b"]").decode() if best_msgs else call.messages_json
    )

    tip = None
    if row["status"] == "ok" and prompt_len:
        tip_parts = None
        if parts is not None:
            extra = response_part(row["response_json"])
            tip_parts = parts + ([extra] if extra is not None else [])
        tip = Tip(row["record_id"], prompt_arr + call.response, tip_parts)
    return row, tip


def encode_segment(payloads: Sequence[bytes], tips: StagedTips) -> dict[str, list[dict[str, Any]]]:
    """A sealed journal segment's entries as stored rows per kind, calls compacted against ``tips``."""
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for payload in payloads:
        kind, entry = decode_entry(payload)
        if isinstance(entry, JournaledCall):
            sid = entry.row["session_id"]
            row, tip = encode_call(entry, tips.get(sid))
            if tip is not None:
                tips.push(sid, tip)
        else:
            row = entry
            if kind == SESSIONS and row.get("status") not in (None, SessionStatus.RUNNING):
                tips.end(row["session_id"])
        rows[kind].append(row)
    return rows


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
            if n < 0:  # a slice from the end: a prompt other than the one the row states
                raise ShardIntegrityError(f"call {rid}: prompt_prefix_len {n} is negative")
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
            if n < 0:
                raise ShardIntegrityError(f"call {rid}: messages_prefix_len {n} is negative")
            tail_parts = [orjson.dumps(m) for m in orjson.loads(row["messages_tail_json"])]
            messages_json = (b"[" + b",".join(base[:n] + tail_parts) + b"]").decode()
        messages[rid] = (messages_json, row["response_json"])

        yield CaptureRecord(
            **{name: row[name] for name in PLAIN_FIELDS},
            prompt_ids=prompt,
            response_ids=response,
            logprobs=row["logprobs"] or [],
            messages_json=messages_json,
        )
