"""Helpers shared by the provider translators: validation, system-prompt hygiene, stream chunking."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import orjson

from polar_addon.canonical import CanonicalRequest, PolarError

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# Streamed text and JSON are cut into pieces of this many characters so a client sees a real
# stream; fixed so the same completion always yields the same events.
STREAM_PIECE_CHARS = 16


def invalid(message: str) -> PolarError:
    return PolarError(400, "invalid_request", message)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def require_str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"'{key}' is required and must be a non-empty string")
    return value


def opt_number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{key}' must be a number")
    return float(value)


# Integers a client sets end up in engine requests and int64 shard columns; anything past int32 is no
# real token count or top_k, and an unbounded one would reach the store (issue 11).
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MAX = 2**63 - 1


def bounded_int(value: Any, where: str, minimum: int | None = None, maximum: int = INT32_MAX) -> int:
    """``value`` as an int within [minimum (default INT32_MIN), maximum], else a 400 naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{where}' must be an integer")
    low = INT32_MIN if minimum is None else minimum
    if value < low:
        raise invalid(f"'{where}' must be >= {low}")
    if value > maximum:
        raise invalid(f"'{where}' must be <= {maximum}")
    return value


def opt_int(body: dict[str, Any], key: str, minimum: int | None = None, maximum: int = INT32_MAX) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    return bounded_int(value, key, minimum, maximum)


def opt_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean")
    return value


def stop_list(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise invalid(f"'{key}' must be a string or a list of strings")


def strip_billing_header(text: str) -> str:
    """Drop Claude Code's per-request attribution line: its hash changes every call and would
    break the token-prefix relation that prefix merging relies on."""
    if BILLING_HEADER_PREFIX not in text:
        return text
    lines = text.split("\n")
    return "\n".join(line for line in lines if not line.lstrip().startswith(BILLING_HEADER_PREFIX))


def system_message(parts: list[str]) -> list[dict[str, Any]]:
    """The single leading system message (or none) built from the request's system texts."""
    parts = [p for p in (strip_billing_header(p).strip("\n") for p in parts) if p.strip()]
    return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []


def drop_tool_choice_without_tools(request: CanonicalRequest) -> CanonicalRequest:
    # Engines reject tool_choice with no tools (Claude Code sends tools=[] on compaction turns).
    if not request.tools:
        request.tool_choice = None
    return request


def pieces(text: str, size: int = STREAM_PIECE_CHARS) -> Iterator[str]:
    for start in range(0, len(text), size):
        yield text[start : start + size]


def compact_json(value: Any) -> str:
    return orjson.dumps(value).decode()


def thinking_signature(thinking: str) -> str:
    """A stable stand-in for Anthropic's opaque thinking signature (clients echo it back; we ignore it)."""
    return "polar-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def arguments_object(arguments: str) -> dict[str, Any]:
    """Tool-call argument text as the JSON object that APIs with object-typed arguments require.

    Text that is not a JSON object (the model wrote a broken call) is passed on whole as
    ``{"raw": text}``, so the harness reports a tool error the model can see instead of the call
    silently vanishing; the record keeps the exact text.
    """
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"raw": arguments}
    return value if isinstance(value, dict) else {"raw": arguments}


# OpenAI text parts are joined the way vLLM and SGLang join them, so our prompt is the one those
# engines would have built from the raw request.
OPENAI_PART_SEPARATOR = "\n"


def content_text(content: Any, where: str, allowed: tuple[str, ...], *, unsupported: tuple[str, ...]) -> str:
    """The text of an OpenAI-style content field: a string, or a list of typed parts.

    Parts of the ``unsupported`` kinds (images, audio, files) get a clear 400: the engine is text
    only. ``refusal`` parts carry their text under ``refusal``, every other kind under ``text``.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: content must be a string or a list of content parts")
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise invalid(f"{where}: each content part must be an object")
        kind = part.get("type")
        if kind in unsupported:
            raise invalid(f"{where}: {kind} parts are not supported by this engine (text only)")
        if kind not in allowed:
            raise invalid(f"{where}: unsupported content part type {kind!r}")
        key = "refusal" if kind == "refusal" else "text"
        value = part.get(key)
        if not isinstance(value, str):
            raise invalid(f"{where}: {kind} part needs a string '{key}'")
        texts.append(value)
    return OPENAI_PART_SEPARATOR.join(texts)
