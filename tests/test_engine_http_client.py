"""The HTTP client half of the OpenAI-compatible engines (HTTPEngine, VLLMEngine) against an in-process aiohttp server:
what a harness sees when the engine fails (status, kind and exact message, never the engine's address), what the
proxy log keeps (the address, the engine's answer), /v1/models read once, the token-input request, and a refused
prompt re-counted. No vLLM or SGLang: every test is a few hundred milliseconds."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from polar_addon.canonical import (
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    EngineFault,
    PolarError,
    SamplingParams,
)
from polar_addon.continuity.delta import NoDelta
from polar_addon.engines import EngineSettings
from polar_addon.engines.openai_compat import KEEPALIVE_S, HTTPEngine
from polar_addon.engines.vllm import VLLMEngine
from polar_addon.token_ids import IdText
from polar_addon.tool_parsers import ParserChoice

MODELS = (200, {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 64}]})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List a directory.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "depth": {"type": "integer"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is in /tmp?"}]
HERMES_CALL = '<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'


@dataclass
class Seen:
    method: str
    path: str
    content_type: str | None
    body: bytes


Answer = tuple[int, Any] | Callable[[bytes], tuple[int, Any]]


@asynccontextmanager
async def serving(routes: dict[str, Answer]) -> AsyncIterator[tuple[str, list[Seen]]]:
    """An engine server answering ``"METHOD /path"`` routes (bytes as they are, anything else as compact JSON, which
    is what vLLM's and SGLang's encoders write); any other path is a 404. Yields its URL and the requests it got."""
    seen: list[Seen] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(Seen(request.method, request.path, request.headers.get("content-type"), body))
        answer = routes.get(f"{request.method} {request.path}", (404, {"error": {"message": "no such route"}}))
        status, payload = answer(body) if callable(answer) else answer
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        return web.Response(status=status, body=data, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


def request(max_tokens: int | None = 8, model: str = "client-name") -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat", model=model, messages=MESSAGES, tools=TOOLS, sampling=SamplingParams(max_tokens=max_tokens)
    )


def chat_answer(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    """vLLM's chat answer with return_token_ids, without a model name (the served one is the default)."""
    return {
        "object": "chat.completion",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "tool_calls": [], **message},
                "finish_reason": finish,
                "token_ids": [7, 8],
                "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.25}]},
            }
        ],
    }


def completion_answer(text: str, finish: str = "stop", prompt: list[int] | None = None) -> dict[str, Any]:
    return {
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": text,
                "prompt_token_ids": prompt or [1, 2, 3],
                "token_ids": [7, 8],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                "finish_reason": finish,
            }
        ],
    }


def assert_no_address(err: PolarError, url: str) -> None:
    port = url.rsplit(":", 1)[1]
    assert "127.0.0.1" not in err.message and port not in err.message


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def failure(engine: HTTPEngine, call: Callable[[], Any]) -> PolarError:
    try:
        await call()
    except PolarError as err:
        return err
    finally:
        await engine.close()
    raise AssertionError("no PolarError")


def error_for(status: int, payload: Any) -> tuple[PolarError, str]:
    async def main() -> tuple[PolarError, str]:
        async with serving({"POST /v1/chat/completions": (status, payload)}) as (url, _):
            engine = HTTPEngine(url)
            return await failure(engine, lambda: engine.request_bytes("POST", "/v1/chat/completions", {"x": 1})), url

    return asyncio.run(main())


# --- HTTP errors: the status and kind a harness retries on, the engine's own words ----------------------------


@pytest.mark.parametrize(
    "status,payload,message",
    [
        (
            429,
            {"object": "error", "message": "The request queue is full.", "type": "TooManyRequests", "code": 429},
            "engine busy: The request queue is full.",
        ),
        (503, b"", "engine busy: engine answered HTTP 503"),
    ],
)
def test_a_busy_engine_is_a_retryable_503_that_does_not_count_as_a_fault(status, payload, message):
    err, url = error_for(status, payload)
    # Not an EngineFault: a full queue or a weight update must not take the engine out of the pool.
    assert type(err) is PolarError
    assert (err.status, err.kind, err.message) == (503, "overloaded", message)
    assert_no_address(err, url)


