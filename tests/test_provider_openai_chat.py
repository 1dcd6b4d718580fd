"""OpenAI Chat Completions translator: request normalization, renders checked by the official SDK."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from polar_addon.canonical import Completion, ContextLengthExceeded, PolarError, ToolCall
from polar_addon.providers import ResponseContext, Route
from polar_addon.providers.openai_chat import PROVIDER
from tests.support.providers import canned_http, completion, sse_bytes

GENERATE = Route(kind="generate")
CTX = ResponseContext(response_id="chatcmpl-test1", created=1_700_000_000, model="qwen-test")
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


def parse(**body: Any):
    body.setdefault("model", "qwen-test")
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return PROVIDER.parse_request(body, GENERATE)


def client_for(status: int, body: bytes, content_type: str) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="x", base_url="http://polar.test/v1", http_client=canned_http(status, body, content_type), max_retries=0
    )


def sdk_stream_final(request, comp: Completion, prefix: bytes = b"") -> dict[str, Any]:
    """What the SDK accumulates from our SSE bytes: openai.Stream decodes them, the SDK's own
    ChatCompletionStreamState merges the chunks (its parse step is skipped: it refuses length stops)."""
    client = client_for(200, sse_bytes(PROVIDER.render_stream(request, comp, CTX), prefix), "text/event-stream")
    stream = client.chat.completions.create(
        model="qwen-test", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    snapshot = state.current_completion_snapshot.model_dump(exclude_unset=True)
    snapshot["choices"][0]["message"].pop("parsed", None)
    for call in snapshot["choices"][0]["message"].get("tool_calls") or []:
        # Fields of the accumulator's own (delta index, parse result), not of a message.
        del call["index"], call["function"]["parsed_arguments"]
    return ChatCompletion.model_validate(snapshot).model_dump()


# ---------------------------------------------------------------- routes


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/v1/chat/completions", "generate"),
        ("POST", "/openai/v1/chat/completions?api-version=1", "generate"),
        ("post", "/chat/completions", "generate"),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/responses", None),
        ("POST", "/v1/messages", None),
        ("POST", "/v1/chat/completions/extra", None),
        ("POST", "/v1/chat/completions/", "generate"),
        ("POST", "/v1/chat/completions?a=1?b", "generate"),  # the query is everything after the first '?'
        ("POST", "/v1/chat/completionsX", None),
    ],
)
def test_route(method: str, path: str, expected: str | None) -> None:
    route = PROVIDER.route(method, path)
    assert (route.kind if route else None) == expected


# ---------------------------------------------------------------- parse_request


def test_system_and_developer_texts_before_the_conversation_make_one_leading_system_message() -> None:
    req = parse(
        messages=[
            {"role": "system", "content": "You are a coder."},
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
        ]
    )
    assert req.messages == [
        {"role": "system", "content": "You are a coder.\n\nBe brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
    ]
    assert req.api == "openai_chat" and req.model == "qwen-test"


def test_a_system_message_inside_the_conversation_stays_where_it_was_sent() -> None:
    """gptme sends each tool's output as a system message after the assistant turn that ran it."""
    req = parse(
        messages=[
            {"role": "system", "content": "You are a coder."},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "assistant", "content": "```shell\nls\n```"},
            {"role": "system", "content": "Ran command: `ls`"},
        ]
    )
    assert req.messages == [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "```shell\nls\n```"},
        {"role": "system", "content": "Ran command: `ls`"},
    ]


def test_no_system_message_when_none_given() -> None:
    assert parse().messages == [{"role": "user", "content": "hi"}]


def test_billing_header_line_is_stripped_from_system() -> None:
    system = "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=cli; cch=ab12;\nYou are a coder."
    assert parse(messages=[{"role": "system", "content": system}, {"role": "user", "content": "q"}]).messages[0] == {
        "role": "system",
        "content": "You are a coder.",
    }


def test_text_parts_joined_and_images_rejected() -> None:
    req = parse(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.messages == [{"role": "user", "content": "a\nb"}]
    with pytest.raises(PolarError) as err:
        parse(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}])
    assert err.value.status == 400 and err.value.kind == "invalid_request" and "image_url" in err.value.message


def test_multi_turn_with_tool_calls_and_results() -> None:
    req = parse(
        messages=[
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "use ls",
                "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}},
                    # Some clients echo arguments back as an object.
                    {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": {"path": "x"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "X"}]},
        ]
    )
    assert req.messages[1] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "use ls",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": '{"path":"x"}'}},
        ],
    }
    assert req.messages[2:] == [
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_b", "content": "X"},
    ]


