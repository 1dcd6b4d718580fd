"""Hostile inputs for every translator and for identity, a recording fake upstream, and hypothesis strategies.

Shared by the hostile-input tests and ``bench/reliability.py``: the same triggers and the same invariant
(a provider-shaped 4xx or a valid answer; never an internal error; nothing reaches upstream).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st

PATHS = {
    "openai_chat": "/v1/chat/completions",
    "anthropic_messages": "/v1/messages",
    "openai_responses": "/v1/responses",
    "gemini": "/v1beta/models/tiny:generateContent",
}
TOO_BIG = 9223372036854775813  # 2^63 + 5


def deep(levels: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def valid_body(api: str) -> dict[str, Any]:
    """A small valid request of each API (one tool, so tool fields have something to break)."""
    if api == "openai_chat":
        return {
            "model": "tiny",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
        }
    if api == "anthropic_messages":
        return {
            "model": "tiny",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
        }
    if api == "openai_responses":
        return {
            "model": "tiny",
            "max_output_tokens": 8,
            "input": "hi",
            "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
        }
    return {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": {"maxOutputTokens": 8},
        "tools": [{"functionDeclarations": [{"name": "ls", "parameters": {"type": "object"}}]}],
    }


@dataclass
class Trigger:
    name: str
    api: str
    body: dict[str, Any] | bytes
    headers: dict[str, Any] = field(default_factory=dict)
    expect: int = 400  # the status polar must answer

    def encoded(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else encode_body(self.body)


def encode_body(value: Any) -> bytes:
    """JSON bytes of any test body; the stdlib encoder (with room to recurse) for what orjson refuses to write."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        import sys

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(10_000)
        try:
            return json.dumps(value).encode()
        finally:
            sys.setrecursionlimit(limit)


def _with(api: str, **changes: Any) -> dict[str, Any]:
    body = valid_body(api)
    body.update(changes)
    return body


def triggers() -> list[Trigger]:
    """Every input issue 11 found to crash the addon, poison the store or leak upstream."""
    gemini_config = valid_body("gemini")["generationConfig"]
    return [
        Trigger("chat max_tokens 2^63+5", "openai_chat", _with("openai_chat", max_tokens=TOO_BIG)),
        Trigger("chat top_k 2^63+5", "openai_chat", _with("openai_chat", top_k=TOO_BIG)),
        Trigger("anthropic top_k 2^63+5", "anthropic_messages", _with("anthropic_messages", top_k=TOO_BIG)),
        Trigger("anthropic max_tokens 2^63+5", "anthropic_messages", _with("anthropic_messages", max_tokens=TOO_BIG)),
        Trigger(
            "responses max_output_tokens 2^63+5",
            "openai_responses",
            _with("openai_responses", max_output_tokens=TOO_BIG),
        ),
        Trigger(
            "gemini maxOutputTokens 2^63+5",
            "gemini",
            _with("gemini", generationConfig={**gemini_config, "maxOutputTokens": TOO_BIG}),
        ),
        Trigger("gemini topK 2^63+5", "gemini", _with("gemini", generationConfig={**gemini_config, "topK": TOO_BIG})),
        Trigger(
            "chat tool schema 300 deep",
            "openai_chat",
            _with("openai_chat", tools=[{"type": "function", "function": {"name": "f", "parameters": deep(300)}}]),
        ),
        Trigger(
            "anthropic tool_use input 300 deep",
            "anthropic_messages",
            _with(
                "anthropic_messages",
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": deep(300)}],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
                ],
            ),
        ),
        Trigger(
            "chat tool_choice.function a string",
            "openai_chat",
            _with("openai_chat", tool_choice={"type": "function", "function": "ls"}),
        ),
        Trigger(
            "responses tool type a list",
            "openai_responses",
            _with("openai_responses", tools=[{"type": ["function"], "name": "ls"}]),
        ),
        Trigger(
            "gemini schema 990 deep",
            "gemini",
            _with("gemini", tools=[{"functionDeclarations": [{"name": "f", "parameters": deep(990)}]}]),
        ),
        Trigger(
            "identity sample=2^63",
            "openai_chat",
            valid_body("openai_chat"),
            {"x-polar-session": "s-sample", "x-polar-sample": str(2**63)},
        ),
        Trigger(
            "identity session id with NUL",
            "openai_chat",
            valid_body("openai_chat"),
            {"authorization": "Bearer polar:session=a%00b"},
        ),
        Trigger(
            "identity session id of 200 kB",
            "openai_chat",
            valid_body("openai_chat"),
            {"x-polar-session": "s" * 200_000},
        ),
        Trigger(
            "non-UTF-8 x-polar-session", "openai_chat", valid_body("openai_chat"), {"x-polar-session": b"s\xff\xfe"}
        ),
        Trigger(
            "non-UTF-8 x-polar-task",
            "openai_chat",
            valid_body("openai_chat"),
            {"x-polar-session": "s-task", "x-polar-task": b"t\xff"},
        ),
        Trigger(
            "non-UTF-8 User-Agent",
            "openai_chat",
            valid_body("openai_chat"),
            {"user-agent": b"agent\xff\xfe/1"},
            expect=200,
        ),
        Trigger("invalid UTF-8 body", "anthropic_messages", b'{"model": "tiny\xff", "max_tokens": 8, "messages": []}'),
        Trigger("lone surrogate in body", "openai_responses", b'{"model": "tiny", "input": "\\ud800"}'),
    ]


