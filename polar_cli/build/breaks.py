"""Why a session's calls do not form one token stream: every chain boundary gets a cause.

A session would ideally be one chain: each call's prompt extends the previous call's prompt by
the sampled turn and what came back (tool results, template glue). Every extra chain is a break
of that ideal, and each gets one cause:

- ``template_rerender``: the messages carry the same conversation, but the chat template rendered
  tokens differently from what the model saw or sampled (Qwen3 drops earlier ``<think>`` blocks
  once a new user turn arrives; some templates drop them from every history turn).
- ``retokenized``: the same text came back as different token ids (BPE merges the sampled
  ``[fish, ing]`` into ``[fishing]``). Inside a chain this breaks it where the build does not merge
  (``merge_retokenized=False``: `polar build`'s default, ``--retokenized break``), or is merged (the
  paper's rule, off-policy from there on) and only counted; it always breaks a chain when it changed
  the previous *prompt*.
- ``rewritten_history``: the harness changed the conversation: compaction, a dropped or edited
  turn, a re-serialized tool call, reasoning not sent back, changed tool definitions.
- ``compaction``: the harness compacted the conversation: the call asks for a summary (its compaction
  prompt), or its history is a summary of the chain before it. Recognised by each harness's own fixed
  texts (``polar_addon.context_compaction``), or, for a summary without its harness's fixed text (a model that
  ignored the summary format), by carrying what a captured compaction call answered; it starts a chain and cuts
  the one it summarised.
- ``sub_agent``: a different conversation in the same session (another system prompt, or another
  first user message while the parent conversation carries on). It starts a chain but cuts none.
- ``other``: a repeated prompt (retry, parallel sample), a changed sampling temperature, no
  end-of-turn token to split at, or a token mismatch that cannot be told apart without a tokenizer.

Classification reads the canonical messages only when tokens disagree, so clean merges never
parse JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from polar_addon.capture import CaptureRecord
from polar_addon.context_compaction import compaction_prompt, message_text, summarised_history

Decode = Callable[[Sequence[int]], str]


class BreakCause(StrEnum):
    TEMPLATE_RERENDER = "template_rerender"
    RETOKENIZED = "retokenized"
    REWRITTEN_HISTORY = "rewritten_history"
    COMPACTION = "compaction"
    SUB_AGENT = "sub_agent"
    OTHER = "other"


@dataclass(frozen=True)
class Break:
    cause: BreakCause
    detail: str


def _text(content: Any) -> str:
    """Message content as plain text (canonical content is a string; tolerate part lists)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _history_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or call
        calls.append((fn.get("name", ""), fn.get("arguments", "")))
    return calls


def turn_rewrites(sampled: dict[str, Any] | None, history: dict[str, Any] | None) -> list[str]:
    """How the assistant turn the harness sent back differs from the one the model produced.

    ``sampled`` is the record's response message (``AssistantMessage`` as a dict); ``history`` is
    the OpenAI-style assistant message at the same place in the next call's messages. Tool-call
    ids are ignored: harnesses and providers legitimately re-key them.
    """
    if sampled is None:
        return []
    if history is None:
        return ["the sampled assistant turn is missing from the next call's messages"]
    if history.get("role") != "assistant":
        return [f"the next call has a {history.get('role')!r} message where the sampled assistant turn belongs"]
    changes = []
    reasoning = sampled.get("reasoning") or ""
    sent_reasoning = history.get("reasoning_content") or history.get("reasoning") or ""
    if reasoning and not sent_reasoning:
        changes.append("the harness did not send the sampled reasoning back")
    elif reasoning != sent_reasoning:
        changes.append("reasoning text changed")
    if _text(sampled.get("content")) != _text(history.get("content")):
        changes.append("content text changed")
    sampled_calls = [(c.get("name", ""), c.get("arguments", "")) for c in sampled.get("tool_calls") or []]
    sent_calls = _history_calls(history)
    if [n for n, _ in sampled_calls] != [n for n, _ in sent_calls]:
        changes.append("tool calls changed")
    elif [a for _, a in sampled_calls] != [a for _, a in sent_calls]:
        changes.append("tool-call arguments re-serialized")
    return changes


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def classify_rerendered_turn(
    prev: CaptureRecord,
    nxt: CaptureRecord,
    copy: Sequence[int],
    decode: Decode | None,
) -> Break | None:
    """The next prompt re-rendered ``prev``'s sampled turn as ``copy`` != ``prev.response_ids``.

    Returns None when only the tokenization differs (same text): the chain merges, as in the
    paper. Otherwise the break that stops the merge.
    """
    sampled = prev.response_ids
    prev_messages = prev.messages
    next_messages = nxt.messages
    history = next_messages[len(prev_messages)] if len(next_messages) > len(prev_messages) else None
    changes = turn_rewrites(prev.response_message, history)
    where = (
        f"call {nxt.seq} re-rendered call {prev.seq}'s turn as {len(copy)} tokens "
        f"(sampled {len(sampled)}; first difference at token {_first_difference(copy, sampled)})"
    )
    if changes:
        return Break(BreakCause.REWRITTEN_HISTORY, f"{'; '.join(changes)}: {where}")
    if decode is None:
        return Break(
            BreakCause.OTHER,
            f"{where}; without a tokenizer a re-tokenization cannot be told from a template re-render",
        )
    if decode(copy) == decode(sampled):
        return None
    return Break(BreakCause.TEMPLATE_RERENDER, f"the template rendered the same message differently: {where}")