def test_tools_and_tool_choice() -> None:
    tool = {"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}}}
    req = parse(tools=[tool], tool_choice="required")
    assert req.tools == [tool] and req.tool_choice == "required"
    named = parse(tools=[tool], tool_choice={"type": "function", "function": {"name": "bash"}})
    assert named.tool_choice == {"type": "function", "function": {"name": "bash"}}
    assert parse(tools=[], tool_choice="auto").tool_choice is None
    assert parse(tool_choice="auto").tool_choice is None
    with pytest.raises(PolarError):
        parse(tools=[{"type": "custom", "custom": {"name": "x"}}])


def test_sampling_stream_and_extras() -> None:
    req = parse(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        max_tokens=50,
        max_completion_tokens=64,
        stop="END",
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        reasoning_effort="low",
    )
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.seed) == (0.7, 0.9, 20, 64, ["END"], 3)
    assert req.stream is True and req.extra == {"include_usage": True, "reasoning_effort": "low"}
    assert parse(max_tokens=50, stop=["a", "b"]).sampling.max_tokens == 50
    assert parse(stop=["a", "b"]).sampling.stop == ["a", "b"]
    assert parse().extra["include_usage"] is False and parse().stream is False


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"model": "m"},
        {"model": "m", "messages": []},
        {"model": "m", "messages": "hi"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": [1]},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"},
    ],
)
def test_invalid_requests_are_400(body: Any) -> None:
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request(body, GENERATE)
    assert err.value.status == 400 and err.value.kind == "invalid_request" and err.value.message


USER = {"role": "user", "content": "hi"}
REFUSED_TOOL_CHOICE = "'tool_choice' must be 'auto', 'none', 'required' or {type: function, function: {name}}"
NOT_A_CALL = "messages[1]: each tool call needs function.name"


def _assistant(**fields: Any) -> dict[str, Any]:
    return {"messages": [USER, {"role": "assistant", **fields}]}


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"messages": None}, "'messages' is required and must be a non-empty list"),
        ({"messages": "hi"}, "'messages' is required and must be a non-empty list"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]: unsupported role 'wizard'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]: tool messages need a string 'tool_call_id'"),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0]: content must be a string or a list of content parts",
        ),
        (
            {"messages": [{"role": "system", "content": 5}]},
            "messages[0]: content must be a string or a list of content parts",
        ),
        (
            {"messages": [USER, {"role": "tool", "tool_call_id": "c", "content": 5}]},
            "messages[1]: content must be a string or a list of content parts",
        ),
        *[
            (
                {"messages": [{"role": "user", "content": [{"type": kind}]}]},
                f"messages[0]: {kind} parts are not supported by this engine (text only)",
            )
            for kind in ("image_url", "input_audio", "file")
        ],
        (
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "messages[0]: unsupported content part type 'refusal'",
        ),
        (
            _assistant(content=[{"type": "image_url"}]),
            "messages[1]: image_url parts are not supported by this engine (text only)",
        ),
        (_assistant(content=[{"type": "refusal"}]), "messages[1]: refusal part needs a string 'refusal'"),
        (_assistant(content="x", reasoning_content=5), "messages[1]: reasoning_content must be a string"),
        (_assistant(tool_calls="bash"), "messages[1]: tool_calls must be a list"),
        (_assistant(tool_calls=["bash"]), NOT_A_CALL),
        (_assistant(tool_calls=[{"id": "c"}]), NOT_A_CALL),
        (_assistant(tool_calls=[{"id": "c", "function": {"arguments": "{}"}}]), NOT_A_CALL),
        (_assistant(tool_calls=[{"function": {"name": "f"}}]), "messages[1]: each tool call needs an 'id'"),
        ({"model": ""}, "'model' is required and must be a non-empty string"),
        ({"temperature": "hot"}, "'temperature' must be a number"),
        ({"max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"max_completion_tokens": 0}, "'max_completion_tokens' must be >= 1"),
        ({"n": 2}, "'n' > 1 is not supported: one choice per request"),
        ({"n": 0}, "'n' must be >= 1"),
        ({"seed": -(2**63)}, "'seed' must be >= -9223372036854775807"),
        ({"seed": 2**63}, "'seed' must be <= 9223372036854775807"),
        ({"stop": [1]}, "'stop' must be a string or a list of strings"),
        ({"stream": "yes"}, "'stream' must be a boolean"),
        ({"stream_options": "usage"}, "'stream_options' must be an object"),
        ({"tool_choice": "sometimes"}, REFUSED_TOOL_CHOICE),
        ({"tool_choice": {"type": "function"}}, REFUSED_TOOL_CHOICE),
        ({"tool_choice": {"type": "function", "function": "f"}}, REFUSED_TOOL_CHOICE),
        ({"tools": "bash"}, "'tools' must be a list"),
        ({"tools": ["bash"]}, "tools[0]: only function tools are supported"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0]: only function tools are supported"),
        ({"tools": [{"type": "function"}]}, "tools[0]: function.name is required"),
        ({"tools": [{"type": "function", "function": {"description": "d"}}]}, "tools[0]: function.name is required"),
    ],
)
def test_invalid_requests_say_what_and_where(patch: dict[str, Any], message: str) -> None:
    body = {"model": "m", "messages": [USER], **patch}
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request({k: v for k, v in body.items() if v is not None}, GENERATE)
    assert (err.value.status, err.value.kind, err.value.message) == (400, "invalid_request", message)
    with pytest.raises(PolarError, match="request body must be a JSON object"):
        PROVIDER.parse_request([body], GENERATE)  # type: ignore[arg-type]


