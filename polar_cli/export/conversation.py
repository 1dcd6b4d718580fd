"""A chain of captured calls as one conversation: each message once, in order, sampled turns as sampled.

Each call of a chain re-sends the conversation so far; the messages a call adds are those past the previous call's
request plus its answer. The answer itself is taken from the call's response (what the engine sampled, reasoning
included), not from the copy the harness sends back, which may have lost its reasoning or re-serialized its
arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_addon.call_roles import CallRole
from polar_addon.canonical import AssistantMessage
from polar_addon.capture import CaptureRecord
from polar_cli.build.prefix_merging import RecordChain, detect_eot, reconstruct_session, unusable_reason
from polar_cli.build.roles import chain_role, role_kind, session_roles


@dataclass
class Turn:
    """One message of a chain's conversation, in canonical (OpenAI chat) form."""

    message: dict[str, Any]
    record: CaptureRecord | None  # the call that sampled it; None: the harness sent it
    at: float  # unix seconds: when the proxy first saw it (request received, or answer made)


@dataclass
class SessionChains:
    session_id: str
    chains: list[RecordChain]
    unusable: dict[str, int]  # why calls were left out (failed, no tokens, retried ...), counted
    roles: list[str] = field(default_factory=list)  # each chain's role (polar_cli.build.roles.chain_role)

    @property
    def main(self) -> RecordChain | None:
        """The chain that carries the session: the agent chain with the most calls (the first of equals)."""
        roles = self.roles or [CallRole.AGENT.value] * len(self.chains)
        return max(
            self.chains,
            key=lambda c: (roles[c.index] == CallRole.AGENT.value, len(c.records), -c.index),
            default=None,
        )


def session_chains(session_id: str, records: Sequence[CaptureRecord]) -> SessionChains:
    """One session's records (seq order) split into the chains `polar build` reconstructs (a retried call, whose
    answer the harness threw away, left out as the build leaves it out)."""
    unusable: dict[str, int] = {}
    usable = []
    role_of: dict[str, str] = {}
    for record, decision in zip(records, session_roles(records)):
        reason = unusable_reason(record)
        if reason is None and decision.role == CallRole.DISCARDED.value:
            reason = role_kind(decision)
        if reason is None:
            usable.append(record)
            role_of[record.record_id] = decision.role
        else:
            unusable[reason] = unusable.get(reason, 0) + 1
    chains = reconstruct_session(usable, eot=detect_eot(usable))
    roles = [chain_role([role_of[r.record_id] for r in c.records]) for c in chains]
    return SessionChains(session_id, chains, unusable, roles)


def sampled_message(record: CaptureRecord) -> dict[str, Any]:
    """The assistant message the call's engine sampled, in OpenAI chat form."""
    return AssistantMessage.from_dict(record.response_message or {}).to_openai()


def _with_sent_ids(sampled: dict[str, Any], sent: Any) -> dict[str, Any]:
    """``sampled`` with the tool call ids of the copy the harness sent back, when that copy holds as many calls.

    A provider may give a call another id on the wire than the engine's (Anthropic's ``toolu_`` prefix): the
    tool results that follow name the wire id, so that is the one their call must carry."""
    calls = sampled.get("tool_calls") or []
    sent_calls = sent.get("tool_calls") if isinstance(sent, dict) and sent.get("role") == "assistant" else None
    if not calls or not isinstance(sent_calls, list) or len(sent_calls) != len(calls):
        return sampled
    ids = [c.get("id") if isinstance(c, dict) else None for c in sent_calls]
    if not all(isinstance(i, str) and i for i in ids):
        return sampled
    return {**sampled, "tool_calls": [{**c, "id": i} for c, i in zip(calls, ids)]}


def chain_turns(records: Sequence[CaptureRecord]) -> list[Turn]:
    """The conversation of one chain's calls (in order): what the harness sent, then each call's sampled answer."""
    requests = [orjson.loads(record.messages_json) for record in records]
    turns: list[Turn] = []
    known = 0  # messages of the conversation already turned (requests' messages plus the answers sent back)
    for n, (record, messages) in enumerate(zip(records, requests)):
        turns.extend(Turn(m, None, record.started_at) for m in messages[known:])
        known = len(messages) + 1  # the next request re-sends this answer at index len(messages)
        sampled = sampled_message(record)
        following = requests[n + 1] if n + 1 < len(requests) else []
        if len(following) >= known:
            sampled = _with_sent_ids(sampled, following[known - 1])
        turns.append(Turn(sampled, record, record.finished_at))
    return turns
