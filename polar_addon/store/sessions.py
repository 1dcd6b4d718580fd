"""The sessions view: session_update events, rewards and call counts merged into one record per session."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_addon.store.rewards import RewardRecord
from polar_addon.store.status import SessionStatus

log = logging.getLogger("polar")

_MERGED = ("task_id", "group_id", "sample_index", "harness", "status", "started_at", "ended_at")


def row_metadata(update: dict[str, Any]) -> dict[str, Any] | None:
    """A sessions row's metadata, or ValueError when its ``metadata_json`` is not a JSON object."""
    text = update.get("metadata_json")
    if not text:
        return None
    try:
        metadata = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise ValueError("metadata_json is not valid JSON") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata_json is a {type(metadata).__name__}, not a JSON object")
    return metadata


@dataclass
class SessionRecord:
    session_id: str
    task_id: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    harness: str | None = None
    status: str | None = None  # running | completed | timeout | error | agent_error; None: never reported
    started_at: float | None = None
    ended_at: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)  # latest value per reward name
    reward_history: list[RewardRecord] = field(default_factory=list)  # every reward event, oldest first
    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0  # summed over the session's ok calls
    response_tokens: int = 0

    @property
    def reward(self) -> float | None:
        return self.rewards.get("reward")


def merge_sessions(
    updates: Iterable[dict[str, Any]],
    rewards: Iterable[RewardRecord],
    calls: Iterable[dict[str, Any]],
) -> list[SessionRecord]:
    """``updates`` are sessions-shard rows oldest first, ``rewards`` oldest first, ``calls`` rows with
    session_id, seq, status, task_id, group_id, sample_index, harness, started_at, prompt_len, response_len.
    An explicit update wins over what the calls imply, later over earlier, except that ``error`` is final (no later
    status replaces it); a reward ends a session still ``running`` as completed."""
    sessions: dict[str, SessionRecord] = {}

    def get(sid: str) -> SessionRecord:
        record = sessions.get(sid)
        if record is None:
            record = sessions[sid] = SessionRecord(sid)
        return record

    for update in updates:
        try:
            metadata = row_metadata(update)
        except ValueError as exc:
            # One bad row (an older proxy let any metadata in) must not take every reader down.
            log.warning("polar: skipped a sessions row of session %r: %s", update["session_id"], exc)
            continue
        record = get(update["session_id"])
        for name in _MERGED:
            if update.get(name) is not None:
                if name == "status" and record.status == SessionStatus.ERROR and update[name] != SessionStatus.ERROR:
                    # An error is final: the proxy ends a session whose engine died (or a Ray driver one whose
                    # node died) while its runner may still post completed with a reward afterwards; that
                    # session's traces are broken and must stay masked.
                    continue
                setattr(record, name, update[name])
        if metadata:
            record.metadata.update(metadata)
    explicit = {sid: (r.task_id, r.group_id, r.sample_index, r.harness, r.started_at) for sid, r in sessions.items()}

    for call in sorted(calls, key=lambda c: (c["session_id"], c["seq"])):
        sid = call["session_id"]
        record = get(sid)
        record.calls += 1
        if call["status"] != "ok":
            record.failed_calls += 1
        else:
            record.prompt_tokens += call["prompt_len"] or 0
            record.response_tokens += call["response_len"] or 0
        given = explicit.get(sid, (None,) * 5)
        for i, name in enumerate(("task_id", "group_id", "sample_index", "harness")):
            if given[i] is None and getattr(record, name) is None and call.get(name) is not None:
                setattr(record, name, call[name])
        if given[4] is None and call.get("started_at"):
            record.started_at = min(record.started_at or call["started_at"], call["started_at"])

    for reward in rewards:
        record = get(reward.session_id)
        record.reward_history.append(reward)
        record.rewards[reward.name] = reward.value
        if record.status == SessionStatus.RUNNING:
            # A reward is an outcome: the episode is over unless a status said how it ended.
            record.status = SessionStatus.COMPLETED.value
    return sorted(sessions.values(), key=lambda s: s.session_id)