def test_history_details_the_api_allows() -> None:
    req = parse(
        messages=[
            USER,
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}],
                "tool_calls": [{"id": "c", "function": {"name": "f"}}],
            },
        ],
        tools=[{"function": {"name": "f"}}],  # "type" defaults to "function"
        tool_choice="none",
    )
    assert req.messages[1] == {
        "role": "assistant",
        "content": "a\nb",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}],
    }
    assert req.tools == [{"type": "function", "function": {"name": "f"}}] and req.tool_choice == "none"
    # Reasoning sent back under vLLM's newer key "reasoning" is the same history.
    thought = parse(messages=[USER, {"role": "assistant", "content": "a", "reasoning": "think"}]).messages[1]
    assert thought == {"role": "assistant", "content": "a", "reasoning_content": "think"}
    # The smallest counts, and seeds past int32 (clients send 64-bit seeds).
    assert parse(n=1, max_tokens=1).sampling.max_tokens == parse(max_completion_tokens=1).sampling.max_tokens == 1
    assert [parse(seed=seed).sampling.seed for seed in (-(2**40), 2**40)] == [-(2**40), 2**40]


# ---------------------------------------------------------------- render_response


@pytest.mark.parametrize(
    "finish,has_tools,expected",
    [
        ("stop", False, "stop"),
        ("length", False, "length"),
        ("tool_calls", True, "tool_calls"),
        ("stop", True, "tool_calls"),
        ("content_filter", False, "content_filter"),
        ("abort", False, "length"),
        ("length", True, "length"),
        ("tool_calls", False, "stop"),  # no call was parsed: a plain stop
    ],
)
def test_finish_reason_mapping(finish: str, has_tools: bool, expected: str) -> None:
    calls = [ToolCall("call_1", "bash", "{}")] if has_tools else None
    body = PROVIDER.render_response(parse(), completion(tool_calls=calls, finish_reason=finish), CTX)
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == expected


def test_non_stream_render_is_a_valid_chat_completion() -> None:
    calls = [ToolCall("call_1", "bash", '{"cmd": "ls"}'), ToolCall("call_2", "read", '{"path": "a"}')]
    comp = completion(content=None, reasoning="think", tool_calls=calls, finish_reason="tool_calls", cached_tokens=4)
    parsed = ChatCompletion.model_validate(PROVIDER.render_response(parse(), comp, CTX))
    assert (parsed.id, parsed.created, parsed.model, parsed.object) == (
        "chatcmpl-test1",
        1_700_000_000,
        "qwen-test",
        "chat.completion",
    )
    msg = parsed.choices[0].message
    assert msg.content is None and msg.role == "assistant"
    assert [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("call_1", "bash", '{"cmd": "ls"}'),
        ("call_2", "read", '{"path": "a"}'),
    ]
    assert msg.model_extra["reasoning_content"] == "think"
    assert parsed.usage.prompt_tokens == 11 and parsed.usage.completion_tokens == 7 and parsed.usage.total_tokens == 18
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_text_turn_without_content_has_empty_string() -> None:
    body = PROVIDER.render_response(parse(), completion(content=None, finish_reason="length"), CTX)
    assert body["choices"][0]["message"]["content"] == ""


