"""Provider APIs: one module per wire protocol, each a set of pure functions.

A provider module exposes a module-level ``PROVIDER`` object satisfying :class:`Provider`.
Modules never import mitmproxy or do network I/O: the gateway calls them with parsed bodies
and sends what they return. Adding a provider is one new module plus one line in ``PROVIDERS``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from polar_addon.canonical import CanonicalRequest, Completion, PolarError


@dataclass
class ResponseContext:
    """Per-call values a rendered response needs that are not in the completion."""

    response_id: str  # provider-shaped id, e.g. "chatcmpl-…", "msg_…", "resp_…"
    created: int  # unix seconds
    model: str  # model name echoed to the client (the one it asked for)
    # Per-call provider state across keep-alives and the final events (e.g. OpenAI Responses'
    # sequence numbers): it lives with the call, never in the provider object.
    stream_state: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamEvent:
    """One streamed event; the gateway encodes it as SSE (or a WebSocket message).

    ``event`` is the SSE ``event:`` name (None for data-only streams such as OpenAI Chat);
    ``data`` is a JSON object, or a literal string such as ``[DONE]``.
    """

    data: dict[str, Any] | str
    event: str | None = None


@dataclass
class Route:
    """What the gateway should do with one request path."""

    kind: str  # "generate" (a model call), "count_tokens", or "local" (answered without the engine)
    stream_hint: bool | None = None  # the path itself says streaming (Gemini streamGenerateContent)
    model: str | None = None  # model named in the path (Gemini)
    params: dict[str, Any] = field(default_factory=dict)
    # Set by the gateway for parse_request: whose call this is and how big its body was (providers that keep
    # per-session state bound it by these).
    session: str | None = None
    body_bytes: int = 0


class Provider(Protocol):
    name: str  # recorded as CaptureRecord.api

    def route(self, method: str, path: str) -> Route | None:
        """Return a Route when this provider owns ``path`` (query string included), else None."""

    def parse_request(self, body: dict[str, Any], route: Route) -> CanonicalRequest:
        """Validate and normalize; raise PolarError(400, "invalid_request", …) on bad input."""

    def render_response(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> dict[str, Any] | list[Any]:
        """The non-streaming body (a list for Gemini's JSON-array stream)."""

    def render_stream(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> Iterator[StreamEvent]: ...

    def keepalive(self, request: CanonicalRequest, ctx: ResponseContext) -> bytes:
        """Raw SSE bytes that keep a streaming client's idle timer alive while the engine works.

        Called repeatedly for one call before its ``render_stream``/``render_stream_error``; what
        those must know about bytes already sent goes into ``ctx.stream_state``.
        """

    def render_error(self, error: PolarError) -> dict[str, Any]:
        """The JSON error body in this provider's shape (the HTTP status is ``error.status``)."""

    def render_stream_error(self, error: PolarError, ctx: ResponseContext) -> Iterator[StreamEvent]:
        """Events that report ``error`` once a stream has already started."""

    def render_count_tokens(self, count: int) -> dict[str, Any]:
        """Body answering a token-count route (providers without one raise NotImplementedError)."""


def encode_sse(event: StreamEvent) -> bytes:
    import orjson

    data = event.data if isinstance(event.data, str) else orjson.dumps(event.data).decode()
    head = f"event: {event.event}\n" if event.event else ""
    return f"{head}data: {data}\n\n".encode()


def all_providers() -> list[Provider]:
    """Every provider, in routing order (a request goes to the first whose ``route`` matches).

    Responses keeps a history of recent responses for ``previous_response_id``: each gateway gets
    its own instance rather than sharing module state.
    """
    # Imported here: the provider modules import this package's types.
    from polar_addon.providers import anthropic_messages, gemini, openai_chat, openai_responses

    return [
        openai_chat.PROVIDER,
        anthropic_messages.PROVIDER,
        openai_responses.OpenAIResponsesProvider(),
        gemini.PROVIDER,
    ]
