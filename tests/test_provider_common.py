"""The helpers every provider translator shares, value by value (polar_addon.providers.common)."""

from __future__ import annotations

import hashlib

import pytest

from polar_addon.canonical import PolarError
from polar_addon.providers.common import (
    content_text,
    opt_bool,
    strip_billing_header,
    system_message,
    thinking_signature,
)

HEADER = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cch=9f2e;"


def test_opt_bool_reads_absent_and_null_as_false() -> None:
    assert [opt_bool(body, "stream") for body in ({}, {"stream": None}, {"stream": False}, {"stream": True})] == [
        False,
        False,
        False,
        True,
    ]
    with pytest.raises(PolarError, match="^'stream' must be a boolean$"):
        opt_bool({"stream": 1}, "stream")


def test_the_billing_header_line_is_dropped_wherever_it_is_indented() -> None:
    text = f"You are Claude Code.\n  {HEADER}\nBe brief.\nUse tools."
    assert strip_billing_header(text) == "You are Claude Code.\nBe brief.\nUse tools."
    assert strip_billing_header(f"{HEADER}\n") == ""
    # The prefix inside a line is not a header line.
    assert strip_billing_header(f"see {HEADER}") == f"see {HEADER}"


def test_system_message_trims_only_newlines_around_each_part() -> None:
    assert system_message(["  Indented rules.  \n\n", "\nXylophone X\n", " \n ", HEADER]) == [
        {"role": "system", "content": "  Indented rules.  \n\nXylophone X"}
    ]
    assert system_message([]) == [] and system_message(["\n", HEADER]) == []


def test_thinking_signature_is_a_stable_hash_of_the_thinking() -> None:
    assert thinking_signature("plan") == "polar-" + hashlib.sha256(b"plan").hexdigest()[:32]
    assert len(thinking_signature("")) == len("polar-") + 32


def test_content_parts_must_be_objects() -> None:
    with pytest.raises(PolarError) as err:
        content_text(["text"], "messages[0]", ("text",), unsupported=())
    assert (err.value.status, err.value.kind, err.value.message) == (
        400,
        "invalid_request",
        "messages[0]: each content part must be an object",
    )