# ---------------------------------------------------------------- streaming through the SDK


STREAM_CASES = {
    "text": completion(content="The quick brown fox jumps over the lazy dog. " * 3),
    "reasoning_text": completion(content="Answer: 42.", reasoning="Six times seven is forty-two, so the answer is 42."),
    "parallel_tools": completion(
        content="Let me look.",
        tool_calls=[
            ToolCall("call_1", "bash", '{"command": "ls -la /tmp && cat /etc/hostname"}'),
            ToolCall("call_2", "read_file", '{"path": "src/main.py", "limit": 200}'),
        ],
        finish_reason="tool_calls",
        cached_tokens=8,
    ),
    "tool_only": completion(content=None, tool_calls=[ToolCall("call_9", "noop", "")], finish_reason="tool_calls"),
    "empty": completion(content="", finish_reason="length"),
}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
@pytest.mark.parametrize("include_usage", [False, True])
def test_sdk_accumulated_stream_equals_non_stream(name: str, include_usage: bool) -> None:
    comp = STREAM_CASES[name]
    request = parse(stream=True, stream_options={"include_usage": include_usage})
    expected = ChatCompletion.model_validate(PROVIDER.render_response(request, comp, CTX)).model_dump()
    if not include_usage:
        expected["usage"] = None
    assert sdk_stream_final(request, comp) == expected