def is_provider_error(api: str, status: int, body: bytes) -> bool:
    """Whether ``body`` is an error in ``api``'s own shape."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    if api == "anthropic_messages":
        return data.get("type") == "error" and "message" in data["error"]
    if api == "gemini":
        return data["error"].get("code") == status
    return "message" in data["error"]


class RecordingUpstream:
    """A fake upstream that records every request it gets: any entry means a flow leaked past polar."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                seen.append((self.command, self.path, dict(self.headers.items())))
                body = b'{"leaked": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingUpstream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_script(path: Path, model_dir: Path, latency_s: float = 0.0) -> str:
    """A scripted engine that always answers a short text (an instant engine with real tokens)."""
    path.write_text(
        json.dumps({"model_dir": str(model_dir), "cycle": True, "latency_s": latency_s, "turns": [{"content": "ok"}]})
    )
    return f"scripted:{path}"


# ---- hypothesis strategies -----------------------------------------------------------------------------------

_ABSURD_NUMBERS = st.sampled_from([TOO_BIG, 2**64 - 1, -(2**63), 2**31, -1, 0, 1e308, -1e308, 5e-324, 1.5])
_TEXT = st.text(st.characters(codec="utf-8"), max_size=24) | st.sampled_from(
    ["", "\x00", "[/bold]", "\x1b]0;x\x07", "a" * 5000]
)
_LEAF = (
    st.none()
    | st.booleans()
    | _ABSURD_NUMBERS
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
JSON_VALUES = st.recursive(
    _LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=12
)

# Fields each API reads, top level and inside its usual nested objects.
_FIELDS = {
    "openai_chat": [
        "model",
        "messages",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "reasoning_effort",
    ],
    "anthropic_messages": [
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "thinking",
        "metadata",
    ],
    "openai_responses": [
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "reasoning",
        "previous_response_id",
        "store",
        "parallel_tool_calls",
    ],
    "gemini": ["contents", "systemInstruction", "tools", "toolConfig", "generationConfig"],
}
_NESTED = {
    "openai_chat": [
        ("messages", 0, "content"),
        ("messages", 0, "role"),
        ("tools", 0, "function"),
        ("tools", 0, "type"),
        ("tools", 0, "function", "parameters"),
        ("tools", 0, "function", "name"),
    ],
    "anthropic_messages": [
        ("messages", 0, "content"),
        ("messages", 0, "role"),
        ("tools", 0, "input_schema"),
        ("tools", 0, "name"),
        ("tools", 0, "type"),
    ],
    "openai_responses": [("tools", 0, "type"), ("tools", 0, "parameters"), ("tools", 0, "name")],
    "gemini": [
        ("contents", 0, "parts"),
        ("contents", 0, "role"),
        ("contents", 0, "parts", 0, "text"),
        ("generationConfig", "maxOutputTokens"),
        ("generationConfig", "topK"),
        ("generationConfig", "temperature"),
        ("tools", 0, "functionDeclarations", 0, "parameters"),
        ("tools", 0, "functionDeclarations", 0, "name"),
    ],
}


def _set(body: Any, path: tuple, value: Any) -> None:
    node = body
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return
    try:
        node[path[-1]] = value
    except (IndexError, TypeError):
        pass


@st.composite
def hostile_body(draw: st.DrawFn, api: str) -> bytes:
    """A request body for ``api``: a valid one with fields broken, deep or huge values, or raw bad bytes."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "deep", "many_tools", "raw"]))
    body = valid_body(api)
    if kind == "raw":
        return draw(
            st.sampled_from(
                [
                    b"",
                    b"[]",
                    b"\xff\xfe",
                    b'{"model": "\\udc00"}',
                    b"{" * 2000,
                    b"nul\x00",
                    b'{"model": "tiny", "max_tokens": 18446744073709551616, "messages": []}',
                ]
            )
            | st.binary(max_size=64)
        )
    if kind == "deep":
        where = draw(st.sampled_from(_NESTED[api]))
        _set(body, where, deep(draw(st.integers(100, 1000))))
        return orjson.dumps(body) if _depth_ok(body) else json.dumps(body).encode()
    if kind == "many_tools":
        tools = body["tools"] * draw(st.integers(1000, 1500))
        if draw(st.integers(0, 3)):  # mostly refused after walking them all (a valid one costs a long prompt)
            tools.insert(draw(st.integers(0, len(tools))), draw(JSON_VALUES))
        body["tools"] = tools
        return orjson.dumps(body)
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            body[draw(st.sampled_from(_FIELDS[api]))] = draw(JSON_VALUES)
        else:
            _set(body, draw(st.sampled_from(_NESTED[api])), draw(JSON_VALUES))
    return orjson.dumps(body)


def _depth_ok(value: Any) -> bool:
    try:
        orjson.dumps(value)
        return True
    except orjson.JSONEncodeError:
        return False


IDENTITY_TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    [
        "",
        "a" * 300,
        "s\x00",
        "s%00",
        "s;sample=9223372036854775808",
        "session=s;sample=-1",
        "session=s;sample=1e3",
        "session=;task=t",
        "x" * 200_000,
    ]
)


@st.composite
def hostile_identity(draw: st.DrawFn) -> dict[str, Any]:
    """Identity headers: x-polar-* values and polar: API keys of any text."""
    headers: dict[str, Any] = {}
    for name in draw(
        st.sets(st.sampled_from(["x-polar-session", "x-polar-task", "x-polar-group", "x-polar-sample"]), max_size=4)
    ):
        headers[name] = draw(IDENTITY_TEXT)
    if draw(st.booleans()):
        headers["x-api-key"] = "polar:" + draw(IDENTITY_TEXT)
    return headers


def hang_up_mid_stream(proxy_url: str, out: Path, session: str = "cut", times: int = 3) -> list:
    """``times`` streaming calls whose client hangs up at the first keep-alive; returns the session's records
    once all of them are stored (an abandoned call is still generated and persisted, later than the hang-up)."""
    import asyncio

    import httpx

    from tests.support.shards import session_records

    async def cut() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream(
                "POST",
                proxy_url + "/v1/chat/completions",
                json={**valid_body("openai_chat"), "stream": True},
                headers={"x-polar-session": session},
            ) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    break  # the first keep-alive arrived: hang up

    for _ in range(times):
        asyncio.run(cut())
    return session_records(out, session, at_least=times)