@pytest.mark.parametrize(
    "status,payload,message",
    [
        (
            500,
            {"object": "error", "message": "Internal server error: boom", "type": "InternalServerError", "code": 500},
            "engine error 500: Internal server error: boom",
        ),
        # A proxy's HTML page, stripped, with a byte that is not UTF-8 shown as U+FFFD rather than failing the call.
        (502, b"  <html>bad \xff gateway</html>\n", "engine error 502: <html>bad \ufffd gateway</html>"),
    ],
)
def test_an_engine_5xx_is_a_502_engine_fault(status, payload, message):
    err, url = error_for(status, payload)
    assert isinstance(err, EngineFault) and err.refused is False
    assert (err.status, err.kind, err.message) == (502, "api_error", message)
    assert_no_address(err, url)


@pytest.mark.parametrize(
    "payload,message",
    [
        ({"error": {"message": "Unknown tool 'x'", "type": "BadRequestError", "code": 400}}, "Unknown tool 'x'"),
        ({"error": "temperature must be >= 0"}, "temperature must be >= 0"),
        ({"object": "error", "message": "bad sampling", "type": "BadRequestError"}, "bad sampling"),
        ({"error": {"message": ""}, "message": "outer words"}, "outer words"),
        ({"detail": "Not Found"}, "Not Found"),
        (
            {"detail": [{"loc": ["body", "messages"], "msg": "field required"}]},
            '[{"loc":["body","messages"],"msg":"field required"}]',
        ),
        # No message anywhere: the whole answer, compact.
        ({"error": {"code": 400}}, '{"error":{"code":400}}'),
        ({"unexpected": 1}, '{"unexpected":1}'),
        (["not", "an", "object"], '["not","an","object"]'),
        # Bounded, JSON or not: an engine echoing a whole prompt must not make a megabyte error.
        (b"x" * 3000, "x" * 2000),
        ({"unexpected": "y" * 3000}, ('{"unexpected":"' + "y" * 3000)[:2000]),
    ],
)
def test_a_client_error_keeps_the_engines_message(payload, message):
    err, url = error_for(400, payload)
    assert type(err) is PolarError
    assert (err.status, err.kind, err.message) == (400, "invalid_request", message)
    assert_no_address(err, url)


@pytest.mark.parametrize(
    "message,prompt_tokens,window",
    [
        (
            "This model's maximum context length is 2048 tokens. However, your prompt contains 3000 input tokens.",
            3000,
            2048,
        ),
        ("The input (9000 tokens) is longer than the model's context length (8192 tokens).", 9000, 8192),
        (  # vLLM's scale-out generate endpoint (per-token versions)
            "The decoder prompt (length 2101) is longer than the maximum model length of 2048. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens.",
            2101,
            2048,
        ),
        ("max_tokens=200000 cannot be greater than max_model_len=100000.", None, None),
    ],
)
def test_a_prompt_past_the_window_is_context_length_exceeded_with_the_engines_counts(message, prompt_tokens, window):
    err, url = error_for(400, {"error": {"message": message, "type": "BadRequestError", "code": 400}})
    assert isinstance(err, ContextLengthExceeded)
    assert (err.status, err.kind, err.message) == (400, "context_length_exceeded", message)
    assert (err.prompt_tokens, err.window) == (prompt_tokens, window)


# --- a refused prompt re-counted ---------------------------------------------------------------------------------


def refused_chat(message: str, tokenize: Answer, engine_type: type[HTTPEngine] = VLLMEngine) -> tuple[Any, ...]:
    async def main() -> tuple[Any, ...]:
        routes = {
            "GET /v1/models": MODELS,
            "POST /v1/chat/completions": (400, {"error": {"message": message, "code": 400}}),
            "POST /tokenize": tokenize,
        }
        async with serving(routes) as (url, seen):
            engine = engine_type(url)
            err = await failure(engine, lambda: engine.complete(request()))
            return err, url, [s for s in seen if s.path == "/tokenize"]

    return asyncio.run(main())


AT_LEAST = "This model's maximum context length is 64 tokens. However, your request has at least 65 input tokens."


@pytest.mark.parametrize(
    "message",
    [AT_LEAST, "This model's maximum context length is 64 tokens."],
    ids=["vllm_stops_counting_at_the_window", "no_count"],
)
def test_a_refused_prompt_without_its_real_length_is_counted_through_tokenize(message):
    err, _, tokenized = refused_chat(message, (200, {"count": 5000, "max_model_len": 64, "tokens": []}))
    assert isinstance(err, ContextLengthExceeded) and err.message == message
    assert (err.prompt_tokens, err.window) == (5000, 64)
    assert len(tokenized) == 1
    sent = json.loads(tokenized[0].body)
    assert (sent["model"], sent["messages"], sent["add_generation_prompt"]) == ("tiny", MESSAGES, True)


