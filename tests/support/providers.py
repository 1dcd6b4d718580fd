"""Shared builders for the provider translator tests."""

from __future__ import annotations

from collections.abc import Iterable

import httpx

from polar_addon.canonical import AssistantMessage, Completion, ToolCall
from polar_addon.providers import StreamEvent, encode_sse


def completion(
    content: str | None = "Hello! How can I help you today?",
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
    finish_reason: str = "stop",
    matched_stop: str | None = None,
    cached_tokens: int | None = None,
    served_model: str = "qwen-test",
) -> Completion:
    """An engine completion of 11 prompt and 7 response tokens around the given message."""
    return Completion(
        message=AssistantMessage(content=content, reasoning=reasoning, tool_calls=tool_calls or []),
        finish_reason=finish_reason,  # type: ignore[arg-type]
        prompt_ids=list(range(11)),
        response_ids=list(range(7)),
        logprobs=[-0.5] * 7,
        served_model=served_model,
        engine="test",
        matched_stop=matched_stop,
        cached_tokens=cached_tokens,
    )


def canned_http(status: int, body: bytes, content_type: str) -> httpx.Client:
    """An httpx client whose every request gets this answer: feeds our bytes to an official SDK."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": content_type})

    return httpx.Client(transport=httpx.MockTransport(handler))


def sse_bytes(events: Iterable[StreamEvent], prefix: bytes = b"") -> bytes:
    return prefix + b"".join(encode_sse(e) for e in events)
