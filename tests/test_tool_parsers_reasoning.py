"""The ``<think>`` split every Qwen-family format shares, at its edges, and the call ids polar mints."""

from __future__ import annotations

import re

import pytest

from polar_addon.canonical import AssistantMessage
from polar_addon.tool_parsers.calls import ParsedTurn, new_call_id
from polar_addon.tool_parsers.reasoning import split_reasoning


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The opening tag is in the generation prompt: the output starts with the reasoning.
        ("plan</think>\n\nanswer", ("plan", "answer")),
        # An empty thought whose close is the very first thing sampled: no reasoning, the close is not content.
        ("</think>\n\nHello", (None, "Hello")),
        ("<think>\n\n</think>\n\nHello", (None, "Hello")),
        # The first close ends the reasoning; a later one is the answer's text.
        ("a</think>b</think>c", ("a", "b</think>c")),
        # The first open starts it; a second open inside is reasoning text.
        ("<think>a<think>b</think>c", ("a<think>b", "c")),
        # Cut off while thinking: all of it is reasoning, a nested open included.
        ("<think>a<think>b", ("a<think>b", "")),
        ("  \n<think>a", ("a", "")),
        # An open after other text is ordinary text.
        ("x<think>a", (None, "x<think>a")),
        ("no tags", (None, "no tags")),
        ("", (None, "")),
    ],
)
def test_split_reasoning(text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text) == expected


def test_call_ids_are_openai_shaped_and_unique() -> None:
    ids = [new_call_id() for _ in range(200)]
    # call_ and 24 lowercase hex digits (12 random bytes), the length OpenAI's own call ids have.
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids), ids[:3]
    assert len(set(ids)) == len(ids)


def test_parse_failed_is_whether_any_block_failed() -> None:
    message = AssistantMessage(content="x")
    assert ParsedTurn(message).parse_failed is False
    assert ParsedTurn(message, ["<tool_call>"]).parse_failed is True
    assert ParsedTurn(message).failed == [] and ParsedTurn(message).parser is None
