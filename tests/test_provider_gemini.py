"""Gemini translator: contents/tools/config normalization, renders checked by the google-genai SDK."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from google import genai
from google.genai import errors, types

from polar_addon.canonical import Completion, ContextLengthExceeded, PolarError, ToolCall
from polar_addon.providers import ResponseContext, Route, all_providers
from polar_addon.providers.gemini import PROVIDER, json_schema
from tests.support.providers import completion as qwen_completion
from tests.support.providers import sse_bytes as sse


def completion(*args: Any, **kwargs: Any) -> Completion:
    return qwen_completion(*args, served_model="gem-test", **kwargs)


CTX = ResponseContext(response_id="4f1c2d3e4f5a6b7c8d9e0f1a", created=1_700_000_000, model="gem-test")
ERROR_KINDS = [
    "invalid_request",
    "request_too_large",
    "authentication",
    "not_found",
    "context_length_exceeded",
    "overloaded",
    "timeout",
    "api_error",
    "storage_unavailable",
]
READ_FILE = {
    "name": "read_file",
    "description": "Read a file.",
    "parameters": {
        "type": "OBJECT",
        "properties": {"path": {"type": "STRING"}, "lines": {"type": "ARRAY", "items": {"type": "INTEGER"}}},
        "required": ["path"],
    },
}


def route(path: str = "/v1beta/models/gem-test:generateContent") -> Route:
    found = PROVIDER.route("POST", path)
    assert found is not None
    return found


def parse(path: str = "/v1beta/models/gem-test:generateContent", **body: Any):
    body.setdefault("contents", [{"role": "user", "parts": [{"text": "hi"}]}])
    return PROVIDER.parse_request(body, route(path))


class Recorder:
    """An httpx mock transport answering every call with one canned body, keeping the requests."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        self.status, self.body, self.content_type = status, body, content_type
        self.requests: list[httpx.Request] = []

    def client(self) -> genai.Client:
        def handler(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return httpx.Response(self.status, content=self.body, headers={"content-type": self.content_type})

        http = httpx.Client(transport=httpx.MockTransport(handler))
        return genai.Client(
            api_key="x", http_options=types.HttpOptions(base_url="http://polar.test", httpx_client=http)
        )


def sdk_response(body: dict[str, Any]) -> types.GenerateContentResponse:
    return (
        Recorder(200, orjson.dumps(body), "application/json")
        .client()
        .models.generate_content(model="gem-test", contents="hi")
    )


def sdk_stream(body: bytes) -> list[types.GenerateContentResponse]:
    return list(
        Recorder(200, body, "text/event-stream")
        .client()
        .models.generate_content_stream(model="gem-test", contents="hi")
    )


def merged(chunks: list[types.GenerateContentResponse]) -> dict[str, Any]:
    """What a streaming client assembles: consecutive text parts of the same kind concatenated,
    finish reason and usage from the last chunk."""
    parts: list[dict[str, Any]] = []
    for chunk in chunks:
        for part in chunk.candidates[0].content.parts:
            p = part.model_dump(exclude_none=True)
            if parts and "text" in p and "text" in parts[-1] and p.get("thought") == parts[-1].get("thought"):
                parts[-1]["text"] += p["text"]
            else:
                parts.append(p)
    last = chunks[-1]
    return {
        "parts": parts,
        "finish": last.candidates[0].finish_reason,
        "usage": last.usage_metadata.model_dump(),
        "ids": {c.response_id for c in chunks},
        "model": {c.model_version for c in chunks},
    }


# ---------------------------------------------------------------- routes


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/v1beta/models/gemini-2.5-pro:generateContent", ("generate", False, "gemini-2.5-pro", False)),
        ("POST", "/v1beta/models/gem:streamGenerateContent?alt=sse", ("generate", True, "gem", True)),
        ("POST", "/v1beta/models/gem:streamGenerateContent", ("generate", True, "gem", False)),
        ("POST", "/v1/models/gem:streamGenerateContent?key=k&alt=sse", ("generate", True, "gem", True)),
        ("POST", "/v1beta/models/gem:countTokens", ("count_tokens", None, "gem", None)),
        ("GET", "/v1beta/models/gem:generateContent", None),
        ("POST", "/v1beta/models/gem:embedContent", None),
        ("POST", "/v1/chat/completions", None),
    ],
)
def test_route(method: str, path: str, expected: tuple | None) -> None:
    found = PROVIDER.route(method, path)
    got = (found.kind, found.stream_hint, found.model, found.params.get("sse")) if found else None
    assert got == expected


def test_registered_and_unique() -> None:
    assert [p.name for p in all_providers() if p.route("POST", "/v1beta/models/g:generateContent")] == ["gemini"]


# ---------------------------------------------------------------- parse_request


