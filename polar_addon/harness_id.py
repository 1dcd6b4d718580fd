"""Which harness made a call, from what it sends.

Most harness CLIs name themselves in their User-Agent (``claude-cli/…``, ``codex_exec/…``, ``QwenCode/…``,
``GeminiCLI/…``), and that is kept as is. Some speak through a provider SDK that sends only the SDK's own
User-Agent: Pi 0.73 sends ``OpenAI/JS 6.26.0``, ``Anthropic/JS …`` or ``google-genai-sdk/…`` exactly like any
program using those SDKs, and sets no header of its own; gptme 0.35 sends ``OpenAI/Python 2.54.0``, OpenHands 0.62
``OpenAI/Python 1.99.9`` (LiteLLM's). Those are told apart by their system prompt, which opens the same way on every
call of the harness; the SDK's User-Agent stays in parentheses.
"""

from __future__ import annotations

from polar_addon.canonical import CanonicalRequest

# (text the harness's system prompt opens with, harness name); only the first SYSTEM_PREFIX characters are looked at.
SYSTEM_MARKERS: tuple[tuple[str, str], ...] = (
    ("You are an expert coding assistant operating inside pi, a coding agent harness.", "pi"),
    ("You are gptme v", "gptme"),  # gptme 0.35 sends the openai SDK's User-Agent only
    ("You are OpenHands agent, ", "openhands"),  # OpenHands 0.62 (LiteLLM's openai provider): the SDK's User-Agent only
)
SYSTEM_PREFIX = 512


def harness_name(user_agent: str | None, request: CanonicalRequest | None) -> str | None:
    """The harness to record: the User-Agent, or ``NAME (User-Agent)`` when the system prompt names it."""
    system = _system_text(request)
    for marker, name in SYSTEM_MARKERS:
        if marker in system:
            return f"{name} ({user_agent})" if user_agent else name
    return user_agent


def _system_text(request: CanonicalRequest | None) -> str:
    if request is None or not request.messages:
        return ""
    first = request.messages[0]
    content = first.get("content") if first.get("role") == "system" else None
    return content[:SYSTEM_PREFIX] if isinstance(content, str) else ""
