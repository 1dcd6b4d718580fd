"""Rewards: one row per reward event; a session's value for a reward name is its latest event."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import orjson


@dataclass(frozen=True)
class RewardRecord:
    reward_id: str
    session_id: str
    name: str
    value: float
    source: str | None
    created_at: float


@dataclass(frozen=True)
class RewardInput:
    session_id: str
    value: float
    name: str = "reward"


def parse_rewards_jsonl(path: Path) -> list[RewardInput]:
    """Lines ``{"session_id": ..., "value": ..., "name"?: ...}``; a bad line fails the whole file, naming it."""
    rewards = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = orjson.loads(line)
            session_id = data["session_id"]
            value = data["value"]
            name = data.get("name") or "reward"
            if not isinstance(session_id, str) or not session_id:
                raise ValueError("session_id must be a non-empty string")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError("value must be a finite number")
            if not isinstance(name, str):
                raise ValueError("name must be a string")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
        rewards.append(RewardInput(session_id, float(value), name))
    return rewards