def test_system_instruction_contents_and_model_from_path() -> None:
    req = parse(
        systemInstruction={"role": "user", "parts": [{"text": "You are a coder."}, {"text": "Be brief."}]},
        contents=[
            {"role": "user", "parts": [{"text": "context"}, {"text": "question"}]},
            {
                "role": "model",
                "parts": [{"text": "thinking about it", "thought": True}, {"text": "Ans"}, {"text": "wer."}],
            },
            {"parts": [{"text": "thanks"}]},  # role defaults to user
        ],
    )
    assert req.model == "gem-test" and req.api == "gemini"
    assert req.messages == [
        {"role": "system", "content": "You are a coder.\n\nBe brief."},
        {"role": "user", "content": "context\nquestion"},
        # A model turn's text parts are fragments of one text (a streamed answer).
        {"role": "assistant", "content": "Answer.", "reasoning_content": "thinking about it"},
        {"role": "user", "content": "thanks"},
    ]


def test_function_calls_and_responses_with_and_without_ids() -> None:
    req = parse(
        contents=[
            {"role": "user", "parts": [{"text": "read a and b"}]},
            {
                "role": "model",
                "parts": [
                    {"functionCall": {"name": "read_file", "args": {"path": "a"}}, "thoughtSignature": "c2ln"},
                    {"functionCall": {"name": "read_file", "args": {"path": "b"}}},
                    {"functionCall": {"id": "call_x", "name": "ls", "args": {}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"id": "call_x", "name": "ls", "response": {"output": "a b"}}},
                    {"functionResponse": {"name": "read_file", "response": {"output": "A"}}},
                    {"function_response": {"name": "read_file", "response": {"error": "no such file"}}},
                ],
            },
        ]
    )
    assert req.messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a"}'}},
            {"id": "call_1_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"b"}'}},
            {"id": "call_x", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
        ],
    }
    # Responses without ids answer the earliest open call of their name, in order.
    assert req.messages[2:] == [
        {"role": "tool", "tool_call_id": "call_x", "content": '{"output":"a b"}'},
        {"role": "tool", "tool_call_id": "call_1_0", "content": '{"output":"A"}'},
        {"role": "tool", "tool_call_id": "call_1_1", "content": '{"error":"no such file"}'},
    ]


def test_ids_are_stable_across_requests() -> None:
    history = [
        {"role": "user", "parts": [{"text": "go"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {}}}]},
    ]
    longer = history + [{"role": "model", "parts": [{"text": "ok"}]}, {"role": "user", "parts": [{"text": "more"}]}]
    assert parse(contents=longer).messages[: len(parse(contents=history).messages)] == parse(contents=history).messages


def test_tools_schema_and_hosted_tools() -> None:
    req = parse(
        tools=[
            {"functionDeclarations": [READ_FILE, {"name": "noop"}]},
            {
                "function_declarations": [
                    {"name": "js", "parametersJsonSchema": {"type": "object", "properties": {"a": {"type": "string"}}}}
                ]
            },
            {"googleSearch": {}},
            {"code_execution": {}},
        ]
    )
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string"},
                        "lines": {"type": "array", "items": {"type": "integer"}},
                    },
                    "required": ["path"],
                },
            },
        },
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
        {
            "type": "function",
            "function": {"name": "js", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}},
        },
    ]
    assert req.extra == {"dropped_tools": ["googleSearch", "codeExecution"]}


def test_json_schema_keeps_property_names_called_type() -> None:
    schema = {"type": "OBJECT", "properties": {"type": {"type": "STRING", "enum": ["OBJECT"]}}}
    assert json_schema(schema) == {"type": "object", "properties": {"type": {"type": "string", "enum": ["OBJECT"]}}}


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"functionCallingConfig": {"mode": "AUTO"}}, "auto"),
        ({"functionCallingConfig": {"mode": "ANY"}}, "required"),
        (
            {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["read_file"]}},
            {"type": "function", "function": {"name": "read_file"}},
        ),
        ({"function_calling_config": {"mode": "NONE"}}, "none"),
        ({"functionCallingConfig": {"mode": "VALIDATED"}}, "auto"),
        ({"functionCallingConfig": {}}, None),
    ],
)
def test_tool_config(config: dict, expected: Any) -> None:
    assert parse(tools=[{"functionDeclarations": [READ_FILE]}], toolConfig=config).tool_choice == expected


def test_generation_config_and_thinking() -> None:
    req = parse(
        generationConfig={
            "temperature": 0.2,
            "topP": 0.9,
            "topK": 40,
            "maxOutputTokens": 64,
            "stopSequences": ["END"],
            "seed": 7,
            "candidateCount": 1,
            "thinkingConfig": {"thinkingBudget": 1024, "includeThoughts": True},
        }
    )
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.seed) == (0.2, 0.9, 40, 64, ["END"], 7)
    assert req.enable_thinking is True
    assert parse(generation_config={"thinking_config": {"thinking_budget": 0}}).enable_thinking is False
    assert parse(generationConfig={"thinkingConfig": {"includeThoughts": True}}).enable_thinking is None
    assert parse().enable_thinking is None and parse().stream is False


def test_stream_flags() -> None:
    sse_req = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    assert sse_req.stream is True and sse_req.extra == {}
    array = parse("/v1beta/models/gem-test:streamGenerateContent")
    assert array.stream is False and array.extra == {"json_array": True}


