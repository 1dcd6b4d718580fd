"""The next prompt of a continuing session, in tokens: the previous prompt, the sampled turn, and only the
new messages rendered as a delta with the model's own chat template.

A full re-render of the history can differ from what the model saw and sampled: Qwen3 templates drop
earlier ``<think>`` blocks, and BPE re-tokenizes sampled text (``[fish, ing]`` becomes ``[fishing]``).
The continuation keeps every earlier token as it was, so a session is one exactly on-policy trace:

    next prompt = previous prompt ids + sampled ids + delta ids

The delta is the template's own text after the assistant's end-of-turn token (its glue, e.g. ``\\n``
after ``<|im_end|>``), the new messages and the generation prompt. It is found by rendering the
conversation with the previous assistant turn replaced by a one-time marker: the text after
``marker + end token`` is the delta. A second render with the real turn must end with the same
delta right after the same end token, or the template renders the new messages depending on the
earlier turn and no delta is given. The end token is an added token, which tokenizers always split
on, so the delta's ids are the ids a full render gives the same text.

A turn the engine ended without the template's end-of-turn token continues too: cut by length (``finish_reason``
"length": the model sampled no end token), or stopped by another of the model's stop tokens (Qwen's
``<|endoftext|>`` beside the template's ``<|im_end|>``). The template's own end of a turn (its end-of-turn token and
glue, e.g. ``<|im_end|>\n``, read from the marked render, never written here) is prepended to the delta. Like the
glue after a closed turn, it is context the model did not sample: the build masks it (loss 0) and the chain stays
one exact trace:

    next prompt = previous prompt ids + sampled ids + end-of-turn token + glue + the new messages' ids

No delta (the caller renders in full and starts a new chain) when a stop string ended the turn (its text was
sampled but the harness never saw it), or the template does not fit.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Finish reasons of a turn the engine ended at a stop token (or a stop string: ``matched_stop`` tells).
STOPPED = frozenset({"stop", "tool_calls"})


@dataclass(frozen=True)
class DeltaPrompt:
    prompt_ids: list[int]  # previous prompt + sampled + delta
    delta_ids: list[int]  # end-of-turn glue + the new messages + the generation prompt
    # The sampled turn did not end with the template's end-of-turn token (cut by length, another stop token):
    # delta_ids start with the template's end-of-turn token that closes it.
    closed_by_template: bool = False


@dataclass(frozen=True)
class NoDelta:
    reason: str


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    enable_thinking: bool | None,
    chat_template: str | None,
) -> str:
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return tokenizer.apply_chat_template(
        messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=False, **kwargs
    )


def continuation_prompt(
    tokenizer: Any,
    *,
    prompt_ids: Sequence[int],
    sampled_ids: Sequence[int],
    history: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    enable_thinking: bool | None = None,
    chat_template: str | None = None,
    finish_reason: str | None = None,
    matched_stop: str | None = None,
) -> DeltaPrompt | NoDelta:
    """The next prompt ids, or why there is none.

    ``history`` is the conversation up to and including the assistant turn that ``sampled_ids`` are
    (as the continuity check accepted it); ``new_messages`` follow it. ``tokenizer`` is a Hugging Face
    tokenizer; ``chat_template`` overrides its own template. ``finish_reason`` and ``matched_stop`` are the sampled
    turn's: a turn cut by length, or stopped by a stop token (not a stop string) other than the template's
    end-of-turn token, continues closed by the template's.
    """
    if not sampled_ids:
        return NoDelta("no sampled tokens")
    if not history or not isinstance(history[-1], dict) or history[-1].get("role") != "assistant":
        return NoDelta("the history does not end with the sampled assistant turn")
    added = tokenizer.get_added_vocab()
    end_text = tokenizer.convert_ids_to_tokens(int(sampled_ids[-1]))
    closed = isinstance(end_text, str) and end_text in added
    cut = finish_reason == "length"
    if not closed and not cut:
        return NoDelta("the sampled turn did not end with an end-of-turn token (a stop string, or cut by length)")
    # A fresh marker per call: no message text can contain it by chance or by design.
    marker = f"polar-turn-{secrets.token_hex(16)}"
    try:
        marked = _render(
            tokenizer,
            [*history[:-1], {"role": "assistant", "content": marker}, *new_messages],
            tools,
            enable_thinking,
            chat_template,
        )
        real = _render(tokenizer, [*history, *new_messages], tools, enable_thinking, chat_template)
    except Exception as exc:  # jinja raises its own errors for messages a template rejects
        return NoDelta(f"chat template failed: {type(exc).__name__}: {exc}")
    # A stop token the template does not end turns with: an engine stop, its text never part of the message.
    cut = cut or (closed and finish_reason in STOPPED and matched_stop is None)
    if marked.count(marker) != 1:
        return NoDelta("the template does not render the assistant turn's text once")
    after = marked[marked.index(marker) + len(marker) :]
    if closed and after.startswith(end_text):
        delta = after[len(end_text) :]
        if not delta or not real.endswith(delta) or not real[: len(real) - len(delta)].endswith(end_text):
            return NoDelta("the template renders the new messages differently after the real turn")
        delta_ids = list(tokenizer(delta, add_special_tokens=False)["input_ids"])
        return DeltaPrompt([*map(int, prompt_ids), *map(int, sampled_ids), *delta_ids], delta_ids)
    if not cut:
        return NoDelta(f"the sampled turn ended with {end_text!r}, the template ends a turn otherwise")
    if template_turn_end(after, added) is None:
        return NoDelta("the template does not close a turn with an added token, so it cannot close this one")
    # The closing text starts with an added token, which tokenizers always split on: its ids are the ids a full
    # render gives the same text, whatever the cut sampled ids before it are.
    if not real.endswith(after):
        return NoDelta("the template renders the new messages differently after the real turn")
    delta_ids = list(tokenizer(after, add_special_tokens=False)["input_ids"])
    return DeltaPrompt([*map(int, prompt_ids), *map(int, sampled_ids), *delta_ids], delta_ids, closed_by_template=True)


def template_turn_end(after: str, added_tokens: Mapping[str, int]) -> str | None:
    """The added token the template closes an assistant turn with, as ``after`` (the render after the turn's text)
    starts; the longest when several match. None: the template writes text there first (a space, a newline), which
    the build could not tell from the turn's own text (it splits a turn from its glue at the end-of-turn token)."""
    found = [token for token in added_tokens if token and after.startswith(token)]
    return max(found, key=len) if found else None
