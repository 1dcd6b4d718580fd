"""Which harness a capture names (harness_id): the User-Agent as sent, or the harness whose system prompt opens the
conversation with the SDK's User-Agent in parentheses. Only a first, system, text message counts, and only within
its first SYSTEM_PREFIX characters (a harness's prompt opens with its marker; a long prompt is not searched)."""

from __future__ import annotations

from typing import Any

import pytest

from polar_addon.canonical import CanonicalRequest
from polar_addon.harness_id import SYSTEM_MARKERS, SYSTEM_PREFIX, harness_name

PI = "You are an expert coding assistant operating inside pi, a coding agent harness."
UA = "OpenAI/Python 2.54.0"


def request(*messages: dict[str, Any]) -> CanonicalRequest:
    return CanonicalRequest(api="openai_chat", model="m", messages=list(messages))


def system(text: Any) -> dict[str, Any]:
    return {"role": "system", "content": text}


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("prompt", "name"),
    [
        (PI + "\n\nAvailable tools: read, bash", "pi"),
        ("You are gptme v0.35.0, a general-purpose AI assistant.", "gptme"),
        ("You are OpenHands agent, a helpful AI assistant.", "openhands"),
    ],
)
def test_each_harness_is_named_by_its_prompt_with_the_sdk_agent_after_it(prompt: str, name: str) -> None:
    assert harness_name(UA, request(system(prompt), USER)) == f"{name} ({UA})"
    assert harness_name(None, request(system(prompt), USER)) == name
    assert harness_name("", request(system(prompt), USER)) == name  # an empty header names nothing


def test_the_markers_are_the_three_harnesses_that_send_only_an_sdk_user_agent() -> None:
    assert [name for _, name in SYSTEM_MARKERS] == ["pi", "gptme", "openhands"]
    assert SYSTEM_PREFIX == 512


def test_a_marker_counts_up_to_the_prefix_limit_and_not_one_character_past_it() -> None:
    inside = "x" * (SYSTEM_PREFIX - len(PI)) + PI  # its last character is the 512th
    past = "x" * (SYSTEM_PREFIX - len(PI) + 1) + PI
    assert harness_name(UA, request(system(inside))) == f"pi ({UA})"
    assert harness_name(UA, request(system(past))) == UA


@pytest.mark.parametrize(
    "req",
    [
        None,
        request(),
        request(USER, system(PI)),  # a system message later in the conversation is not the harness's prompt
        request({"role": "user", "content": PI}),  # a user who quotes a harness's prompt is not that harness
        request(system([{"type": "text", "text": PI}])),  # content parts: not read
        request(system(None)),
        request({"content": PI}),  # no role
        request(system("You are a helpful assistant."), USER),
    ],
    ids=["no_request", "no_messages", "system_later", "user_quotes", "parts", "null", "no_role", "other_prompt"],
)
def test_without_a_marker_in_a_first_system_text_the_user_agent_is_kept_as_sent(req: CanonicalRequest | None) -> None:
    assert harness_name(UA, req) == UA
    assert harness_name(None, req) is None
