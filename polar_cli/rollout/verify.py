"""What a verifier's run means as rewards (pure): an exit code, a reward file (a float, or a flat JSON object of
name -> number), or Harbor's ``/logs/verifier/reward.json`` / ``reward.txt`` pair, read the way harbor 0.25 reads them
(the JSON wins; its non-numeric entries are ignored; ``reward.txt`` fills a missing ``reward``)."""

from __future__ import annotations

import json
import math
import os
import re

from polar_addon.store.rewards import REWARD_LIMIT, REWARD_NAME


class VerifierError(ValueError):
    """The verifier gave no reward that can be read: the session is an infrastructure error, never a 0."""


def parse_reward_text(text: str, where: str) -> float:
    if not text.strip():
        raise VerifierError(f"{where} is empty")
    try:
        value = float(text.strip())
    except ValueError:
        raise VerifierError(f"{where} is not a number: {text.strip()[:80]!r}") from None
    return _check(value, where)


def parse_reward_json(text: str, where: str) -> dict[str, float]:
    if not text.strip():
        raise VerifierError(f"{where} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VerifierError(f"{where} is not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise VerifierError(f"{where} must be a JSON object of name -> number")
    return {k: _check(float(v), f"{where}[{k!r}]") for k, v in data.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _check(value: float, where: str) -> float:
    if not math.isfinite(value) or abs(value) > REWARD_LIMIT:
        raise VerifierError(f"{where}: reward {value} is not a finite number within +-{REWARD_LIMIT:g}")
    return value


def outcome(rewards: dict[str, float], where: str) -> dict[str, float]:
    """``rewards`` with the outcome under ``reward`` (the mean of the named ones when the verifier gave none), and
    only names the store accepts."""
    if not rewards:
        raise VerifierError(f"{where}: no numeric reward in it")
    bad = [name for name in rewards if not REWARD_NAME.match(name)]
    if bad:
        raise VerifierError(f"{where}: reward names {bad} do not match {REWARD_NAME.pattern}")
    if "reward" not in rewards:
        rewards = {"reward": sum(rewards.values()) / len(rewards), **rewards}
    return rewards


def harbor_rewards(reward_json: str | None, reward_txt: str | None) -> dict[str, float]:
    """Harbor's rule: reward.json if present (reward.txt fills its ``reward``), else reward.txt, else an error."""
    if reward_json is not None:
        rewards = parse_reward_json(reward_json, "/logs/verifier/reward.json")
        if "reward" not in rewards and reward_txt is not None:
            try:
                rewards["reward"] = parse_reward_text(reward_txt, "/logs/verifier/reward.txt")
            except VerifierError:
                pass
        return outcome(rewards, "/logs/verifier/reward.json")
    if reward_txt is not None:
        return {"reward": parse_reward_text(reward_txt, "/logs/verifier/reward.txt")}
    raise VerifierError("the verifier wrote neither /logs/verifier/reward.txt nor reward.json")


def file_rewards(text: str, name: str) -> dict[str, float]:
    """A JSONL task's ``reward_file``: JSON when it parses as an object, else one float."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return outcome(parse_reward_json(stripped, name), name)
    return {"reward": parse_reward_text(stripped, name)}


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def resolve_env(template: dict[str, str]) -> dict[str, str]:
    """Harbor's ``[verifier] env``: ``${VAR}`` and ``${VAR:-default}`` from the host's environment."""

    def one(value: str) -> str:
        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise VerifierError(f"the verifier's env needs ${{{name}}}, which is not set")

        return _VAR.sub(sub, value)

    return {key: one(value) for key, value in template.items()}
