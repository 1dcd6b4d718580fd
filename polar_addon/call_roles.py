"""What a captured call is for: the agent's own loop, a harness's side job, or an answer nobody used.

- ``agent``: the main loop (and its sub-agents): the turns that act on the task, trained by default.
- ``auxiliary``: a harness's side job: a session title, a topic or safety classifier, a quota probe, a
  next-speaker check, a memory or summary call, a compaction. Its answer never acts on the task (a
  compaction's summary at most carries it on), so crediting it with the task's outcome is noise;
  `polar build --roles agent,auxiliary` trains it anyway.
- ``discarded``: an answer the harness never used: a failed call (the harness got an error), or a call
  it sent again unchanged (a retry: the first answer was thrown away; found by the build, which sees the
  later call, :func:`retried`).

The capture role is decided from the request alone (:func:`call_role`), by texts each harness writes
itself (:data:`AUXILIARY_MARKERS`, and the compaction prompts of :mod:`polar_addon.context_compaction`).
The policy being trained must not be able to make its own turns look auxiliary (that would take them out
of training and let it escape a bad reward), and it controls tool outputs, files a harness quotes and
its own earlier turns. So a marker counts only where a harness, not the model, writes the text: at the
very start of the system prompt's text, or at the start of a block of the last user message (a harness
wraps what it quotes in its own tags), never in a tool result or an assistant turn; and a call that
declares tools is auxiliary only when its marker says such a call may (:attr:`RoleMarker.with_tools`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from polar_addon.context_compaction import PROMPT_MARKERS, message_text

# How the Anthropic and Gemini translations join a message's text blocks (a block boundary there).
BLOCK_SEPARATOR = "\n\n"


class CallRole(StrEnum):
    AGENT = "agent"
    AUXILIARY = "auxiliary"
    DISCARDED = "discarded"


ROLES: tuple[str, ...] = tuple(r.value for r in CallRole)
DEFAULT_TRAINED_ROLES: frozenset[str] = frozenset({CallRole.AGENT.value})


@dataclass(frozen=True)
class RoleMarker:
    """A harness-written text that opens one kind of auxiliary call."""

    harness: str
    kind: str  # title, topic, quota, classifier, next_speaker, loop_detection, memory, summary, ...
    where: str  # "system": the system prompt opens with it; "user": a block of the last user message does
    text: str
    with_tools: bool = False  # the call may declare tools and still be this side job


AUXILIARY_MARKERS: tuple[RoleMarker, ...] = ()


@dataclass(frozen=True)
class RoleDecision:
    role: str
    reason: str | None  # the auxiliary kind ("claude-code title"), why discarded; None for agent


AGENT = RoleDecision(CallRole.AGENT.value, None)
# The harness got an error instead of an answer.
DISCARDED = RoleDecision(CallRole.DISCARDED.value, "failed")


def _blocks(text: str) -> list[str]:
    return [block.lstrip() for block in text.split(BLOCK_SEPARATOR)]


def _last_user_text(messages: Sequence[dict[str, Any]]) -> str | None:
    """The text of the user message after the last assistant turn (None: the conversation ends otherwise)."""
    for message in reversed(messages):
        role = message.get("role")
        if role == "user":
            return message_text(message.get("content"))
        if role == "assistant":
            return None
    return None


def _system_text(messages: Sequence[dict[str, Any]]) -> str:
    if messages and messages[0].get("role") in ("system", "developer"):
        return message_text(messages[0].get("content")).lstrip()
    return ""


def _compaction(system: str, user_blocks: list[str]) -> str | None:
    for harness, texts in PROMPT_MARKERS.items():
        for text in texts:
            # Gemini CLI and Qwen Code put their compaction prompt in the system prompt, not at its very start:
            # its opening sentence is the harness's own, so the first few hundred characters are still its text.
            if text in system[:COMPACTION_SYSTEM_PREFIX] or any(block.startswith(text) for block in user_blocks):
                return harness
    return None


# Where in a compaction call's system prompt its marker may sit (the opening sentence; a harness appends the
# user's memory files and environment, which a policy can write, far later).
COMPACTION_SYSTEM_PREFIX = 256


def call_role(messages: Sequence[dict[str, Any]], tools: Sequence[Any]) -> RoleDecision:
    """The role an answered call has from its request alone (a retry is found later, by :func:`retried`)."""
    system = _system_text(messages)
    user = _last_user_text(messages)
    user_blocks = _blocks(user) if user is not None else []
    harness = _compaction(system, user_blocks)
    if harness is not None:
        return RoleDecision(CallRole.AUXILIARY.value, f"{harness} compaction")
    for marker in AUXILIARY_MARKERS:
        if tools and not marker.with_tools:
            continue
        found = (
            system.startswith(marker.text)
            if marker.where == "system"
            else any(block.startswith(marker.text) for block in user_blocks)
        )
        if found:
            return RoleDecision(CallRole.AUXILIARY.value, f"{marker.harness} {marker.kind}")
    return AGENT


def retried(keys: Sequence[Any]) -> dict[int, int]:
    """Which calls were sent again unchanged: index -> the index of the next call with the same key.

    ``keys``: one hashable per call in the order the proxy received them, equal exactly when two calls asked
    the engine the same thing (the build uses the prompt token ids and the sampling parameters).
    """
    later: dict[Any, int] = {}
    again: dict[int, int] = {}
    for index in range(len(keys) - 1, -1, -1):
        key = keys[index]
        if key in later:
            again[index] = later[key]
        later[key] = index
    return again


def parse_roles(text: str) -> frozenset[str]:
    """``--roles agent,auxiliary`` -> the set, or ValueError naming what is not a role."""
    roles = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(roles - set(ROLES))
    if unknown or not roles:
        raise ValueError(
            f"unknown role(s) {', '.join(unknown) or '(none given)'}: use a comma-separated subset of "
            f"{', '.join(ROLES)}"
        )
    return roles
