"""context_compaction's pure rules: which harness a compaction call or a summarised history belongs to, and polar's
own opaque compaction item (its encoding, and what is refused as not polar's)."""

from __future__ import annotations

import base64

import pytest

from polar_addon.context_compaction import (
    ENCRYPTED_PREFIX,
    POLAR_COMPACTION_PROMPT,
    POLAR_SUMMARY_PREFIX,
    PROMPT_MARKERS,
    compaction_prompt,
    decode_summary,
    encode_summary,
    message_text,
    summarised_history,
    summary_message,
)

# The harnesses' own texts, as they send them (with text around the marker).
PROMPTS = {
    "polar": POLAR_COMPACTION_PROMPT,
    "claude-code": "Your task is to create a detailed summary of the conversation so far, paying close attention",
    "codex": "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary",
    "qwen-code": "You are the component that summarizes internal chat history into a given structure.",
    "gemini-cli": "You are the component distilling chat history into a structured XML <state_snapshot>.",
}
PI_PROMPTS = [
    "Create a structured context checkpoint summary of the conversation",
    "Here are NEW conversation messages to incorporate into the existing summary:",
    "This is the PREFIX of a turn that was too large to keep. Summarise it",
]
SUMMARIES = {
    "polar": f"{POLAR_SUMMARY_PREFIX}\n\nGoal: x",
    "claude-code": "This session is being continued from a previous conversation that ran out of context. Summary:",
    "codex": "Another language model started to solve this problem and produced a summary of its thinking",
    "gemini-cli/qwen-code": "<state_snapshot><overall_goal>x</overall_goal></state_snapshot>",
    "pi": "The conversation history before this point was compacted into the following summary:",
}


def test_the_polar_texts_are_the_ones_the_engine_and_codex_see() -> None:
    assert POLAR_COMPACTION_PROMPT.startswith("[polar] Context compaction. The conversation above is about to be")
    assert POLAR_COMPACTION_PROMPT.endswith("and the next steps. Do not call tools.")
    assert PROMPT_MARKERS["polar"] == (POLAR_COMPACTION_PROMPT[:40],)
    assert POLAR_SUMMARY_PREFIX == "[polar] Summary of the earlier part of this conversation, which was compacted:"
    assert ENCRYPTED_PREFIX == "polar-summary:v1:"


@pytest.mark.parametrize("harness", sorted(PROMPTS))
def test_each_harness_compaction_prompt_is_known_as_the_last_user_message(harness: str) -> None:
    messages = [
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": PROMPTS[harness]},
    ]
    assert compaction_prompt(messages) == harness


@pytest.mark.parametrize("text", PI_PROMPTS)
def test_each_of_pis_three_compaction_prompts_is_known(text: str) -> None:
    assert compaction_prompt([{"role": "user", "content": [{"type": "text", "text": text}]}]) == "pi"


@pytest.mark.parametrize("role", ["system", "developer"])
def test_a_compaction_prompt_in_the_system_prompt_is_known_whatever_the_last_user_says(role: str) -> None:
    messages = [{"role": role, "content": PROMPTS["gemini-cli"]}, {"role": "user", "content": "the history"}]
    assert compaction_prompt(messages) == "gemini-cli"


def test_a_first_user_message_is_not_read_as_a_system_prompt() -> None:
    # Only the last user message counts: a compaction text in an earlier one is a quoted prompt, not a request.
    messages = [
        {"role": "user", "content": PROMPTS["codex"]},
        {"role": "user", "content": "now go on"},
    ]
    assert compaction_prompt(messages) is None


def test_an_ordinary_system_prompt_falls_through_to_the_last_user_message() -> None:
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": PROMPTS["codex"]}]
    assert compaction_prompt(messages) == "codex"


def test_a_compaction_text_before_the_last_assistant_turn_is_not_a_compaction_call() -> None:
    messages = [
        {"role": "user", "content": PROMPTS["claude-code"]},
        {"role": "assistant", "content": "summary"},
        {"role": "tool", "content": "output"},
    ]
    assert compaction_prompt(messages) is None


def test_the_last_user_message_decides_even_after_tool_messages() -> None:
    messages = [
        {"role": "user", "content": PROMPTS["claude-code"]},
        {"role": "tool", "content": "output"},
    ]
    assert compaction_prompt(messages) == "claude-code"
    assert compaction_prompt([]) is None
    assert compaction_prompt([{"role": "tool", "content": PROMPTS["codex"]}]) is None


@pytest.mark.parametrize("harness", sorted(SUMMARIES))
def test_each_harness_summary_is_known_in_the_history(harness: str) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": SUMMARIES[harness]}]},
        {"role": "assistant", "content": "ok"},
    ]
    assert summarised_history(messages) == harness


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_a_summary_is_read_from_user_system_and_developer_messages(role: str) -> None:
    assert summarised_history([{"role": role, "content": SUMMARIES["codex"]}]) == "codex"


def test_a_summary_text_in_an_assistant_or_tool_message_is_not_a_summarised_history() -> None:
    messages = [{"role": "assistant", "content": SUMMARIES["pi"]}, {"role": "tool", "content": SUMMARIES["codex"]}]
    assert summarised_history(messages) is None
    assert summarised_history([{"role": "user", "content": "hello"}]) is None


def test_the_first_summary_in_the_history_decides() -> None:
    messages = [{"role": "user", "content": SUMMARIES["pi"]}, {"role": "user", "content": SUMMARIES["codex"]}]
    assert summarised_history(messages) == "pi"


def test_message_text_joins_text_parts_and_ignores_the_rest() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, "loose", {"type": "text", "text": "b"}]
    assert message_text(parts) == "ab"
    assert message_text("plain") == "plain"
    assert message_text(None) == ""
    assert message_text({"text": "a dict is not a list of parts"}) == ""


def test_a_polar_summary_round_trips_and_is_base64_after_the_prefix() -> None:
    encoded = encode_summary("Goal: fix it. é")
    assert encoded == "polar-summary:v1:" + base64.b64encode("Goal: fix it. é".encode()).decode()
    assert decode_summary(encoded) == "Goal: fix it. é"
    assert decode_summary(encode_summary("")) == ""


@pytest.mark.parametrize(
    "encrypted",
    [
        None,
        123,
        "gAAAAABopenai-own-encrypted-content",
        base64.b64encode(b"no prefix").decode(),
        "polar-summary:v1:not base64!",
        "polar-summary:v1:e A==",  # validate: a character outside the alphabet is refused, not skipped (else "x")
        "polar-summary:v1:" + base64.b64encode(b"\xff\xfe").decode(),  # not UTF-8
        "polar-summary:v2:" + base64.b64encode(b"x").decode(),
    ],
)
def test_anything_but_a_polar_summary_decodes_to_none(encrypted: object) -> None:
    assert decode_summary(encrypted) is None


def test_the_summary_message_is_a_user_message_with_the_prefix_and_a_blank_line() -> None:
    message = summary_message("Goal: x")
    assert message == {"role": "user", "content": f"{POLAR_SUMMARY_PREFIX}\n\nGoal: x"}
    assert summarised_history([message]) == "polar"