@dataclass
class Conversation:
    """The parts of a call's request that identify which conversation it belongs to."""

    messages: list[dict[str, Any]]
    tools_json: str

    @property
    def system(self) -> str | None:
        if self.messages and self.messages[0].get("role") in ("system", "developer"):
            return _text(self.messages[0].get("content"))
        return None

    @property
    def first_user(self) -> str | None:
        for message in self.messages:
            if message.get("role") == "user":
                return _text(message.get("content"))
        return None


def conversation(record: CaptureRecord, cache: dict[str, Conversation] | None = None) -> Conversation:
    """The record's parsed conversation; ``cache`` (by record id) parses each record once per session."""
    if cache is None:
        return Conversation(record.messages, record.tools_json)
    found = cache.get(record.record_id)
    if found is None:
        found = cache[record.record_id] = Conversation(record.messages, record.tools_json)
    return found


@dataclass(frozen=True)
class Relation:
    """How a call that extends no chain relates to an earlier chain of its session."""

    brk: Break
    related: int | None  # index of the related chain (None: unrelated)
    # sub-agent vs compaction when only the first user message differs: decided by whether the
    # related chain carries on after this call (a parent does; a compacted conversation does not).
    decide_by_continuation: bool = False


def relate_new_chain(
    record: CaptureRecord,
    tips: list[CaptureRecord],
    decode: Decode | None,
    cache: dict[str, Conversation] | None = None,
) -> Relation:
    """Classify why ``record`` extends none of the chains whose last calls are ``tips``."""
    new = conversation(record, cache)
    if not new.messages:
        return Relation(Break(BreakCause.OTHER, f"call {record.seq} has no captured messages"), None)
    olds = [conversation(tip, cache) for tip in tips]

    compacted = _compaction_relation(new, tips, olds)
    if compacted is not None:
        return compacted

    # Same messages up to the tip's, same tools: the tokens changed under an unchanged history.
    continuing = [
        i
        for i, old in enumerate(olds)
        if old.tools_json == new.tools_json and new.messages[: len(old.messages)] == old.messages
    ]
    if continuing:
        i = max(continuing, key=lambda j: (len(olds[j].messages), j))
        tip = tips[i]
        at = _first_difference(tip.prompt_ids, record.prompt_ids)
        where = f"call {record.seq} changes call {tip.seq}'s prompt at token {at} of {len(tip.prompt_ids)}"
        if decode is not None and decode(record.prompt_ids).startswith(decode(tip.prompt_ids)):
            return Relation(Break(BreakCause.RETOKENIZED, f"same text, new token ids: {where}"), i)
        return Relation(
            Break(BreakCause.TEMPLATE_RERENDER, f"same messages rendered into different tokens: {where}"), i
        )

    same_root = [i for i, old in enumerate(olds) if old.system == new.system and old.first_user == new.first_user]
    if same_root:

        def common(j: int) -> int:
            return _first_difference(olds[j].messages, new.messages)

        i = max(same_root, key=lambda j: (common(j), j))
        old = olds[i]
        if old.tools_json != new.tools_json and new.messages[: len(old.messages)] == old.messages:
            detail = "tool definitions changed"
        else:
            k = common(i)
            detail = (
                f"messages differ from call {tips[i].seq}'s at message {k} "
                f"({len(old.messages)} messages before, {len(new.messages)} now)"
            )
        return Relation(Break(BreakCause.REWRITTEN_HISTORY, detail), i)

    same_system = [i for i, old in enumerate(olds) if old.system == new.system]
    if same_system:
        i = same_system[-1]
        return Relation(
            Break(BreakCause.REWRITTEN_HISTORY, f"first user message replaced (compaction) after call {tips[i].seq}"),
            i,
            decide_by_continuation=True,
        )
    return Relation(Break(BreakCause.SUB_AGENT, "a different system prompt"), None)


