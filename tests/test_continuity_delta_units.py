"""continuation_prompt's refusals, each with its exact reason (the reason is what a broken chain's record says), and
the ids it returns: plain Python ints, the delta exactly the template's text after the turn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from polar_addon.continuity.delta import STOPPED, DeltaPrompt, NoDelta, continuation_prompt, template_turn_end

# The mutation runs' scratch copies have no models/: they name the tiny model they built.
TINY = Path(os.environ.get("POLAR_TEST_TINY_MODEL") or Path(__file__).resolve().parent.parent / "models" / "tiny")
NEW = [{"role": "user", "content": "go on"}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(TINY)


def ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def session(tok: Any) -> tuple[list[int], list[dict[str, Any]]]:
    messages = [{"role": "user", "content": "hi"}]
    prompt = ids(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return prompt, [*messages, {"role": "assistant", "content": "Hello."}]


def call(tok: Any, sampled: list[int], history: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
    prompt, default = session(tok)
    return continuation_prompt(
        tok, prompt_ids=prompt, sampled_ids=sampled, history=default if history is None else history, **kwargs
    )


def test_no_sampled_tokens(tok: Any) -> None:
    assert call(tok, [], new_messages=NEW) == NoDelta("no sampled tokens")


@pytest.mark.parametrize(
    "history",
    [[], [{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}, ["not", "a", "message"]]],
)
def test_a_history_not_ending_with_the_assistant_turn(tok: Any, history: list[Any]) -> None:
    result = call(tok, [tok.convert_tokens_to_ids("<|im_end|>")], history=history, new_messages=NEW)
    assert result == NoDelta("the history does not end with the sampled assistant turn")


@pytest.mark.parametrize("finish", [None, "stop", "tool_calls"])
def test_a_turn_without_an_added_token_at_its_end_and_not_cut(tok: Any, finish: str | None) -> None:
    result = call(tok, ids(tok, "Hello."), new_messages=NEW, finish_reason=finish)
    assert result == NoDelta("the sampled turn did not end with an end-of-turn token (a stop string, or cut by length)")


def test_another_added_token_without_a_stop_ends_otherwise(tok: Any) -> None:
    eos = [*ids(tok, "Hello."), tok.convert_tokens_to_ids("<|endoftext|>")]
    result = call(tok, eos, new_messages=NEW)
    assert result == NoDelta("the sampled turn ended with '<|endoftext|>', the template ends a turn otherwise")
    # finish "length" on another added token: cut, so the template closes it (and only "stop"/"tool_calls" count).
    assert STOPPED == frozenset({"stop", "tool_calls"})
    assert call(tok, eos, new_messages=NEW, finish_reason="content_filter") == result
    cut = call(tok, eos, new_messages=NEW, finish_reason="length")
    assert isinstance(cut, DeltaPrompt) and cut.closed_by_template


def test_a_template_that_raises_says_which_error(tok: Any) -> None:
    template = "{{ raise_exception('no tools here') }}"
    result = call(tok, [tok.convert_tokens_to_ids("<|im_end|>")], new_messages=NEW, chat_template=template)
    assert isinstance(result, NoDelta)
    assert result.reason == "chat template failed: TemplateError: no tools here"


@pytest.mark.parametrize("times", [0, 2])
def test_a_template_that_renders_the_turn_other_than_once(tok: Any, times: int) -> None:
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' %}" + "{{ m.content }}" * times + "{%- else %}{{ m.content }}{%- endif %}"
        "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    result = call(tok, [tok.convert_tokens_to_ids("<|im_end|>")], new_messages=NEW, chat_template=template)
    assert result == NoDelta("the template does not render the assistant turn's text once")


def test_a_template_with_nothing_after_the_turn_gives_no_delta(tok: Any) -> None:
    # The end token is the render's last text: an empty delta would send the same prompt again.
    template = "{%- for m in messages %}{{ m.content }}<|im_end|>{%- endfor %}"
    result = call(tok, [tok.convert_tokens_to_ids("<|im_end|>")], new_messages=[], chat_template=template)
    assert result == NoDelta("the template renders the new messages differently after the real turn")


def test_the_delta_ids_are_plain_ints_and_exactly_the_text_after_the_end_token(tok: Any) -> None:
    prompt, history = session(tok)
    sampled = [*ids(tok, "Hello."), tok.convert_tokens_to_ids("<|im_end|>")]
    result = continuation_prompt(
        tok,
        prompt_ids=[np.int64(i) for i in prompt],
        sampled_ids=[np.int64(i) for i in sampled],
        history=history,
        new_messages=NEW,
    )
    assert isinstance(result, DeltaPrompt) and not result.closed_by_template
    assert result.delta_ids == ids(tok, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    assert result.prompt_ids == [*prompt, *sampled, *result.delta_ids]
    assert all(type(i) is int for i in result.prompt_ids)


def test_a_cut_turn_is_closed_with_the_end_token_and_glue_as_plain_ints(tok: Any) -> None:
    prompt, history = session(tok)
    sampled = ids(tok, "Hello.")
    result = continuation_prompt(
        tok,
        prompt_ids=prompt,
        sampled_ids=[np.int64(i) for i in sampled],
        history=history,
        new_messages=NEW,
        finish_reason="length",
    )
    assert isinstance(result, DeltaPrompt) and result.closed_by_template
    assert result.delta_ids == ids(tok, "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    assert result.prompt_ids == [*prompt, *sampled, *result.delta_ids]
    assert all(type(i) is int for i in result.prompt_ids)


def test_template_turn_end_ignores_an_empty_added_token() -> None:
    assert template_turn_end("<|im_end|>", {"": 0}) is None
    assert template_turn_end("<|im_end|>x", {"": 0, "<|im_end|>": 2}) == "<|im_end|>"


TURN = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def test_the_delta_is_rendered_with_the_callers_thinking_switch(tok: Any) -> None:
    # Qwen3's template writes an empty think block into the generation prompt when thinking is off.
    template = (
        TURN + "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    sampled = [*ids(tok, "Hello."), tok.convert_tokens_to_ids("<|im_end|>")]
    off = call(tok, sampled, new_messages=NEW, chat_template=template, enable_thinking=False)
    assert isinstance(off, DeltaPrompt)
    assert off.delta_ids == ids(
        tok, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    on = call(tok, sampled, new_messages=NEW, chat_template=template, enable_thinking=True)
    assert isinstance(on, DeltaPrompt)
    assert on.delta_ids == ids(tok, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")


def test_the_delta_is_rendered_with_the_tools_and_the_whole_conversation(tok: Any) -> None:
    # A template may write after the new messages what depends on the tools and the earlier messages: the delta is
    # what a full render writes there.
    template = (
        TURN + "{% if add_generation_prompt %}<|im_start|>assistant {{ (tools or [])|length }} tools, "
        "{{ messages|length }} messages\n{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    history = [
        {"role": "system", "content": "terse"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    sampled = [*ids(tok, "Hello."), tok.convert_tokens_to_ids("<|im_end|>")]
    result = call(tok, sampled, history=history, new_messages=NEW, chat_template=template, tools=tools)
    assert isinstance(result, DeltaPrompt)
    assert result.delta_ids == ids(
        tok, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant 1 tools, 4 messages\n"
    )
    none = call(tok, sampled, history=history, new_messages=NEW, chat_template=template)
    assert isinstance(none, DeltaPrompt) and none.delta_ids[-6:] == ids(tok, " 0 tools, 4 messages\n")[-6:]


def test_a_real_turn_closed_otherwise_than_the_marked_one_gives_no_delta(tok: Any) -> None:
    # The full render ends with the same delta, but not right after the end token the marked render has.
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{%- if m.role == 'assistant' and not m.content.startswith('polar-turn-') %}<|endoftext|>"
        "{%- else %}<|im_end|>{%- endif %}\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    sampled = [*ids(tok, "Hello."), tok.convert_tokens_to_ids("<|im_end|>")]
    result = call(tok, sampled, new_messages=NEW, chat_template=template)
    assert result == NoDelta("the template renders the new messages differently after the real turn")


@pytest.mark.parametrize("finish", [None, "length"])
def test_a_template_writing_the_earlier_turn_after_the_new_messages_gives_no_delta(
    tok: Any, finish: str | None
) -> None:
    template = (
        TURN + "{% if add_generation_prompt %}<|im_start|>assistant {{ messages[1].content|length }}\n{%- endif %}"
    )
    sampled = ids(tok, "Hello.") + ([] if finish else [tok.convert_tokens_to_ids("<|im_end|>")])
    result = call(tok, sampled, new_messages=NEW, chat_template=template, finish_reason=finish)
    assert result == NoDelta("the template renders the new messages differently after the real turn")


def test_a_template_writing_text_before_its_end_token_cannot_close_a_cut_turn(tok: Any) -> None:
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\n<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    result = call(tok, ids(tok, "Hello the"), new_messages=NEW, chat_template=template, finish_reason="length")
    assert result == NoDelta("the template does not close a turn with an added token, so it cannot close this one")


def test_another_stop_token_continues_unless_it_was_a_stop_strings_text(tok: Any) -> None:
    eos = [*ids(tok, "Hello."), tok.convert_tokens_to_ids("<|endoftext|>")]
    stopped = call(tok, eos, new_messages=NEW, finish_reason="stop")
    assert isinstance(stopped, DeltaPrompt) and stopped.closed_by_template
    assert stopped.delta_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    matched = call(tok, eos, new_messages=NEW, finish_reason="stop", matched_stop="<|endoftext|>")
    assert matched == NoDelta("the sampled turn ended with '<|endoftext|>', the template ends a turn otherwise")


class WithBos:
    """The tiny tokenizer as Llama's and Gemma's behave: a BOS first unless ``add_special_tokens=False``."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.bos = tok.convert_tokens_to_ids("<|endoftext|>")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        found = self.tok(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": [self.bos, *found] if add_special_tokens else found}


@pytest.mark.parametrize("finish", [None, "length"])
def test_a_bos_adding_tokenizer_puts_no_bos_into_the_delta(tok: Any, finish: str | None) -> None:
    # The delta continues a prompt: a BOS in its middle is a token no full render has.
    sampled = ids(tok, "Hello.") + ([] if finish else [tok.convert_tokens_to_ids("<|im_end|>")])
    result = call(WithBos(tok), sampled, new_messages=NEW, finish_reason=finish)
    assert isinstance(result, DeltaPrompt)
    text = "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert result.delta_ids == ids(tok, ("<|im_end|>" if finish else "") + text)