def test_a_refused_prompt_the_engine_counted_is_not_counted_again():
    message = "The input (9000 tokens) is longer than the model's context length (64 tokens)."
    err, _, tokenized = refused_chat(message, (200, {"count": 5000}))
    assert (err.prompt_tokens, err.window) == (9000, 64)
    assert tokenized == []


def test_a_failed_count_keeps_the_engines_words_and_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="polar")
    err, url, tokenized = refused_chat(AT_LEAST, (500, {"object": "error", "message": "boom"}))
    assert len(tokenized) == 1
    assert isinstance(err, ContextLengthExceeded)
    assert (err.prompt_tokens, err.window) == (65, 64)
    assert f"polar: could not count a refused prompt on {url}: engine error 500: boom" in caplog.messages
    # An engine that cannot count at all (not vLLM, not SGLang): the call is still refused as it was.
    caplog.clear()
    err, url, tokenized = refused_chat("This model's maximum context length is 64 tokens.", (200, {}), HTTPEngine)
    assert (err.prompt_tokens, err.window, tokenized) == (None, 64, [])
    assert f"polar: could not count a refused prompt on {url}: http engines cannot count tokens" in caplog.messages


# --- /v1/models: the served name and window, read once -----------------------------------------------------------


def test_served_model_and_window_are_read_once_with_a_bodiless_get():
    async def main() -> tuple[Any, ...]:
        async with serving({"GET /v1/models": MODELS}) as (url, seen):
            engine = HTTPEngine(url + "/")  # a spec's trailing slash
            try:
                got = [await engine.served_model(), await engine.window(), await engine.served_model()]
                got.append(await engine.window())
            finally:
                await engine.close()
            return got, seen, engine.name, url

    got, seen, name, url = asyncio.run(main())
    assert got == ["tiny", 64, "tiny", 64]
    # One read each (served_model, window), each a plain GET: no JSON body, no content-type.
    assert [(s.method, s.path, s.content_type, s.body) for s in seen] == [("GET", "/v1/models", None, b"")] * 2
    assert name == f"http:{url}"


def test_an_engine_behind_a_path_prefix_keeps_it_and_only_the_trailing_slash_goes():
    async def main() -> tuple[str, list[str], str, str]:
        async with serving({"GET /engines/gpu-X/v1/models": MODELS}) as (url, seen):
            engine = HTTPEngine(url + "/engines/gpu-X/")  # a reverse proxy's route to one engine
            try:
                return await engine.served_model(), [s.path for s in seen], engine.name, url
            finally:
                await engine.close()

    model, paths, name, url = asyncio.run(main())
    assert (model, paths) == ("tiny", ["/engines/gpu-X/v1/models"])
    assert name == f"http:{url}/engines/gpu-X"


@pytest.mark.parametrize(
    "listing,model_error,window_error",
    [
        ({"object": "list", "data": []}, True, True),
        ({"data": [{"id": "tiny"}]}, False, True),
        ({"data": [{"id": "tiny", "max_model_len": "unbounded"}]}, False, True),
        ({"models": "tiny"}, True, True),
    ],
)
def test_a_models_listing_without_a_model_or_window_is_a_502(listing, model_error, window_error):
    async def main() -> tuple[Any, Any]:
        async with serving({"GET /v1/models": (200, listing)}) as (url, _):
            engine = HTTPEngine(url)
            outcomes = []
            for call in (engine.served_model, engine.window):
                try:
                    outcomes.append(await call())
                except PolarError as err:
                    outcomes.append((type(err), err.status, err.kind, err.message))
            await engine.close()
            return outcomes

    served, window = asyncio.run(main())
    no_model = (PolarError, 502, "api_error", "the engine's /v1/models lists no model")
    no_window = (PolarError, 502, "api_error", "the engine's /v1/models gives no max_model_len")
    assert served == (no_model if model_error else "tiny")
    assert window == (no_window if window_error else 64)


# --- token input: /v1/completions --------------------------------------------------------------------------------