def test_count_tokens_bodies() -> None:
    count = PROVIDER.route("POST", "/v1beta/models/gem-test:countTokens")
    plain = PROVIDER.parse_request({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, count)
    wrapped = PROVIDER.parse_request(
        {
            "generateContentRequest": {
                "model": "models/gem-test",
                "contents": [{"parts": [{"text": "hi"}]}],
                "systemInstruction": {"parts": [{"text": "sys"}]},
            }
        },
        count,
    )
    assert plain.messages == [{"role": "user", "content": "hi"}]
    assert wrapped.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert PROVIDER.render_count_tokens(9) == {"totalTokens": 9}


@pytest.mark.parametrize(
    "body",
    [
        [1],
        {},
        {"contents": []},
        {"contents": "hi"},
        {"contents": [{"role": "wizard", "parts": [{"text": "x"}]}]},
        {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]},
        {"contents": [{"role": "user", "parts": [{"text": 5}]}]},
        {"contents": [{"role": "user", "parts": "hi"}]},
        {"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]},
        {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": "x"}}]}]},
        {"contents": [{"role": "model", "parts": [{"executableCode": {"code": "1"}}]}]},
        {"contents": [{"role": "user", "parts": [{"functionResponse": {"response": {}}}]}]},
        {"contents": [{"parts": [{"text": "hi"}]}], "tools": [{"teleport": {}}]},
        {"contents": [{"parts": [{"text": "hi"}]}], "tools": [{"functionDeclarations": [{"description": "x"}]}]},
        {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"candidateCount": 2}},
        {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"temperature": "hot"}},
        {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 0}},
        {"contents": [{"parts": [{"text": "hi"}]}], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}},
        {"contents": [{"parts": [{"text": "hi"}]}], "systemInstruction": 5},
    ],
)
def test_invalid_requests_are_400(body: Any) -> None:
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request(body, route())
    assert err.value.status == 400 and err.value.kind == "invalid_request" and err.value.message


def test_what_the_sdk_sends_parses() -> None:
    recorder = Recorder(200, orjson.dumps(PROVIDER.render_response(parse(), completion(), CTX)), "application/json")
    history = [
        types.Content(role="user", parts=[types.Part(text="read a")]),
        types.Content(
            role="model",
            parts=[
                types.Part(text="plan", thought=True),
                types.Part(function_call=types.FunctionCall(id="c1", name="read_file", args={"path": "a"})),
            ],
        ),
        types.Content(
            role="user",
            parts=[
                types.Part(
                    function_response=types.FunctionResponse(id="c1", name="read_file", response={"output": "A"})
                )
            ],
        ),
    ]
    config = types.GenerateContentConfig(
        system_instruction="sys",
        temperature=0.5,
        max_output_tokens=32,
        stop_sequences=["X"],
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**READ_FILE)])],
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY")),
        thinking_config=types.ThinkingConfig(thinking_budget=0),
    )
    recorder.client().models.generate_content(model="gem-test", contents=history, config=config)
    (sent,) = recorder.requests
    req = PROVIDER.parse_request(orjson.loads(sent.content), PROVIDER.route(sent.method, sent.url.raw_path.decode()))
    assert req.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "read a"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "plan",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"output":"A"}'},
    ]
    assert (req.sampling.temperature, req.sampling.max_tokens, req.sampling.stop) == (0.5, 32, ["X"])
    assert req.tool_choice == "required" and req.enable_thinking is False
    assert req.tools[0]["function"]["parameters"]["properties"]["path"] == {"type": "string"}


# ---------------------------------------------------------------- render


CASES = {
    "text": completion(content="The quick brown fox jumps over the lazy dog. " * 3),
    "thinking": completion(content="Answer: 42.", reasoning="Six times seven is forty-two, so the answer is 42."),
    "tools": completion(
        content="Let me look.",
        tool_calls=[
            ToolCall("call_1", "read_file", '{"path": "src/main.py", "lines": [1, 2]}'),
            ToolCall("call_2", "ls", ""),
        ],
        finish_reason="tool_calls",
        cached_tokens=4,
    ),
    "tool_only": completion(
        content=None, tool_calls=[ToolCall("call_9", "ls", "not json")], finish_reason="tool_calls"
    ),
    "truncated": completion(content="", finish_reason="length"),
}


def test_non_stream_render_through_the_sdk() -> None:
    body = PROVIDER.render_response(parse(), CASES["tools"], CTX)
    r = sdk_response(body)
    assert r.text == "Let me look." and r.response_id == CTX.response_id and r.model_version == "gem-test"
    assert [(c.id, c.name, c.args) for c in r.function_calls] == [
        ("call_1", "read_file", {"path": "src/main.py", "lines": [1, 2]}),
        ("call_2", "ls", {}),
    ]
    assert r.candidates[0].finish_reason == types.FinishReason.STOP
    u = r.usage_metadata
    assert (u.prompt_token_count, u.candidates_token_count, u.total_token_count, u.cached_content_token_count) == (
        11,
        7,
        18,
        4,
    )


