"""Rewards: one row per reward event; a session's value for a reward name is its latest event."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# Rewards feed advantages directly: a value far outside any verifier's scale is a bug or an attack.
REWARD_LIMIT = 1e6
REWARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$")


def check_reward(value: Any, name: Any = "reward") -> tuple[float, str]:
    """(value, name) if ``value`` is a finite number (not a bool, not a string) with ``|value| <= REWARD_LIMIT``
    and ``name`` matches ``REWARD_NAME``; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("reward value must be a JSON number")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"reward value must be within +-{REWARD_LIMIT:g}") from None
    if not math.isfinite(value) or abs(value) > REWARD_LIMIT:
        raise ValueError(f"reward value must be a finite number within +-{REWARD_LIMIT:g}")
    if not isinstance(name, str) or not REWARD_NAME.fullmatch(name):
        raise ValueError(f"reward name must match {REWARD_NAME.pattern}")
    return value, name


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
            if not isinstance(session_id, str) or not session_id:
                raise ValueError("session_id must be a non-empty string")
            value, name = check_reward(data["value"], data.get("name") or "reward")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
        rewards.append(RewardInput(session_id, value, name))
    return rewards
