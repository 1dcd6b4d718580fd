"""Each call's role in its session (polar_addon.call_roles), as the build decides it, and a chain's role.

The capture decided each call's role from its request; the build adds what only the later calls show: a
call sent again unchanged (the same prompt ids under the same sampling parameters) once its answer was made
was a retry, so that answer was **discarded**. A record from before roles were captured gets its role from
its request here.

A chain's role is ``agent`` when any of its calls is (an auxiliary call can only merge into an agent
chain when the harness continued from it), else ``auxiliary``, else ``discarded``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from polar_addon.call_roles import DISCARDED, CallRole, RoleDecision, call_role, retried
from polar_addon.capture import CaptureRecord

SAMPLING = ("temperature", "top_p", "top_k", "min_p")


def captured_role(record: CaptureRecord) -> RoleDecision:
    if record.role is not None:
        return RoleDecision(record.role, record.role_reason)
    if record.status != "ok":
        return DISCARDED
    return call_role(record.messages, record.tools)


def session_roles(records: Sequence[CaptureRecord]) -> list[RoleDecision]:
    """The role of each of one session's records (in seq order)."""
    roles = [captured_role(r) for r in records]
    answered = [i for i, r in enumerate(records) if r.status == "ok"]
    keys = [(tuple(records[i].prompt_ids), *(getattr(records[i], n) for n in SAMPLING)) for i in answered]
    for k, again in retried(keys).items():
        first, repeat = records[answered[k]], records[answered[again]]
        # Sent while the first was still being answered: a parallel sample (Pi summarises a history and a split
        # turn's prefix at once, and the two prompts can be the same), not a retry; both answers are used.
        if repeat.started_at >= first.finished_at:
            roles[answered[k]] = RoleDecision(CallRole.DISCARDED.value, f"retried: call {repeat.seq} sent it again")
    return roles


def chain_role(roles: Collection[str]) -> str:
    for role in (CallRole.AGENT.value, CallRole.AUXILIARY.value):
        if role in roles:
            return role
    return CallRole.DISCARDED.value


def role_kind(decision: RoleDecision) -> str:
    """How a call is counted in the stats: ``agent``, or ``auxiliary: claude-code title``, ``discarded: retried``."""
    if decision.reason is None:
        return decision.role
    return f"{decision.role}: {decision.reason.split(':', 1)[0]}"
