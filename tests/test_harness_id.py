"""Harnesses are named from what they send: Pi speaks through the provider SDKs (User-Agent ``OpenAI/JS …``),
so its calls are told from a plain SDK client's by Pi's own system prompt, read here from the installed Pi."""

from __future__ import annotations

import re
from pathlib import Path

from polar_addon.canonical import CanonicalRequest
from polar_addon.harness_id import harness_name
from tests.support.prereq import missing

PI_PROMPT = (
    Path(__file__).resolve().parents[1]
    / ".harness/node_modules/@mariozechner/pi-coding-agent/dist/core/system-prompt.js"
)


def request(system: str | None) -> CanonicalRequest:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return CanonicalRequest(api="openai_chat", model="m", messages=[*messages, {"role": "user", "content": "hi"}])


def pi_system_prompt() -> str:
    if not PI_PROMPT.is_file():
        missing(f"{PI_PROMPT} missing: run `make harnesses`")
    # The template literal Pi builds its prompt from, up to its first interpolation.
    match = re.search(r"let prompt = `([^`$]+)", PI_PROMPT.read_text())
    assert match, "Pi's system prompt template moved"
    return match.group(1) + "\n\nAvailable tools: read, bash"


def test_pi_is_named_and_the_sdk_alone_is_not() -> None:
    pi = pi_system_prompt()
    assert harness_name("OpenAI/JS 6.26.0", request(pi)) == "pi (OpenAI/JS 6.26.0)"
    assert harness_name("Anthropic/JS 0.90.0", request(pi)) == "pi (Anthropic/JS 0.90.0)"
    assert harness_name(None, request(pi)) == "pi"
    assert harness_name("OpenAI/JS 6.26.0", request("You are a helpful assistant.")) == "OpenAI/JS 6.26.0"
    assert harness_name("OpenAI/Python 2.8.1", request(None)) == "OpenAI/Python 2.8.1"
    assert harness_name("claude-cli/2.1.197 (external, sdk-cli)", None) == "claude-cli/2.1.197 (external, sdk-cli)"
    # A user who quotes Pi's prompt later in the conversation does not become Pi.
    quoted = request("You are a helpful assistant.")
    quoted.messages[1]["content"] = pi
    assert harness_name("OpenAI/JS 6.26.0", quoted) == "OpenAI/JS 6.26.0"