def test_thought_parts_and_broken_arguments() -> None:
    r = sdk_response(PROVIDER.render_response(parse(), CASES["thinking"], CTX))
    parts = r.candidates[0].content.parts
    assert (parts[0].thought, parts[0].text, parts[1].text) == (
        True,
        CASES["thinking"].message.reasoning,
        "Answer: 42.",
    )
    assert r.text == "Answer: 42."  # the SDK leaves thoughts out of .text
    broken = sdk_response(PROVIDER.render_response(parse(), CASES["tool_only"], CTX))
    assert broken.function_calls[0].args == {"raw": "not json"} and broken.text is None


@pytest.mark.parametrize(
    "finish,expected",
    [
        ("stop", "STOP"),
        ("length", "MAX_TOKENS"),
        ("abort", "MAX_TOKENS"),
        ("content_filter", "SAFETY"),
        ("tool_calls", "STOP"),
    ],
)
def test_finish_reason(finish: str, expected: str) -> None:
    body = PROVIDER.render_response(parse(), completion(finish_reason=finish), CTX)
    assert body["candidates"][0]["finishReason"] == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdk_stream_assembles_to_the_non_stream_answer(name: str) -> None:
    request = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    comp = CASES[name]
    chunks = sdk_stream(sse(PROVIDER.render_stream(request, comp, CTX)))
    whole = sdk_response(PROVIDER.render_response(parse(), comp, CTX))
    got = merged(chunks)
    assert got["parts"] == [p.model_dump(exclude_none=True) for p in whole.candidates[0].content.parts]
    assert got["finish"] == whole.candidates[0].finish_reason and got["usage"] == whole.usage_metadata.model_dump()
    assert got["ids"] == {CTX.response_id} and got["model"] == {"gem-test"}
    # Only the last chunk says the answer is finished.
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])