def token_call(
    text: str,
    prompt_ids: list[int],
    max_tokens: int | None,
    finish: str = "stop",
    parsers: ParserChoice | None = None,
) -> tuple[Completion, dict[str, Any], list[Seen], str]:
    async def main() -> tuple[Completion, dict[str, Any], list[Seen], str]:
        routes = {"GET /v1/models": MODELS, "POST /v1/completions": (200, completion_answer(text, finish, prompt_ids))}
        async with serving(routes) as (url, seen):
            engine = VLLMEngine(url)
            engine.weight_version = "step-7"
            if parsers is not None:
                engine.configure(EngineSettings(tool_parsers=parsers))
            try:
                completion = await engine.complete_tokens(request(max_tokens), prompt_ids)
            finally:
                await engine.close()
            sent = next(json.loads(s.body) for s in seen if s.path == "/v1/completions")
            return completion, sent, seen, url

    return asyncio.run(main())


@pytest.mark.parametrize("prompt_len,max_tokens", [(60, 4), (63, 1), (64, 1), (70, 1)])
def test_token_input_without_max_tokens_asks_for_the_rest_of_the_window(prompt_len, max_tokens):
    prompt = list(range(1, prompt_len + 1))
    _, sent, seen, _ = token_call("hi", prompt, None)
    assert sent["max_tokens"] == max_tokens
    assert (sent["model"], sent["prompt"]) == ("tiny", prompt)
    assert (sent["logprobs"], sent["return_token_ids"], sent["stream"]) == (1, True, False)
    completions = [s for s in seen if s.path == "/v1/completions"]
    assert [(s.method, s.content_type) for s in completions] == [("POST", "application/json")]


def test_token_input_with_max_tokens_does_not_read_the_window():
    completion, sent, seen, url = token_call("hi", [1, 2, 3], 5)
    assert sent["max_tokens"] == 5
    assert [s.path for s in seen] == ["/v1/models", "/v1/completions"]  # the served name only
    assert (completion.message.content, completion.finish_reason, completion.tool_call_parser) == ("hi", "stop", None)
    # The answer names no model: the served one is recorded (not the client's alias), with the spec's version.
    assert (completion.served_model, completion.weight_version, completion.engine) == ("tiny", "step-7", f"vllm:{url}")
    assert (list(completion.prompt_ids), completion.response_ids, completion.logprobs) == (
        [1, 2, 3],
        [7, 8],
        [-0.5, -0.25],
    )
    assert completion.parse_failures == 0


@pytest.mark.parametrize(
    "text,finish,expected_finish,calls",
    [
        (HERMES_CALL, "stop", "tool_calls", 1),
        (HERMES_CALL, "length", "length", 1),
        ("no call here", "stop", "stop", 0),
    ],
)
def test_token_input_calls_are_parsed_by_polar_and_a_stop_with_a_call_is_tool_calls(
    text, finish, expected_finish, calls
):
    completion, _, _, _ = token_call(text, [1, 2, 3], 8, finish)
    assert completion.finish_reason == expected_finish
    assert len(completion.message.tool_calls) == calls
    assert completion.tool_call_parser == ("hermes" if calls else None)
    if calls:
        call = completion.message.tool_calls[0]
        assert (call.name, json.loads(call.arguments)) == ("ls", {"path": "/tmp"})


def test_token_input_uses_the_served_models_parser_typed_against_the_request_tools():
    text = "<tool_call>\n<function=ls>\n<parameter=path>\n/tmp\n</parameter>\n<parameter=depth>\n2\n</parameter>\n"
    text += "</function>\n</tool_call>"
    # The served name picks the parser (the client calls it "client-name"); the tool's schema types depth.
    completion, _, _, _ = token_call(text, [1, 2, 3], 8, parsers=ParserChoice("tiny=qwen3_coder"))
    assert completion.tool_call_parser == "qwen3_coder"
    assert [(c.name, json.loads(c.arguments)) for c in completion.message.tool_calls] == [
        ("ls", {"path": "/tmp", "depth": 2})
    ]
    assert completion.finish_reason == "tool_calls"


# --- the chat endpoint -------------------------------------------------------------------------------------------


def chat_call(answer: Answer, parsers: ParserChoice | None = None) -> tuple[Any, list[Seen], str]:
    async def main() -> tuple[Any, list[Seen], str]:
        async with serving({"GET /v1/models": MODELS, "POST /v1/chat/completions": answer}) as (url, seen):
            engine = VLLMEngine(url)
            engine.weight_version = "step-7"
            if parsers is not None:
                engine.configure(EngineSettings(tool_parsers=parsers))
            try:
                return await engine.complete(request()), seen, url
            except PolarError as err:
                return err, seen, url
            finally:
                await engine.close()

    return asyncio.run(main())


