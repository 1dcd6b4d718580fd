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
very start of the system prompt's text (for Claude Code, of the block after its identity line), or at the
start of a block of the last user message (a harness wraps what it quotes in its own tags), never in a
tool result or an assistant turn; and a call that declares tools is auxiliary only when its marker says
such a call may (:attr:`RoleMarker.with_tools`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from polar_addon.context_compaction import PROMPT_MARKERS, message_text

# How the Anthropic and Gemini translations join a message's text blocks (a block boundary there).
BLOCK_SEPARATOR = "\n\n"
# The same split as str.split(BLOCK_SEPARATOR), twice as fast: CPython's search for a two-character needle crawls
# (~110 us over a 32k-token message, on every call).
_BLOCK_SPLIT = re.compile(re.escape(BLOCK_SEPARATOR))


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
    kind: str  # title, quota, classifier, next_speaker, loop_detection, memory, summary, compaction, ...
    where: str  # "system": the system prompt opens with it; "user": a block of the last user message does
    text: str
    with_tools: bool = False  # the call may declare tools and still be this side job
    whole: bool = False  # the block is exactly the text (a marker too short to be known by its start)


def _m(harness: str, kind: str, where: str, text: str, **kw: bool) -> RoleMarker:
    return RoleMarker(harness, kind, where, text, **kw)


# Copied verbatim from the harnesses' own bundles at the versions `make harnesses` pins. Headless runs of the presets
# make few of these (which ones: docs/concepts/reconstruction.md); a user's interactive session through the forward
# proxy makes the rest.
AUXILIARY_MARKERS: tuple[RoleMarker, ...] = (
    # Claude Code 2.1.197 (its system prompts open with an identity line first: CLAUDE_CODE_IDENTITY)
    _m("claude-code", "compaction", "system", "You are a helpful AI assistant tasked with summarizing conversations.",
       with_tools=True),  # the fork keeps the parent's tools (prompt cache)
    _m("claude-code", "title", "system", "Generate a concise, sentence-case title (3-7 words) that captures the main "
       "topic or goal of this coding session."),
    _m("claude-code", "title", "system", "Generate a short kebab-case name (2-4 words) that captures the main topic of "
       "this conversation."),
    _m("claude-code", "quota", "user", "quota", whole=True),
    _m("claude-code", "classifier", "system", "Your task is to process Bash commands that an AI coding agent wants to "
       "run."),
    _m("claude-code", "classifier", "system", "You are evaluating a hook condition in Claude Code.", with_tools=True),
    _m("claude-code", "web_fetch", "user", "Web page content:\n---"),
    _m("claude-code", "web_search", "system", "You are an assistant for performing a web search tool use",
       with_tools=True),
    _m("claude-code", "memory", "user", "You are now acting as the memory extraction subagent. Analyze the most "
       "recent ~", with_tools=True),
    _m("claude-code/qwen-code", "summary", "system", "Write a short summary label describing what these tool calls "
       "accomplished."),
    # Codex 0.171.0 (compaction: context_compaction.PROMPT_MARKERS)
    _m("codex", "title", "user", "Generate a concise, single-line task title of at most "),
    _m("codex", "memory", "system", "## Memory Writing Agent: Phase ", with_tools=True),
    _m("codex", "memory", "system", "You are part of an agent memory system. Your job is to extract information",
       with_tools=True),
    _m("codex", "classifier", "system", "You are judging one planned coding-agent action."),
    # Qwen Code 0.15.10: its side queries declare one tool, respond_in_schema
    _m("qwen-code", "memory", "system", "You are now acting as the managed memory extraction subagent for an AI "
       "coding assistant.", with_tools=True),
    _m("qwen-code", "memory", "system", "You are selecting memories that will be useful to an AI coding assistant "
       "as it processes a user's query.", with_tools=True),
    _m("qwen-code", "memory", "system", "You are performing a managed memory dream", with_tools=True),
    _m("qwen-code", "title", "system", "Generate a concise, sentence-case title (3-7 words) that captures what this "
       "programming-assistant session is about.", with_tools=True),
    _m("qwen-code", "memory", "system", "You are reviewing this conversation to extract reusable skills.",
       with_tools=True),
    _m("qwen-code", "summary", "system", "You generate session recaps for a programming assistant CLI."),
    _m("gemini-cli/qwen-code", "next_speaker", "user", "Analyze *only* the content and structure of your immediately "
       "preceding response (your last turn in the conversation history).", with_tools=True),
    # Gemini CLI 0.61.0
    _m("gemini-cli", "compaction", "user", "Critically evaluate the <state_snapshot> you just generated."),
    _m("gemini-cli", "loop_detection", "system", "You are a diagnostic agent that determines whether a "
       "conversational AI assistant is stuck in an unproductive loop."),
    _m("gemini-cli", "edit_fix", "system", "You are an expert code-editing assistant specializing in debugging and "
       "correcting failed search-and-replace operations."),
    _m("gemini-cli", "edit_fix", "system", "You are an expert code-editing assistant. Your task is to analyze a "
       "failed edit attempt and provide a corrected version of the text snippets."),
    _m("gemini-cli", "router", "system", "You are a specialized Task Routing AI."),
    _m("gemini-cli", "summary", "user", "Summarize the user's primary intent or goal in this conversation in ONE "
       "sentence (max 80 characters)."),
    _m("gemini-cli", "summary", "user", "Summarize the following tool output to be a maximum of "),
    _m("gemini-cli", "web_fetch", "user", "Follow the user's instructions to process the authorized URLs."),
    _m("gemini-cli", "web_fetch", "user", "Follow the user's instructions below using the provided webpage content."),
    # Pi 0.73.1: its compaction prompts sit inside a block of the user message; its system prompt opens with this
    _m("pi", "compaction", "system", "You are a context summarization assistant. Your task is to read a "
       "conversation between a user and an AI coding assistant"),
    # opencode 1.18.33 and its fork Kilo Code 7.7.7
    _m("opencode/kilocode", "compaction", "system", "You are a context summarization agent. You are given a "
       "conversation between a user and an agent."),
    _m("opencode/kilocode", "title", "system", "You are a title generator. You output ONLY a thread title."),
    _m("opencode", "summary", "system", "Summarize what was done in this conversation. Write like a pull request "
       "description."),
    # Continue CLI 1.5.47 (appended after the whole history; whether it keeps the tools is not known)
    _m("continue-cli", "compaction", "user", "Please provide a concise summary of our conversation so far, capturing "
       "the key context, decisions made, and current state.", with_tools=True),
    _m("continue-cli", "title", "user", "Given the following... please reply with a title for the chat that is 3-4 "
       "words in length"),
    # Cline 3.0.65
    _m("cline", "compaction", "system", "Summarize the provided coding session into a concise continuation note "
       "with detailed next steps."),
    # gptme 0.35.1 (it names every conversation, in a thread of its own)
    _m("gptme", "title", "system", "Generate concise conversation titles."),
    # aider 0.86.2
    _m("aider", "summary", "system", "*Briefly* summarize this partial conversation about programming."),
    _m("aider", "commit_message", "system", "You are an expert software engineer that generates concise, one-line Git "
       "commit messages based on the provided diffs."),
    # Kimi CLI 1.52.0 (soul/compaction.py: the history as one user message, no tools)
    _m("kimi-cli", "compaction", "system", "You are a helpful assistant that compacts conversation context."),
)  # fmt: skip

# The first system block of every Claude Code call, its side jobs' included: the side job's own text opens the second.
CLAUDE_CODE_IDENTITY = frozenset(
    {
        "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
        "You are Claude Code, Anthropic's official CLI for Claude.",
        "You are Claude Code, Anthropic's official CLI for Claude, running within the Claude Agent SDK.",
    }
)


@dataclass(frozen=True)
class RoleDecision:
    role: str
    reason: str | None  # the auxiliary kind ("claude-code title"), why discarded; None for agent


AGENT = RoleDecision(CallRole.AGENT.value, None)
# The harness got an error instead of an answer.
DISCARDED = RoleDecision(CallRole.DISCARDED.value, "failed")


def _blocks(text: str) -> list[str]:
    return [block.lstrip() for block in _BLOCK_SPLIT.split(text)]


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


def _system_opening(system: str) -> str:
    """Where a side job's system text starts: the system prompt's start, or its second block after a Claude Code
    identity line (never further: harnesses append memory files and the environment there)."""
    first, _, rest = system.partition(BLOCK_SEPARATOR)
    return rest.lstrip() if first.strip() in CLAUDE_CODE_IDENTITY else system


def _opens(marker: RoleMarker, block: str) -> bool:
    return block.rstrip() == marker.text if marker.whole else block.startswith(marker.text)


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
    system = _system_opening(_system_text(messages))
    user = _last_user_text(messages)
    user_blocks = _blocks(user) if user is not None else []
    harness = _compaction(system, user_blocks)
    if harness is not None:
        return RoleDecision(CallRole.AUXILIARY.value, f"{harness} compaction")
    for marker in AUXILIARY_MARKERS:
        if tools and not marker.with_tools:
            continue
        found = _opens(marker, system) if marker.where == "system" else any(_opens(marker, b) for b in user_blocks)
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
