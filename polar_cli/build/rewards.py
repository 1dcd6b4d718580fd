"""Which reward each trace carries and whether it may be trained on (the paper's rules, §1.5/§2.5).

- A completed session's outcome reward (``rewards["reward"]``) goes to each of its traces.
- An agent timeout (session status ``timeout``) or a harness that failed (``agent_error``: `polar
  rollout`'s ``failed``, a harness that exited non-zero, was killed from inside or produced nothing)
  is the policy's failure: reward 0, still trainable. Masking it instead would let a policy escape a
  0 by failing loudly.
- A trace containing a tool call the parser could not read is the policy's failure too:
  reward 0, still trainable, whatever the session scored. Where polar parsed the turn itself
  (``CaptureRecord.parse_failures`` set: local and scripted engines, every engine given token input)
  its count of unreadable blocks decides; where the engine parsed it (null), call markup left in
  the content does.
- An infrastructure failure (status ``error``), a session still ``running``, a session with no
  outcome reward yet, and a call with no session row are not training data: ``trainable`` is
  False and the trace's loss mask is all 0 (the trainer never sees a token of it).
- ``per_request`` traces get the session reward only with ``broadcast`` (``--broadcast-rewards``):
  the paper saw reward hacking when one outcome credits every request. Without it they carry
  reward 0.0 and ``trainable`` False: there is no per-call reward to give them, and NaN or a
  made-up value must never reach a trainer. Such builds serve inspection and SFT-style use.
- ``tool_call_reward`` B > 0 (``--tool-call-reward``, a shaped reward, off by default): a completed session's trace
  in which some call ended in a tool call that was parsed gets its outcome reward + B. A base model that never
  speaks the harness's tool protocol scores 0 everywhere, so every group has zero advantage and GRPO learns
  nothing; the bonus gives the few sampled tool calls an advantage. It is decided from the captured calls (what
  the engine's parser returned), never from anything the agent writes, and it is not given where the outcome is a
  policy failure (timeout, agent error, an unparsable call: those stay 0). Held-out pass@1 (`polar eval`) never
  sees it.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from polar_addon.capture import CaptureRecord

# Literal tool-call markup left in content means the engine's parser did not recognize the call.
_UNPARSED_MARKERS = ("<tool_call>", "<function=")

TOOL_CALL_REWARD_HELP = (
    "A shaped reward (default 0: off): a completed session's trace in which some call ended in a tool call the "
    "parser returned gets outcome + this. For a base model that never speaks the harness's tool protocol (every "
    "reward 0, nothing to learn from); decided from the captured calls, not given to timeouts, agent errors or "
    "unparsable calls; held-out evals never see it."
)

AGENT_FAILURES = {"timeout": "agent timeout", "agent_error": "agent error"}


@dataclass(frozen=True)
class SessionInfo:
    """What reconstruction needs to know about a session (built from the store's session rows)."""

    session_id: str
    task_id: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    harness: str | None = None
    status: str = "completed"  # completed | timeout | error | agent_error | running
    reward: float | None = None  # the outcome reward; None until an evaluator posted one


@dataclass(frozen=True)
class RewardDecision:
    reward: float
    trainable: bool
    reason: str  # why, in words (counted in the build stats)


def invalid_tool_call(record: CaptureRecord) -> bool:
    """Polar's training_filter: a tool_calls finish with no parsed call, a call polar's own parser could not read
    (``parse_failures``), or, in a turn the engine parsed, call markup left in text."""
    message = record.response_message or {}
    calls = message.get("tool_calls") or []
    if record.finish_reason == "tool_calls" and not calls:
        return True
    if record.parse_failures is not None:
        # Polar's parser read this turn and reported every block it could not read (unclosed ones included); the
        # markup test would also fail a turn that only mentions another format's tags in prose.
        return record.parse_failures > 0
    content = message.get("content") or ""
    return isinstance(content, str) and any(marker in content for marker in _UNPARSED_MARKERS)


def check_tool_call_reward(value: float) -> float:
    """``--tool-call-reward``: finite and >= 0 (a negative one would punish the very protocol being taught)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"--tool-call-reward must be a finite number >= 0, not {value!r}")
    return value


def parsed_tool_call(record: CaptureRecord) -> bool:
    """The call's answer carried at least one tool call the parser returned."""
    return bool((record.response_message or {}).get("tool_calls"))


def decide_reward(
    session: SessionInfo | None,
    records: list[CaptureRecord],
    *,
    per_request: bool,
    broadcast: bool,
    tool_call_reward: float = 0.0,
) -> RewardDecision:
    """The reward and trainability of one trace built from ``records`` of ``session``."""
    if session is None:
        return RewardDecision(0.0, False, "no session row")
    if session.status == "error":
        return RewardDecision(0.0, False, "infrastructure failure")
    if session.status == "running":
        return RewardDecision(0.0, False, "session still running")
    if per_request and not broadcast:
        return RewardDecision(0.0, False, "per-request trace without --broadcast-rewards")
    if session.status in AGENT_FAILURES:
        return RewardDecision(0.0, True, AGENT_FAILURES[session.status])
    if session.status != "completed":
        return RewardDecision(0.0, False, f"unknown session status {session.status!r}")
    if session.reward is None:
        return RewardDecision(0.0, False, "no outcome reward")
    if not math.isfinite(session.reward):
        return RewardDecision(0.0, False, "non-finite outcome reward")
    if any(invalid_tool_call(r) for r in records):
        return RewardDecision(0.0, True, "parser-invalid tool call")
    if tool_call_reward and any(parsed_tool_call(r) for r in records):
        return RewardDecision(float(session.reward) + tool_call_reward, True, "outcome reward + tool-call reward")
    return RewardDecision(float(session.reward), True, "outcome reward")


def untrained_role(decision: RewardDecision, role: str, trained: Collection[str]) -> RewardDecision:
    """A trace whose calls' role is not trained (`polar build --roles`) keeps its reward but leaves training."""
    if role in trained or not decision.trainable:
        return decision
    return RewardDecision(decision.reward, False, f"{role} calls not trained (--roles)")