def test_a_chat_answer_keeps_its_prompt_ids_as_text_and_records_the_served_model():
    completion, seen, url = chat_call((200, chat_answer({"content": "hi"})))
    # The compact prompt array stays text (the fast path): nothing parses a 100k-token prompt per call.
    assert isinstance(completion.prompt_ids, IdText) and list(completion.prompt_ids) == [1, 2, 3]
    assert (completion.response_ids, completion.logprobs) == ([7, 8], [-0.5, -0.25])
    assert (completion.served_model, completion.weight_version, completion.engine) == ("tiny", "step-7", f"vllm:{url}")
    assert (completion.message.content, completion.finish_reason, completion.tool_call_parser) == ("hi", "stop", None)
    sent = json.loads(seen[-1].body)
    assert (sent["model"], sent["return_token_ids"], sent["logprobs"], sent["stream"]) == ("tiny", True, True, False)
    assert seen[-1].content_type == "application/json"


def test_the_served_models_fallback_parser_reads_calls_the_engine_left_in_the_content():
    content = 'Listing.\n```json\n{"name": "ls", "arguments": {"path": "/tmp"}}\n```'
    completion, _, _ = chat_call(
        (200, chat_answer({"content": content})), parsers=ParserChoice("tiny=hermes+fenced_json,hermes")
    )
    assert completion.tool_call_parser == "fenced_json"
    assert [(c.name, json.loads(c.arguments)) for c in completion.message.tool_calls] == [("ls", {"path": "/tmp"})]
    assert completion.finish_reason == "tool_calls"


def test_a_non_json_answer_is_a_502_and_the_log_keeps_where_and_what(caplog):
    caplog.set_level(logging.WARNING, logger="polar")
    page = b"<html>" + b"z" * 300 + b"</html>"
    err, _, url = chat_call((200, page))
    assert type(err) is PolarError
    assert (err.status, err.kind, err.message) == (502, "api_error", "the engine answered non-JSON")
    assert caplog.messages == [f"polar: engine {url} answered non-JSON: {page[:200]!r}"]


# --- the connection: refused, dropped, timed out -----------------------------------------------------------------


def test_nothing_listening_is_a_refused_engine_fault(caplog):
    caplog.set_level(logging.WARNING, logger="polar")
    url = f"http://127.0.0.1:{free_port()}"

    async def main() -> PolarError:
        engine = HTTPEngine(url)
        return await failure(engine, lambda: engine.served_model())

    err = asyncio.run(main())
    assert isinstance(err, EngineFault) and err.refused is True
    assert (err.status, err.kind, err.message) == (
        503,
        "overloaded",
        "the engine is unreachable (ClientConnectorError)",
    )
    assert_no_address(err, url)
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith(f"polar: engine {url} unreachable: ClientConnectorError(")
    assert "ConnectionRefusedError" in caplog.messages[0]


async def raw_server(answer_from: int) -> tuple[asyncio.AbstractServer, list[bytes]]:
    """A server that resets every connection before the ``answer_from``-th request and answers from then on;
    it keeps each request's head and body."""
    got: list[bytes] = []
    ok = b'{"ok":true}'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            got.append(head + body)
            if len(got) < answer_from:
                writer.transport.abort()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n" + ok)
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), got


def test_a_dropped_connection_is_retried_once_with_the_same_body(caplog):
    caplog.set_level(logging.INFO, logger="polar")

    async def main() -> tuple[Any, list[bytes], str]:
        server, got = await raw_server(answer_from=2)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        engine = HTTPEngine(url)
        try:
            return await engine.request_json("POST", "/v1/chat/completions", {"x": 1}), got, url
        finally:
            await engine.close()
            server.close()

    answer, got, url = asyncio.run(main())
    assert answer == {"ok": True}
    assert len(got) == 2
    for attempt in got:  # the retry sends what the first attempt sent
        assert attempt.startswith(b"POST /v1/chat/completions ")
        assert re.search(rb"(?i)\r\ncontent-type: application/json\r\n", attempt)
        assert attempt.endswith(b'\r\n\r\n{"x":1}')
    assert caplog.messages == [
        f"polar: engine {url} dropped a pooled connection (ServerDisconnectedError('Server disconnected')); "
        "retrying once"
    ]


def test_an_engine_that_drops_every_connection_is_an_unrefused_fault():
    async def main() -> tuple[PolarError, str]:
        server, _ = await raw_server(answer_from=99)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        engine = HTTPEngine(url)
        try:
            return await failure(engine, lambda: engine.request_bytes("POST", "/v1/completions", {"x": 1})), url
        finally:
            server.close()

    err, url = asyncio.run(main())
    assert isinstance(err, EngineFault) and err.refused is False
    assert (err.status, err.kind, err.message) == (
        503,
        "overloaded",
        "the engine is unreachable (ServerDisconnectedError)",
    )
    assert_no_address(err, url)


