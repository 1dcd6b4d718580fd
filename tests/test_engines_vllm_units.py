"""vLLM's client (engines.vllm) against an in-process fake of its endpoints: with per-token weight versions a chat
call is rendered (``/v1/chat/completions/render``), sampled (``/inference/v1/generate``) and parsed back by the
server (``/v1/chat/completions/derender``), and the Completion keeps generate's prompt ids, sampled ids, logprobs and
version spans; token input goes to generate with the rest of the window; ``/tokenize`` counts a chat prompt. Each
refusal is checked in its exact words: these decide which tokens, logprobs and versions training records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web

from polar_addon.canonical import (
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    PolarError,
    SamplingParams,
    VersionSpan,
)
from polar_addon.engines.openai_compat import chat_body, sampling_body
from polar_addon.engines.vllm import GENERATE, VLLMEngine

MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 64}]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List a directory.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is in /tmp?"}]
HERMES_CALL = '<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'
RENDER = "/v1/chat/completions/render"
DERENDER = "/v1/chat/completions/derender"

Answer = tuple[int, Any] | Callable[[Any], tuple[int, Any]]


@asynccontextmanager
async def serving(routes: dict[str, Answer]) -> AsyncIterator[tuple[str, list[tuple[str, str, Any]]]]:
    """A vLLM server answering ``"METHOD /path"`` routes with JSON; any other path is a 404. Yields its URL and the
    (method, path, JSON body) of each request."""
    seen: list[tuple[str, str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        raw = await request.read()
        body = orjson.loads(raw) if raw else None
        seen.append((request.method, request.path, body))
        answer = routes.get(f"{request.method} {request.path}", (404, {"error": {"message": "no such route"}}))
        status, payload = answer(body) if callable(answer) else answer
        return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")

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


def request(max_tokens: int | None = 8, thinking: bool | None = None, tools: bool = True) -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat",
        model="client-name",
        messages=MESSAGES,
        tools=TOOLS if tools else [],
        tool_choice="auto" if tools else None,
        enable_thinking=thinking,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=4),
    )


def span(version: str, start: int, end: int) -> dict[str, Any]:
    return {"version": version, "start": start, "end": end}


def rendered(token_ids: list[int] | None = None) -> dict[str, Any]:
    """What render answers: the generate request of the chat call (its exact token prompt)."""
    return {
        "request_id": "chatcmpl-1",
        "token_ids": token_ids or [1, 2, 3],
        "sampling_params": {"max_tokens": 8, "temperature": 0.7, "logprobs": 0},
        "model": "tiny",
        "stream": False,
    }


def generated(
    ids: list[int] | None = None,
    lps: list[float] | None = None,
    spans: Any = "two",
    text: str | None = None,
    finish: str = "stop",
) -> dict[str, Any]:
    ids = [7, 8] if ids is None else ids
    lps = [-0.5, -0.25] if lps is None else lps
    choice: dict[str, Any] = {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": [{"token_id": i, "logprob": lp} for i, lp in zip(ids, lps, strict=True)]},
        "finish_reason": finish,
        "stop_reason": None,
        "weight_versions": [span("v1", 0, 1), span("v2", 1, 2)] if spans == "two" else spans,
    }
    if text is not None:
        choice["text"] = text
    return {"request_id": "gen-1", "model": "tiny", "prompt_token_ids": [1, 2, 3], "choices": [choice]}


def derendered(content: Any = "hi", ids: list[int] | None = None, lps: list[float] | None = None) -> dict[str, Any]:
    """What derender answers: the chat answer the server's parsers make of generate's output (no prompt ids)."""
    ids = [7, 8] if ids is None else ids
    lps = [-0.5, -0.25] if lps is None else lps
    return {
        "object": "chat.completion",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": []},
                "finish_reason": "stop",
                "token_ids": ids,
                "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in lps]},
            }
        ],
    }


def versioned_chat(
    routes: dict[str, Answer], req: CanonicalRequest | None = None, weight_version: str | None = None
) -> tuple[Completion | PolarError, list[tuple[str, str, Any]], str]:
    async def main() -> tuple[Completion | PolarError, list[tuple[str, str, Any]], str]:
        async with serving({"GET /v1/models": (200, MODELS), **routes}) as (url, seen):
            engine = VLLMEngine(url, timeout_s=10.0, token_versions=True)
            engine.weight_version = weight_version
            try:
                return await engine.complete(req or request()), seen, url
            except PolarError as err:
                return err, seen, url
            finally:
                await engine.close()

    return asyncio.run(main())


def chat_routes(render: Any = None, generate: Any = None, derender: Any = None) -> dict[str, Answer]:
    return {
        f"POST {RENDER}": (200, rendered() if render is None else render),
        f"POST {GENERATE}": (200, generated() if generate is None else generate),
        f"POST {DERENDER}": (200, derendered() if derender is None else derender),
    }


def test_a_new_client_samples_on_the_openai_endpoints_with_token_ids_asked_for() -> None:
    engine = VLLMEngine("http://h:8000/")
    assert (engine.kind, engine.name, engine.url) == ("vllm", "vllm:http://h:8000", "http://h:8000")
    assert (engine.timeout_s, engine.token_versions) == (900.0, False)
    assert engine.extra_body() == {"return_token_ids": True}
    timed = VLLMEngine("http://h:8000", timeout_s=12.5, token_versions=True)
    assert (timed.timeout_s, timed.token_versions) == (12.5, True)


# --- a chat call with per-token versions: render -> generate -> derender -----------------------------------------


def test_a_versioned_chat_call_keeps_generates_tokens_logprobs_and_spans() -> None:
    completion, seen, url = versioned_chat(chat_routes())
    assert isinstance(completion, Completion)
    assert [(m, p) for m, p, _ in seen] == [
        ("GET", "/v1/models"),
        ("POST", RENDER),
        ("POST", GENERATE),
        ("POST", DERENDER),
    ]
    req = request()
    render_body = seen[1][2]
    assert render_body == {**chat_body(req, "tiny"), "return_token_ids": True}
    assert (render_body["model"], render_body["messages"], render_body["tools"]) == ("tiny", MESSAGES, TOOLS)
    assert (render_body["logprobs"], render_body["return_token_ids"], render_body["max_tokens"]) == (True, True, 8)
    # generate samples exactly what render made of the call, with its token ids returned.
    assert seen[2][2] == {**rendered(), "return_token_ids": True}
    # derender parses generate's answer for the original chat request.
    assert seen[3][2] == {"generate_response": generated(), "chat_request": render_body}
    assert list(completion.prompt_ids) == [1, 2, 3]
    assert (completion.response_ids, completion.logprobs) == ([7, 8], [-0.5, -0.25])
    assert (completion.message.content, completion.finish_reason, completion.tool_call_parser) == ("hi", "stop", None)
    assert (completion.served_model, completion.engine) == ("tiny", f"vllm:{url}")
    # The call's version is its oldest span's (the staleness bound), the spans all of them.
    assert completion.weight_version == "v1"
    assert completion.weight_versions == [VersionSpan("v1", 0, 1), VersionSpan("v2", 1, 2)]


def test_a_generate_that_overrides_render_still_gets_token_ids() -> None:
    completion, seen, _ = versioned_chat(chat_routes(render={**rendered(), "return_token_ids": False}))
    assert isinstance(completion, Completion)
    assert seen[2][2]["return_token_ids"] is True


def test_vllms_default_version_reads_as_the_configured_one() -> None:
    completion, _, _ = versioned_chat(chat_routes(generate=generated(spans=[span("default", 0, 2)])), None, "step-3")
    assert isinstance(completion, Completion)
    assert completion.weight_versions == [VersionSpan("step-3", 0, 2)]
    assert completion.weight_version == "step-3"


def test_an_empty_answer_has_no_spans_and_keeps_the_configured_version() -> None:
    routes = chat_routes(
        generate=generated(ids=[], lps=[], spans=None, finish="length"), derender=derendered("", ids=[], lps=[])
    )
    completion, _, _ = versioned_chat(routes, None, "step-3")
    assert isinstance(completion, Completion)
    assert (completion.response_ids, completion.weight_versions, completion.weight_version) == ([], [], "step-3")


def test_a_generate_without_spans_is_refused() -> None:
    err, _, _ = versioned_chat(chat_routes(generate=generated(spans=None)))
    assert isinstance(err, PolarError) and (err.status, err.kind) == (502, "api_error")
    assert err.message == "malformed engine answer: no weight_versions (is the server started with --enable-scale-out?)"


@pytest.mark.parametrize(
    "answer",
    [[1, 2, 3], {"sampling_params": {}}, {**rendered(), "token_ids": "1 2 3"}, {**rendered(), "token_ids": None}],
    ids=["a_list", "no_token_ids", "text_ids", "null_ids"],
)
def test_a_render_without_token_ids_is_refused_before_anything_is_sampled(answer: Any) -> None:
    err, seen, url = versioned_chat(chat_routes(render=answer))
    assert isinstance(err, PolarError) and (err.status, err.kind) == (502, "api_error")
    assert err.message == "malformed engine answer: the render endpoint gave no token_ids"
    assert [p for _, p, _ in seen] == ["/v1/models", RENDER]


@pytest.mark.parametrize(
    "answer",
    [derendered(ids=[7, 9]), derendered(lps=[-0.5, -0.3]), derendered(ids=[7]  , lps=[-0.5])],
    ids=["other_ids", "other_logprobs", "fewer_tokens"],
)  # fmt: skip
def test_a_derender_that_changed_the_sampled_tokens_is_refused(answer: dict[str, Any]) -> None:
    err, _, _ = versioned_chat(chat_routes(derender=answer))
    assert isinstance(err, PolarError) and (err.status, err.kind) == (502, "api_error")
    assert err.message == "malformed engine answer: derender changed the sampled tokens"


def test_the_server_parsers_message_is_kept_with_generates_prompt() -> None:
    answer = derendered(None)
    answer["choices"][0]["message"]["tool_calls"] = [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}
    ]
    answer["choices"][0]["finish_reason"] = "tool_calls"
    answer["prompt_token_ids"] = [9, 9]  # derender's own prompt ids, if any, are not what generate sampled after
    completion, _, _ = versioned_chat(chat_routes(derender=answer))
    assert isinstance(completion, Completion)
    assert list(completion.prompt_ids) == [1, 2, 3]
    assert [(c.id, c.name, c.arguments) for c in completion.message.tool_calls] == [
        ("call_1", "ls", '{"path": "/tmp"}')
    ]
    assert (completion.finish_reason, completion.tool_call_parser) == ("tool_calls", "engine")


AT_LEAST = "This model's maximum context length is 64 tokens. However, your request has at least 65 input tokens."
DECODER = "The decoder prompt (length 2101) is longer than the maximum model length of 2048."


def test_a_refused_generate_counts_the_rendered_prompt_when_the_engine_stopped_counting() -> None:
    refusal = (400, {"error": {"message": AT_LEAST, "type": "BadRequestError", "code": 400}})
    routes = {**chat_routes(render=rendered(list(range(1, 71)))), f"POST {GENERATE}": refusal}
    err, seen, _ = versioned_chat(routes)
    assert isinstance(err, ContextLengthExceeded) and err.message == AT_LEAST
    assert (err.prompt_tokens, err.window) == (70, 64)  # the rendered prompt is the whole prompt
    assert "/tokenize" not in [p for _, p, _ in seen]


def test_a_refused_generate_that_said_the_prompts_length_keeps_it() -> None:
    refusal = (400, {"error": {"message": DECODER, "type": "BadRequestError", "code": 400}})
    err, _, _ = versioned_chat({**chat_routes(), f"POST {GENERATE}": refusal})
    assert isinstance(err, ContextLengthExceeded)
    assert (err.prompt_tokens, err.window) == (2101, 2048)


# --- token input with per-token versions: generate on the ids ---------------------------------------------------


def versioned_tokens(
    prompt: list[int], req: CanonicalRequest, generate: Answer, versioned: bool = True
) -> tuple[Completion | PolarError, list[tuple[str, str, Any]]]:
    async def main() -> tuple[Completion | PolarError, list[tuple[str, str, Any]]]:
        routes: dict[str, Answer] = {"GET /v1/models": (200, MODELS), f"POST {GENERATE}": generate}
        async with serving(routes) as (url, seen):
            engine = VLLMEngine(url, timeout_s=10.0, token_versions=versioned)
            try:
                return await engine.complete_tokens(req, prompt), seen
            except PolarError as err:
                return err, seen
            finally:
                await engine.close()

    return asyncio.run(main())


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(60, 4), (63, 1), (64, 1), (70, 1)])
def test_token_input_without_max_tokens_asks_generate_for_the_rest_of_the_window(
    prompt_len: int, max_tokens: int
) -> None:
    prompt = list(range(1, prompt_len + 1))
    req = request(None)
    completion, seen = versioned_tokens(prompt, req, (200, generated(text="hi")))
    assert isinstance(completion, Completion)
    body = seen[-1][2]
    assert body == {
        "token_ids": prompt,
        "sampling_params": {**sampling_body(req), "max_tokens": max_tokens, "logprobs": 0},
        "model": "tiny",
        "return_token_ids": True,
        "output_mode": "text",
    }
    assert body["sampling_params"]["temperature"] == 0.7 and body["sampling_params"]["seed"] == 4


def test_token_input_with_max_tokens_reads_no_window_and_keeps_the_versions() -> None:
    completion, seen = versioned_tokens([1, 2, 3], request(5), (200, generated(text="hi")))
    assert isinstance(completion, Completion)
    assert [p for _, p, _ in seen] == ["/v1/models", GENERATE]  # the served name only
    assert seen[-1][2]["sampling_params"]["max_tokens"] == 5
    assert (completion.message.content, completion.finish_reason, completion.parse_failures) == ("hi", "stop", 0)
    assert (list(completion.prompt_ids), completion.response_ids, completion.logprobs) == (
        [1, 2, 3],
        [7, 8],
        [-0.5, -0.25],
    )
    assert completion.weight_version == "v1"
    assert completion.weight_versions == [VersionSpan("v1", 0, 1), VersionSpan("v2", 1, 2)]


def test_token_input_text_is_parsed_by_polar_and_no_text_is_an_empty_turn() -> None:
    completion, _ = versioned_tokens([1, 2, 3], request(5), (200, generated(text=HERMES_CALL)))
    assert isinstance(completion, Completion)
    assert [(c.name, json.loads(c.arguments)) for c in completion.message.tool_calls] == [("ls", {"path": "/tmp"})]
    assert (completion.finish_reason, completion.tool_call_parser) == ("tool_calls", "hermes")
    empty, _ = versioned_tokens([1, 2, 3], request(5), (200, generated()))  # no text field at all
    assert isinstance(empty, Completion)
    assert (empty.message.content, empty.message.tool_calls, empty.parse_failures) == ("", [], 0)


def test_a_refused_token_prompt_counts_the_given_ids() -> None:
    refusal = (400, {"error": {"message": AT_LEAST, "type": "BadRequestError", "code": 400}})
    err, _ = versioned_tokens(list(range(80)), request(5), refusal)
    assert isinstance(err, ContextLengthExceeded) and (err.prompt_tokens, err.window) == (80, 64)


def test_token_input_without_versions_goes_to_completions_with_one_logprob() -> None:
    answer = {
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [7, 8],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                "finish_reason": "stop",
            }
        ],
    }

    async def main() -> tuple[Completion, list[tuple[str, str, Any]]]:
        routes: dict[str, Answer] = {"GET /v1/models": (200, MODELS), "POST /v1/completions": (200, answer)}
        async with serving(routes) as (url, seen):
            engine = VLLMEngine(url)
            try:
                return await engine.complete_tokens(request(5), [1, 2, 3]), seen
            finally:
                await engine.close()

    completion, seen = asyncio.run(main())
    assert [p for _, p, _ in seen] == ["/v1/models", "/v1/completions"]
    assert (seen[-1][2]["prompt"], seen[-1][2]["logprobs"]) == ([1, 2, 3], 1)
    assert (completion.response_ids, completion.weight_versions) == ([7, 8], None)


# --- /tokenize ---------------------------------------------------------------------------------------------------


def count(req: CanonicalRequest, answer: Answer) -> tuple[int | PolarError, Any]:
    async def main() -> tuple[int | PolarError, Any]:
        async with serving({"GET /v1/models": (200, MODELS), "POST /tokenize": answer}) as (url, seen):
            engine = VLLMEngine(url)
            try:
                return await engine.count_tokens(req), seen
            except PolarError as err:
                return err, seen
            finally:
                await engine.close()

    return asyncio.run(main())


def test_tokenize_renders_the_chat_with_its_generation_prompt_tools_and_thinking_flag() -> None:
    n, seen = count(request(tools=False), (200, {"count": 17, "max_model_len": 64, "tokens": []}))
    assert n == 17
    assert seen[-1][:2] == ("POST", "/tokenize")
    assert seen[-1][2] == {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True}
    n, seen = count(request(thinking=False), (200, {"count": 0}))
    assert n == 0
    assert seen[-1][2] == {
        "model": "tiny",
        "messages": MESSAGES,
        "add_generation_prompt": True,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    }


@pytest.mark.parametrize("answer", [{"count": "17"}, {"tokens": [1]}, [17], {"count": None}])
def test_a_tokenize_answer_without_a_whole_count_is_refused(answer: Any) -> None:
    err, _ = count(request(), (200, answer))
    assert isinstance(err, PolarError) and (err.status, err.kind) == (502, "api_error")
    assert err.message == "the engine's /tokenize answered without a count"