STREAM_FINISH = {
    "text": "stop",
    "reasoning_text": "stop",
    "parallel_tools": "tool_calls",
    "tool_only": "tool_calls",
    "empty": "length",
}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_sdk_stream_parse_carries_the_completion(name: str) -> None:
    """The SDK's parse of our stream against the completion itself and the API's fields (not against
    our own non-stream render): text, reasoning, tool calls, finish reason, usage."""
    comp = STREAM_CASES[name]
    final = sdk_stream_final(parse(stream=True, stream_options={"include_usage": True}), comp)
    assert (final["id"], final["model"], final["object"]) == ("chatcmpl-test1", "qwen-test", "chat.completion")
    [choice] = final["choices"]
    assert choice["finish_reason"] == STREAM_FINISH[name]
    message = choice["message"]
    assert (message["content"] or "") == (comp.message.content or "")
    assert message.get("reasoning_content") == comp.message.reasoning
    calls = [
        (c["id"], c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []
    ]
    assert calls == [(c.id, "function", c.name, c.arguments) for c in comp.message.tool_calls]
    usage = final["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (11, 7, 18)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached == comp.cached_tokens or (cached in (None, 0) and not comp.cached_tokens)


def test_stream_shape() -> None:
    comp = STREAM_CASES["parallel_tools"]
    request = parse(stream=True, stream_options={"include_usage": True})
    events = list(PROVIDER.render_stream(request, comp, CTX))
    assert all(e.event is None for e in events)
    assert events[-1].data == "[DONE]"
    chunks = [e.data for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 18
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    heads = [d for d in tool_deltas if "id" in d]
    assert [(h["index"], h["id"], h["function"]) for h in heads] == [
        (0, "call_1", {"name": "bash", "arguments": ""}),
        (1, "call_2", {"name": "read_file", "arguments": ""}),
    ]
    # Arguments arrive in several fragments that concatenate back to the exact text.
    fragments = [d["function"]["arguments"] for d in tool_deltas if d["index"] == 0 and "id" not in d]
    assert len(fragments) > 1 and "".join(fragments) == '{"command": "ls -la /tmp && cat /etc/hostname"}'
    # Deterministic: the same completion renders the same events.
    assert [e.data for e in PROVIDER.render_stream(request, comp, CTX)] == [e.data for e in events]


def test_every_chunk_is_a_chat_completion_chunk_of_the_api() -> None:
    """Each chunk validated by the SDK's own ChatCompletionChunk type (its literals included); with
    include_usage every chunk carries "usage": null except the last, which carries only the usage."""
    comp = STREAM_CASES["parallel_tools"]
    chunks = [
        e.data for e in PROVIDER.render_stream(parse(stream=True, stream_options={"include_usage": True}), comp, CTX)
    ]
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        ChatCompletionChunk.model_validate(chunk, strict=True)
    assert all(c["usage"] is None for c in chunks[:-2])
    assert chunks[-2] == {
        "id": "chatcmpl-test1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "qwen-test",
        "choices": [],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 7,
            "total_tokens": 18,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in chunks[:-1]} == {
        ("chatcmpl-test1", "chat.completion.chunk", 1_700_000_000, "qwen-test")
    }


def test_text_is_streamed_in_several_pieces() -> None:
    events = list(PROVIDER.render_stream(parse(stream=True), STREAM_CASES["text"], CTX))
    contents = [e.data["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert len(contents) > 3 and "".join(contents) == STREAM_CASES["text"].message.content
    assert "usage" not in events[0].data


def test_keepalive_is_ignored_by_the_sdk() -> None:
    request = parse(stream=True)
    keep = PROVIDER.keepalive(request, CTX)
    assert keep.startswith(b":") and keep.endswith(b"\n\n")
    comp = STREAM_CASES["reasoning_text"]
    assert sdk_stream_final(request, comp, prefix=keep * 3) == sdk_stream_final(request, comp)


# ---------------------------------------------------------------- errors


# kind -> (type, code) as OpenAI's API documents them; written out, not read from the translator.
OPENAI_ERRORS = {
    "invalid_request": ("invalid_request_error", None),
    "request_too_large": ("invalid_request_error", None),
    "authentication": ("authentication_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("server_error", "overloaded"),
    "timeout": ("server_error", "timeout"),
    "api_error": ("server_error", None),
    "storage_unavailable": ("server_error", "storage_unavailable"),
}
assert sorted(OPENAI_ERRORS) == sorted(ERROR_KINDS)


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_every_error_kind_has_its_openai_type_and_code(kind: str) -> None:
    body = PROVIDER.render_error(PolarError(500, kind, "boom"))
    kind_type, code = OPENAI_ERRORS[kind]
    assert body == {"error": {"message": "boom", "type": kind_type, "param": None, "code": code}}
    # A streamed failure carries the same error object (the SDK raises APIError on it).
    [event] = PROVIDER.render_stream_error(PolarError(500, kind, "boom"), CTX)
    assert event.data == body


def test_an_unknown_error_kind_is_a_server_error() -> None:
    assert PROVIDER.render_error(PolarError(500, "brand_new", "x"))["error"]["type"] == "server_error"


def test_context_length_error_code() -> None:
    err = PROVIDER.render_error(PolarError(400, "context_length_exceeded", "too long"))["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "context_length_exceeded")
    # With the engine's counts, OpenAI's own wording (clients match "maximum context length").
    counted = PROVIDER.render_error(ContextLengthExceeded("x", prompt_tokens=40000, window=32768))["error"]
    assert counted["message"] == (
        "This model's maximum context length is 32768 tokens. However, your messages "
        "resulted in 40000 tokens. Please reduce the length of the messages."
    )


@pytest.mark.parametrize(
    "status,kind,exc",
    [
        (400, "invalid_request", openai.BadRequestError),
        (401, "authentication", openai.AuthenticationError),
        (404, "not_found", openai.NotFoundError),
        (503, "overloaded", openai.InternalServerError),
    ],
)
def test_sdk_reads_error_bodies(status: int, kind: str, exc: type[Exception]) -> None:
    error = PolarError(status, kind, f"{kind} happened")
    client = client_for(status, orjson.dumps(PROVIDER.render_error(error)), "application/json")
    with pytest.raises(exc) as raised:
        client.chat.completions.create(model="qwen-test", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body == PROVIDER.render_error(error)["error"]
    assert raised.value.code == raised.value.body["code"] and raised.value.type == raised.value.body["type"]


def test_sdk_raises_on_stream_error_event() -> None:
    head = list(PROVIDER.render_stream(parse(stream=True), completion(), CTX))[:2]
    error = PolarError(503, "overloaded", "engine unavailable")
    body = sse_bytes(head + list(PROVIDER.render_stream_error(error, CTX)))
    client = client_for(200, body, "text/event-stream")
    with pytest.raises(openai.APIError, match="engine unavailable"):
        with client.chat.completions.stream(model="qwen-test", messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_completion()


def test_no_count_tokens_route() -> None:
    with pytest.raises(NotImplementedError) as err:
        PROVIDER.render_count_tokens(3)
    assert str(err.value) == "OpenAI Chat Completions has no token-count route"