@asynccontextmanager
async def slow_server() -> AsyncIterator[str]:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        release.set()  # lets the handler end, so the cleanup does not wait on it
        await runner.cleanup()


def test_an_engine_slower_than_timeout_s_is_a_504():
    async def main() -> tuple[PolarError, str]:
        async with slow_server() as url:
            engine = HTTPEngine(url, timeout_s=0.2)
            return await failure(engine, lambda: engine.request_bytes("GET", "/slow")), url

    err, url = asyncio.run(main())
    assert type(err) is PolarError
    assert (err.status, err.kind, err.message) == (504, "timeout", "the engine did not answer within 0.2 s")


def test_a_socket_read_timeout_is_a_504_not_a_connect_timeout():
    # aiohttp's SocketTimeoutError is a ServerTimeoutError too: only a connect timeout means unreachable.
    async def main() -> PolarError:
        async with slow_server() as url:
            engine = HTTPEngine(url, timeout_s=1.5)
            engine._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.5, sock_read=0.1))
            return await failure(engine, lambda: engine.request_bytes("GET", "/slow"))

    err = asyncio.run(main())
    assert type(err) is PolarError
    assert (err.status, err.kind, err.message) == (504, "timeout", "the engine did not answer within 1.5 s")


def test_a_connect_timeout_is_an_unreachable_engine(caplog):
    caplog.set_level(logging.WARNING, logger="polar")
    # A listener whose accept queue is full: Linux drops the next SYN, so the connect hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    url = f"http://127.0.0.1:{port}"

    async def main() -> PolarError:
        engine = HTTPEngine(url, timeout_s=2.0)
        # The connect limit below the total, as every engine's is past 10 s (waiting 10 s here would be too slow).
        engine._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0, connect=0.2))
        return await failure(engine, lambda: engine.request_bytes("GET", "/v1/models"))

    try:
        err = asyncio.run(main())
    finally:
        for sock in [*fillers, listener]:
            sock.close()
    assert isinstance(err, EngineFault) and err.refused is False
    assert (err.status, err.kind, err.message) == (503, "overloaded", "the engine is unreachable: connect timeout")
    assert caplog.messages == [f"polar: engine {url} unreachable: connect timeout"]


# --- the pooled client ---------------------------------------------------------------------------------------------


def test_the_pooled_client_its_limits_and_its_timeouts():
    async def main() -> None:
        engine = HTTPEngine("http://127.0.0.1:9")
        assert engine.timeout_s == 900.0
        session = engine._client()
        assert engine._client() is session  # one pool per engine
        # Connect bounded by 10 s (an engine that is gone is not waited on for the whole call), the call by 900 s.
        assert session.timeout == aiohttp.ClientTimeout(total=900.0, connect=10.0)
        connector = session.connector
        assert isinstance(connector, aiohttp.TCPConnector)
        # 256 concurrent calls to one engine (aiohttp's defaults: 100 in all, 0 per host).
        assert (connector.limit, connector.limit_per_host) == (256, 256)
        # Idle connections dropped before uvicorn's 5 s keep-alive closes them under a request.
        assert connector._keepalive_timeout == KEEPALIVE_S
        await engine.close()
        assert session.closed
        reopened = engine._client()  # a closed pool is replaced, not reused
        assert reopened is not session and not reopened.closed
        await engine.close()

        short = HTTPEngine("http://127.0.0.1:9", timeout_s=2.5)
        assert short._client().timeout == aiohttp.ClientTimeout(total=2.5, connect=2.5)
        await short.close()
        await HTTPEngine("http://127.0.0.1:9").close()  # never used: nothing to close, no error

    asyncio.run(main())


def test_without_a_tokenizer_dir_there_is_no_tokenizer_and_no_delta():
    engine = HTTPEngine("http://127.0.0.1:9")
    assert engine.tokenizer() is None
    delta = engine.continuation(previous=None)
    assert isinstance(delta, NoDelta)
    assert delta.reason == "no tokenizer for the served model (set polar_tokenizer)"
    parsers = ParserChoice("qwen3_coder")
    engine.configure(EngineSettings(tool_parsers=parsers, tokenizer_dir="/models/tiny"))
    assert (engine.tool_parsers, engine.tokenizer_dir) == (parsers, "/models/tiny")