STREAM_FINISH = {"text": "STOP", "thinking": "STOP", "tools": "STOP", "tool_only": "STOP", "truncated": "MAX_TOKENS"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdk_stream_parse_carries_the_completion(name: str) -> None:
    """The SDK's parse of our stream against the completion and the API's fields, not against our
    own non-stream render: thought text, answer text, function calls, finish reason, usage."""
    comp = CASES[name]
    request = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    chunks = sdk_stream(sse(PROVIDER.render_stream(request, comp, CTX)))
    parts = [p for c in chunks for p in c.candidates[0].content.parts]
    assert "".join(p.text for p in parts if p.thought) == (comp.message.reasoning or "")
    assert "".join(p.text for p in parts if p.text is not None and not p.thought) == (comp.message.content or "")
    calls = [(p.function_call.name, p.function_call.args) for p in parts if p.function_call is not None]
    expected_calls = []
    for call in comp.message.tool_calls:
        try:
            args = orjson.loads(call.arguments) if call.arguments else {}
        except orjson.JSONDecodeError:
            args = {"raw": call.arguments}
        expected_calls.append((call.name, args))
    assert calls == expected_calls
    last = chunks[-1]
    assert last.candidates[0].finish_reason == STREAM_FINISH[name]
    usage = last.usage_metadata
    assert (usage.prompt_token_count, usage.candidates_token_count, usage.total_token_count) == (11, 7, 18)
    assert usage.cached_content_token_count == comp.cached_tokens


def test_text_streams_in_pieces_and_calls_whole() -> None:
    request = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    events = list(PROVIDER.render_stream(request, CASES["tools"], CTX))
    assert all(e.event is None for e in events) and len(events) == 2  # "Let me look." is one piece
    assert [p["functionCall"]["name"] for p in events[-1].data["candidates"][0]["content"]["parts"]] == [
        "read_file",
        "ls",
    ]
    text = list(PROVIDER.render_stream(request, CASES["text"], CTX))
    assert (
        len(text) > 3
        and "".join(e.data["candidates"][0]["content"]["parts"][0]["text"] for e in text)
        == CASES["text"].message.content
    )


def test_json_array_answer_for_stream_without_alt_sse() -> None:
    request = parse("/v1beta/models/gem-test:streamGenerateContent")
    body = PROVIDER.render_response(request, CASES["thinking"], CTX)
    assert isinstance(body, list) and body == [e.data for e in PROVIDER.render_stream(request, CASES["thinking"], CTX)]
    chunks = [types.GenerateContentResponse.model_validate(c) for c in body]
    assert (
        "".join(c.candidates[0].content.parts[0].text for c in chunks if not c.candidates[0].content.parts[0].thought)
        == "Answer: 42."
    )


def test_keepalive_is_invisible_to_the_sdk() -> None:
    request = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    keep = PROVIDER.keepalive(request, CTX)
    assert keep.strip() == b""
    comp = CASES["thinking"]
    assert merged(sdk_stream(sse(PROVIDER.render_stream(request, comp, CTX), keep * 3))) == merged(
        sdk_stream(sse(PROVIDER.render_stream(request, comp, CTX)))
    )


# ---------------------------------------------------------------- errors


# kind -> (HTTP code the engines raise it with, google.rpc status), as Google's API reports them.
GOOGLE_ERRORS = {
    "invalid_request": (400, "INVALID_ARGUMENT"),
    "request_too_large": (413, "INVALID_ARGUMENT"),
    "authentication": (401, "UNAUTHENTICATED"),
    "not_found": (404, "NOT_FOUND"),
    "context_length_exceeded": (400, "INVALID_ARGUMENT"),
    "overloaded": (503, "UNAVAILABLE"),
    "timeout": (504, "DEADLINE_EXCEEDED"),
    "api_error": (502, "INTERNAL"),
    "storage_unavailable": (503, "UNAVAILABLE"),
}
assert sorted(GOOGLE_ERRORS) == sorted(ERROR_KINDS)


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_every_error_kind_has_its_google_status(kind: str) -> None:
    code, status = GOOGLE_ERRORS[kind]
    body = PROVIDER.render_error(PolarError(code, kind, "boom"))
    assert body == {"error": {"code": code, "message": "boom", "status": status}}
    [event] = PROVIDER.render_stream_error(PolarError(code, kind, "boom"), None)  # type: ignore[arg-type]
    assert event.data == body


def test_an_unknown_error_kind_is_internal() -> None:
    assert PROVIDER.render_error(PolarError(500, "brand_new", "x"))["error"]["status"] == "INTERNAL"


@pytest.mark.parametrize(
    "status,kind,exc", [(400, "context_length_exceeded", errors.ClientError), (503, "overloaded", errors.ServerError)]
)
def test_sdk_reads_error_bodies(status: int, kind: str, exc: type[Exception]) -> None:
    error = PolarError(status, kind, f"{kind} happened")
    client = Recorder(status, orjson.dumps(PROVIDER.render_error(error)), "application/json").client()
    with pytest.raises(exc) as raised:
        client.models.generate_content(model="gem-test", contents="hi")
    assert raised.value.code == status and raised.value.message == f"{kind} happened"


def test_sdk_raises_on_stream_error_event() -> None:
    request = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    head = list(PROVIDER.render_stream(request, CASES["text"], CTX))[:2]
    error = PolarError(503, "overloaded", "engine unavailable")
    with pytest.raises(errors.ServerError, match="engine unavailable"):
        sdk_stream(sse(head + list(PROVIDER.render_stream_error(error, CTX))))


def test_sdk_count_tokens() -> None:
    client = Recorder(200, orjson.dumps(PROVIDER.render_count_tokens(42)), "application/json").client()
    assert client.models.count_tokens(model="gem-test", contents="hi").total_tokens == 42


# ---------------------------------------------------------------- exact messages, details and bodies


H = [{"parts": [{"text": "hi"}]}]


@pytest.mark.parametrize(
    "body,message",
    [
        ({"contents": [5]}, "contents[0] must be an object"),
        ({"contents": []}, "'contents' is required and must be a non-empty list"),
        ({"contents": [{"role": "wizard", "parts": []}]}, "contents[0]: role must be 'user' or 'model', got 'wizard'"),
        ({"contents": [{"parts": "hi"}]}, "contents[0]: 'parts' must be a list of objects"),
        ({"contents": [{"parts": [{"text": 5}]}]}, "contents[0].parts[0]: 'text' must be a string"),
        (
            {"contents": [{"role": "model", "parts": [{"text": "a"}, {"text": 5}]}]},
            "contents[0].parts[1]: 'text' must be a string",
        ),
        ({"contents": [{"parts": ["hi"]}]}, "contents[0]: 'parts' must be a list of objects"),
        ({"contents": [{"parts": 5}]}, "contents[0]: 'parts' must be a list of objects"),
        # Inline and file data under either spelling, with or without a thought signature beside them.
        *[
            (
                {"contents": [{"role": role, "parts": [{"thoughtSignature": "c2ln", kind: {}}]}]},
                "contents[0].parts[0]: inline or file data parts are not supported by this engine (text only)",
            )
            for kind in ("inlineData", "inline_data", "fileData", "file_data")
            for role in ("user", "model")
        ],
        (
            {"contents": [{"parts": [{"thought": True, "thoughtSignature": "c2ln", "executableCode": {}}]}]},
            "contents[0].parts[0]: unsupported part ['executableCode']",
        ),
        (
            {"contents": [{"role": "model", "parts": [{"executableCode": {}, "codeExecutionResult": {}}]}]},
            "contents[0].parts[0]: unsupported part ['executableCode', 'codeExecutionResult']",
        ),
        # A user turn holds no thoughts.
        (
            {"contents": [{"parts": [{"text": "t", "thought": True}]}]},
            "contents[0].parts[0]: unsupported part ['text']",
        ),
        (
            {"contents": [{"role": "model", "parts": [{"text": "a"}, {"functionCall": "f"}]}]},
            "contents[0].parts[1]: functionCall needs a string 'name'",
        ),
        (
            {"contents": [{"role": "model", "parts": [{"text": "a"}, {"functionCall": {"name": "f", "args": [1]}}]}]},
            "contents[0].parts[1]: functionCall 'args' must be an object",
        ),
        (
            {"contents": [{"parts": [{"text": "a"}, {"functionResponse": {"name": 1}}]}]},
            "contents[0].parts[1]: functionResponse needs a string 'name'",
        ),
        ({"contents": H, "systemInstruction": 5}, "'systemInstruction' must be a Content object"),
        (
            {"contents": H, "systemInstruction": {"parts": [{"text": "a"}, {"inlineData": {}}]}},
            "systemInstruction.parts[1]: inline or file data parts are not supported by this engine (text only)",
        ),
        (
            {"contents": H, "systemInstruction": {"parts": [{"text": "a"}, {"text": 1}]}},
            "systemInstruction.parts[1]: 'text' must be a string",
        ),
        ({"contents": H, "systemInstruction": {"parts": "a"}}, "systemInstruction: 'parts' must be a list of objects"),
        ({"contents": H, "tools": {}}, "'tools' must be a list"),
        ({"contents": H, "tools": [{"googleSearch": {}}, 1]}, "tools[1] must be an object"),
        (
            {"contents": H, "tools": [{"googleSearch": {}}, {"teleport_me": {}}]},
            "tools[1]: unsupported tool 'teleport_me'",
        ),
        (
            {"contents": H, "tools": [{"functionDeclarations": {"name": "f"}}]},
            "tools[0]: functionDeclarations must be a list",
        ),
        (
            {"contents": H, "tools": [{"functionDeclarations": [{"name": "f"}, {"description": "x"}]}]},
            "tools[0].functionDeclarations[1]: 'name' is required",
        ),
        (
            {"contents": H, "tools": [{"functionDeclarations": [{"name": "f", "parameters": [1]}]}]},
            "tools[0].functionDeclarations[0]: parameters must be an object",
        ),
        (
            {"contents": H, "tools": [{"functionDeclarations": [{"name": "f", "parametersJsonSchema": True}]}]},
            "tools[0].functionDeclarations[0]: parameters must be an object",
        ),
        ({"contents": H, "toolConfig": "ANY"}, "'toolConfig' must be an object"),
        (
            {"contents": H, "toolConfig": {"functionCallingConfig": 1}},
            "'toolConfig.functionCallingConfig' must be an object",
        ),
        (
            {"contents": H, "toolConfig": {"functionCallingConfig": {"mode": "sometimes"}}},
            "unsupported functionCallingConfig.mode 'sometimes'",
        ),
        ({"contents": H, "generationConfig": 1}, "'generationConfig' must be an object"),
        (
            {"contents": H, "generationConfig": {"candidateCount": 2}},
            "generationConfig.candidateCount > 1 is not supported: one candidate per request",
        ),
        ({"contents": H, "generationConfig": {"maxOutputTokens": 0}}, "generationConfig.maxOutputTokens must be >= 1"),
        ({"contents": H, "generationConfig": {"topK": 1.5}}, "generationConfig.topK must be an integer"),
        ({"contents": H, "generationConfig": {"topK": True}}, "generationConfig.topK must be an integer"),
        ({"contents": H, "generationConfig": {"topP": True}}, "generationConfig.topP must be a number"),
        ({"contents": H, "generationConfig": {"temperature": "hot"}}, "generationConfig.temperature must be a number"),
        ({"contents": H, "generationConfig": {"topK": 2**31}}, "'generationConfig.topK' must be <= 2147483647"),
        ({"contents": H, "generationConfig": {"top_k": -(2**31)}}, "'generationConfig.topK' must be >= -2147483647"),
        (
            {"contents": H, "generationConfig": {"max_output_tokens": 2**31}},
            "'generationConfig.maxOutputTokens' must be <= 2147483647",
        ),
        (
            {"contents": H, "generationConfig": {"seed": 2**63}},
            "'generationConfig.seed' must be <= 9223372036854775807",
        ),
        (
            {"contents": H, "generationConfig": {"seed": -(2**63)}},
            "'generationConfig.seed' must be >= -9223372036854775807",
        ),
        (
            {"contents": H, "generationConfig": {"candidate_count": 2**31}},
            "'generationConfig.candidateCount' must be <= 2147483647",
        ),
        (
            {"contents": H, "generationConfig": {"thinkingConfig": 1}},
            "generationConfig.thinkingConfig must be an object",
        ),
        (
            {"contents": H, "generationConfig": {"stopSequences": 1}},
            "'generationConfig.stopSequences' must be a string or a list of strings",
        ),
    ],
)
def test_invalid_requests_say_what_and_where(body: dict[str, Any], message: str) -> None:
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request(body, route())
    assert (err.value.status, err.value.kind, err.value.message) == (400, "invalid_request", message)


def test_a_body_that_is_not_an_object_and_a_route_without_a_model() -> None:
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request([{"contents": H}], route())  # type: ignore[arg-type]
    assert (err.value.status, err.value.kind, err.value.message) == (
        400,
        "invalid_request",
        "request body must be a JSON object",
    )
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request({"contents": H}, Route(kind="generate"))
    assert (err.value.status, err.value.kind, err.value.message) == (
        400,
        "invalid_request",
        "the model must be named in the path: /models/{model}:generateContent",
    )


def test_history_details_the_api_allows() -> None:
    req = parse(
        systemInstruction="plain text",
        contents=[
            {"role": "user", "parts": []},  # an empty user turn is an empty message
            {"role": "model"},  # no parts at all
            {
                "role": "model",
                "parts": [
                    {"thoughtSignature": "c2ln"},  # a signature on its own is skipped
                    {"thought_signature": "c2ln", "thought": True},
                    {"thought": True, "thoughtSignature": "c2ln", "thought_signature": "c2ln"},
                    {"functionCall": {"name": "f"}},  # no args: an empty object
                    {"function_call": {"name": "g", "args": {}}},
                ],
            },
            # A response to no open call keeps a positional id; `function` is the older role of responses.
            {
                "role": "function",
                "parts": [{"functionResponse": {"name": "h"}}, {"functionResponse": {"name": "g", "response": None}}],
            },
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "f", "response": {"ok": 1}}}, {"text": "a"}, {"text": "b"}],
            },
        ],
    )
    assert req.messages == [
        {"role": "system", "content": "plain text"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_2_3", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_2_4", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_3_0", "content": "{}"},
        {"role": "tool", "tool_call_id": "call_2_4", "content": "{}"},
        # Tool results come before the user's text of the same turn; user text parts are paragraphs.
        {"role": "tool", "tool_call_id": "call_2_3", "content": '{"ok":1}'},
        {"role": "user", "content": "a\nb"},
    ]
    # A response's own id wins over the order of the calls, even before any model turn.
    by_id = parse(
        contents=[
            {"parts": [{"functionResponse": {"name": "f"}}]},
            {
                "role": "model",
                "parts": [{"functionCall": {"id": "a", "name": "f"}}, {"functionCall": {"id": "b", "name": "f"}}],
            },
            {"parts": [{"functionResponse": {"id": "b", "name": "f"}}, {"functionResponse": {"name": "f"}}]},
        ]
    ).messages
    assert [m.get("tool_call_id") for m in by_id] == ["call_0_0", None, "b", "a"]
    # An answered call is closed: a second response of that name answers nothing open.
    again = parse(
        contents=[
            {"role": "model", "parts": [{"functionCall": {"name": "f"}}]},
            {"parts": [{"functionResponse": {"name": "f"}}]},
            {"parts": [{"functionResponse": {"name": "f"}}]},
        ]
    ).messages
    assert [m.get("tool_call_id") for m in again] == [None, "call_0_0", "call_2_0"]


def test_tool_details_the_api_allows() -> None:
    req = parse(
        tools=[
            {
                "functionDeclarations": [
                    {
                        "name": "a",
                        "description": None,
                        "parameters": {"type": "OBJECT", "anyOf": [{"type": "STRING"}, {"type": "custom"}]},
                    },
                    {"name": "b", "parameters_json_schema": {"type": "OBJECT"}},  # JSON Schema is passed on as it is
                ]
            },
            {"functionDeclarations": []},
            {"google_search_retrieval": {}, "url_context": {}},
        ]
    )
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "a",
                "parameters": {"type": "object", "anyOf": [{"type": "string"}, {"type": "custom"}]},
            },
        },
        {"type": "function", "function": {"name": "b", "parameters": {"type": "OBJECT"}}},
    ]
    assert req.extra == {"dropped_tools": ["googleSearchRetrieval", "urlContext"]}
    assert json_schema([{"type": "NULL"}, 3]) == [{"type": "null"}, 3]


