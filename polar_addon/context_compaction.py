"""Context compaction: how a harness squeezes a session that outgrew the served window, seen from the proxy.

Two kinds of calls matter:

- a **compaction call** asks the model to summarise the conversation so far. Codex on its default
  (OpenAI) provider asks the server to do it (remote compaction: a Responses call whose input ends with
  a ``compaction_trigger`` item, or ``POST /v1/responses/compact``); polar runs that summarisation on the
  engine with :data:`POLAR_COMPACTION_PROMPT` and answers with an opaque ``compaction`` item
  (:func:`encode_summary`). Every other harness sends its own summarisation prompt as a normal call.
- a **summarised history**: the calls after a compaction carry the summary instead of the turns it
  replaced, so they start a new token chain.

Both are recognised by the harnesses' own fixed texts (:data:`PROMPT_MARKERS`, :data:`SUMMARY_MARKERS`),
read from each harness's bundled source; the rule is documented in the README ("Long sessions").
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

# What polar asks the engine when Codex requests a remote compaction (polar's own wording).
POLAR_COMPACTION_PROMPT = (
    "[polar] Context compaction. The conversation above is about to be replaced by a summary that "
    "another model will continue from. Write that summary now, as plain text: the user's goal, what has "
    "been done and decided so far, the files, commands and results that matter, and the next steps. "
    "Do not call tools."
)
# How a polar summary is shown to the model in later calls (the decoded ``compaction`` item).
POLAR_SUMMARY_PREFIX = "[polar] Summary of the earlier part of this conversation, which was compacted:"
# The opaque ``encrypted_content`` of polar's compaction items: this prefix, then the summary as base64.
ENCRYPTED_PREFIX = "polar-summary:v1:"

# Text a harness puts in the last user message (or the system prompt) of the call that asks for a summary.
PROMPT_MARKERS: dict[str, tuple[str, ...]] = {
    "polar": (POLAR_COMPACTION_PROMPT[:40],),
    "claude-code": ("Your task is to create a detailed summary of the conversation so far",),
    "codex": ("You are performing a CONTEXT CHECKPOINT COMPACTION",),
    "qwen-code": ("summarizes internal chat history into a given structure",),
    "gemini-cli": ("distilling chat history into a structured XML <state_snapshot>",),
    "pi": (
        "Create a structured context checkpoint summary",
        "NEW conversation messages to incorporate into the existing summary",
        "This is the PREFIX of a turn that was too large to keep",
    ),  # the last: a compaction that splits a turn
}
# Text a harness puts in the history that replaces the compacted turns.
SUMMARY_MARKERS: dict[str, tuple[str, ...]] = {
    "polar": (POLAR_SUMMARY_PREFIX,),
    "claude-code": ("This session is being continued from a previous conversation that ran out of context",),
    "codex": ("Another language model started to solve this problem and produced a summary",),
    "gemini-cli/qwen-code": ("<state_snapshot>",),
    "pi": ("was compacted into the following summary",),
}


def encode_summary(summary: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(summary.encode()).decode()


def decode_summary(encrypted: Any) -> str | None:
    """The summary inside one of polar's compaction items; None for anything else (e.g. OpenAI's own)."""
    if not isinstance(encrypted, str) or not encrypted.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(encrypted[len(ENCRYPTED_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def summary_message(summary: str) -> dict[str, Any]:
    """The user message a polar compaction item stands for in the engine's prompt."""
    return {"role": "user", "content": f"{POLAR_SUMMARY_PREFIX}\n\n{summary}"}


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _find(text: str, markers: dict[str, tuple[str, ...]]) -> str | None:
    return next((harness for harness, texts in markers.items() if any(t in text for t in texts)), None)


def compaction_prompt(messages: list[dict[str, Any]]) -> str | None:
    """Which harness's compaction call this is (None: not one): its prompt is the last user message,
    or the system prompt (Gemini CLI, Qwen Code)."""
    if messages and messages[0].get("role") in ("system", "developer"):
        found = _find(message_text(messages[0].get("content")), PROMPT_MARKERS)
        if found is not None:
            return found
    for message in reversed(messages):
        if message.get("role") == "user":
            return _find(message_text(message.get("content")), PROMPT_MARKERS)
        if message.get("role") == "assistant":
            return None
    return None


def summarised_history(messages: list[dict[str, Any]]) -> str | None:
    """Which harness's compaction summary the conversation carries (None: an uncompacted history)."""
    for message in messages:
        if message.get("role") in ("user", "system", "developer"):
            found = _find(message_text(message.get("content")), SUMMARY_MARKERS)
            if found is not None:
                return found
    return None