def _compaction_relation(new: Conversation, tips: list[CaptureRecord], olds: list[Conversation]) -> Relation | None:
    """A compaction call, or the first call on a compacted history, relates to the latest chain of its
    conversation (same system prompt when there is one)."""
    asking = compaction_prompt(new.messages)
    summary = None if asking is not None else summarised_history(new.messages)
    if summary is not None and any(
        summarised_history(old.messages) == summary and new.messages[: len(old.messages)] == old.messages
        for old in olds
    ):
        summary = None  # continues (or re-sends) a chain that already starts from this summary
    if asking is None and summary is None:
        summary = _summary_answered_by(new, tips, olds)
    if asking is None and summary is None:
        return None
    related = [i for i, old in enumerate(olds) if old.system == new.system] or list(range(len(olds)))
    if summary is not None:
        # The summary continues the conversation it summarised, not the side call that wrote it.
        related = [i for i in related if compaction_prompt(olds[i].messages) is None] or related
    i = related[-1] if related else None
    after = f" after call {tips[i].seq}" if i is not None else ""
    detail = (
        f"{asking} compaction call (asks for a summary){after}"
        if asking is not None
        else f"history replaced by a {summary} compaction summary{after}"
    )
    return Relation(Break(BreakCause.COMPACTION, detail), i)


# Shorter answers could turn up in a history by chance.
MIN_SUMMARY_CHARS = 16


def _summary_answered_by(new: Conversation, tips: list[CaptureRecord], olds: list[Conversation]) -> str | None:
    """The harness whose compaction call (a chain tip) answered the summary ``new``'s history carries, found by the
    answer's text in a user or system message: Gemini CLI and Qwen Code put the model's summary in the history as
    it came, so one that ignored the ``<state_snapshot>`` format has no fixed text to recognise."""
    texts = [message_text(m.get("content")) for m in new.messages if m.get("role") in ("user", "system", "developer")]
    for tip, old in zip(reversed(tips), reversed(olds)):
        harness = compaction_prompt(old.messages)
        answer = ((tip.response_message or {}).get("content") or "") if harness is not None else ""
        answer = answer.strip() if isinstance(answer, str) else ""
        if len(answer) >= MIN_SUMMARY_CHARS and any(answer in text for text in texts):
            return harness
    return None


def as_compaction(record: CaptureRecord, brk: Break) -> Break:
    """A compaction call that could not extend its chain breaks it as a compaction, whatever token
    difference the summarisation prompt made (e.g. the template re-rendering earlier turns)."""
    harness = compaction_prompt(record.messages)
    if harness is None or brk.cause == BreakCause.COMPACTION:
        return brk
    return Break(
        BreakCause.COMPACTION, f"{harness} compaction call (asks for a summary); {brk.cause.value}: {brk.detail}"
    )


def sub_agent_break(parent_seq: int) -> Break:
    return Break(
        BreakCause.SUB_AGENT,
        f"same system prompt, another first user message; the parent conversation continues at call {parent_seq}",
    )