@pytest.mark.parametrize(
    "config,expected",
    [
        (
            {"functionCallingConfig": {"mode": "any", "allowed_function_names": ["f"]}},
            {"type": "function", "function": {"name": "f"}},
        ),
        ({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f", "g"]}}, "required"),
        ({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [1]}}, "required"),
        ({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": "f"}}, "required"),
        ({"functionCallingConfig": {"mode": "MODE_UNSPECIFIED"}}, None),
        ({"functionCallingConfig": {"mode": "auto"}}, "auto"),
        ({"function_calling_config": None}, None),
        ({}, None),
    ],
)
def test_tool_config_details(config: dict, expected: Any) -> None:
    assert parse(tools=[{"functionDeclarations": [READ_FILE]}], toolConfig=config).tool_choice == expected
    # With no function tools nothing can be chosen: an engine refuses a choice without tools.
    assert parse(toolConfig=config).tool_choice is None


def test_generation_config_details() -> None:
    s = parse(
        generationConfig={"temperature": 1, "topP": 1, "maxOutputTokens": 1, "stopSequences": "END", "seed": 2**40}
    ).sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.stop, s.seed) == (1.0, 1.0, 1, ["END"], 2**40)
    assert isinstance(s.temperature, float) and isinstance(s.top_p, float)
    assert parse(generationConfig={"seed": -(2**40), "top_k": -(2**31 - 1)}).sampling.seed == -(2**40)
    assert parse(generationConfig={"topK": 2**31 - 1}).sampling.top_k == 2**31 - 1
    s = parse(generationConfig={"candidateCount": None, "temperature": None}).sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.seed) == (None, None, None, None, [], None)
    assert parse(generationConfig=None).sampling == s
    assert parse(generationConfig={"thinkingConfig": {"thinkingLevel": "LOW"}}).enable_thinking is True
    assert (
        parse(generationConfig={"thinkingConfig": {"thinking_level": "HIGH", "thinkingBudget": None}}).enable_thinking
        is True
    )
    assert parse(generationConfig={"thinkingConfig": {"thinkingBudget": -1}}).enable_thinking is True
    assert parse(generationConfig={"thinking_config": None}).enable_thinking is None


def test_count_tokens_body_forms() -> None:
    count = route("/v1beta/models/gem-test:countTokens")
    # A generateContentRequest wrapper only means something to countTokens, and only as an object.
    assert PROVIDER.parse_request(
        {"generate_content_request": {"contents": [{"parts": [{"text": "w"}]}]}, "contents": H}, count
    ).messages == [{"role": "user", "content": "w"}]
    assert PROVIDER.parse_request(
        {"generateContentRequest": {"contents": [{"parts": [{"text": "w"}]}]}, "contents": H}, route()
    ).messages == [{"role": "user", "content": "hi"}]
    assert PROVIDER.parse_request({"generateContentRequest": "w", "contents": H}, count).messages == [
        {"role": "user", "content": "hi"}
    ]


def test_routes_read_the_query_parameters_exactly() -> None:
    assert route("/v1beta/models/gem:streamGenerateContent?alt=sse&key=k").params == {"sse": True}
    assert route("/v1beta/models/gem:streamGenerateContent?alt=sseX").params == {"sse": False}
    assert route("/v1beta/models/gem:generateContent?alt=sse").stream_hint is False
    assert PROVIDER.route("post", "/v1beta/models/gem:generateContent") is not None
    assert PROVIDER.route("POST", "/v1beta/models/gem:generateContent/x") is None


# The body of generateContent as the API reference writes it (GenerateContentResponse: candidates[].content
# with role "model", index, finishReason; usageMetadata; modelVersion; responseId), by hand.
def test_non_stream_body_is_the_api_shape() -> None:
    body = PROVIDER.render_response(parse(), CASES["tools"], CTX)
    assert body == {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "Let me look."},
                        {
                            "functionCall": {
                                "id": "call_1",
                                "name": "read_file",
                                "args": {"path": "src/main.py", "lines": [1, 2]},
                            }
                        },
                        {"functionCall": {"id": "call_2", "name": "ls", "args": {}}},
                    ],
                },
                "index": 0,
                "finishReason": "STOP",
            }
        ],
        "modelVersion": "gem-test",
        "responseId": CTX.response_id,
        "usageMetadata": {
            "promptTokenCount": 11,
            "candidatesTokenCount": 7,
            "totalTokenCount": 18,
            "cachedContentTokenCount": 4,
        },
    }
    types.GenerateContentResponse.model_validate(body)
    thinking = PROVIDER.render_response(parse(), completion(content="", reasoning="hm"), CTX)
    assert thinking["candidates"][0]["content"]["parts"] == [{"text": "hm", "thought": True}, {"text": ""}]
    assert "cachedContentTokenCount" not in thinking["usageMetadata"]
    # A finish reason Gemini has no name for is a plain STOP.
    assert (
        PROVIDER.render_response(parse(), completion(finish_reason="other"), CTX)["candidates"][0]["finishReason"]
        == "STOP"
    )


