"""Plain OpenAI chat examples for SFT: ``{"messages": [...], "tools": [...]}``, one per chain of a session.

The messages are the chain's conversation with each sampled turn as the engine sampled it (reasoning in
``reasoning_content``, as Qwen-style chat templates and TRL read it); the tools are those of the chain's last call.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import orjson

from polar_addon.call_roles import ROLES
from polar_addon.capture import CaptureRecord
from polar_cli.export.conversation import chain_turns, session_chains


def chain_example(records: Sequence[CaptureRecord]) -> dict[str, Any]:
    """One chain's calls (in order) as an OpenAI chat example."""
    return {
        "messages": [turn.message for turn in chain_turns(records)],
        "tools": orjson.loads(records[-1].tools_json),
    }


def session_examples(
    session_id: str, records: Sequence[CaptureRecord], roles: Collection[str] = ROLES
) -> list[dict[str, Any]]:
    """Every chain of one session (seq order) whose role is in ``roles`` as an example, in chain order."""
    split = session_chains(session_id, records)
    return [chain_example(chain.records) for chain in split.chains if split.roles[chain.index] in roles]