def test_stream_chunks_are_the_api_shape() -> None:
    request = parse("/v1beta/models/gem-test:streamGenerateContent?alt=sse")
    chunks = [e.data for e in PROVIDER.render_stream(request, completion(content="", reasoning="x" * 17), CTX)]
    head = {"modelVersion": "gem-test", "responseId": CTX.response_id}
    assert chunks == [
        {
            "candidates": [{"content": {"role": "model", "parts": [{"text": "x" * 16, "thought": True}]}, "index": 0}],
            **head,
        },
        # An empty answer text streams no piece: the last thought piece carries the finish.
        {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": "x", "thought": True}]},
                    "index": 0,
                    "finishReason": "STOP",
                }
            ],
            **head,
            "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 7, "totalTokenCount": 18},
        },
    ]
    # An empty answer is still one chunk, with one empty text part.
    empty = [e.data for e in PROVIDER.render_stream(request, completion(content=None), CTX)]
    assert [c["candidates"][0]["content"]["parts"] for c in empty] == [[{"text": ""}]]


def test_context_length_message_in_gemini_wording() -> None:
    counted = PROVIDER.render_error(ContextLengthExceeded("x", prompt_tokens=40000, window=32768))
    assert counted == {
        "error": {
            "code": 400,
            "status": "INVALID_ARGUMENT",
            "message": "The input token count (40000) exceeds the maximum number of tokens allowed (32768).",
        }
    }
    assert PROVIDER.render_error(ContextLengthExceeded("too long"))["error"]["message"] == "too long"
