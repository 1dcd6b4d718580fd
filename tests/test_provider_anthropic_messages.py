"""Anthropic Messages translator: request normalization, renders checked by the official SDK."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest
from anthropic.types import Message

from polar_addon.canonical import (
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    PolarError,
    SamplingParams,
    ToolCall,
)
from polar_addon.providers import ResponseContext, Route, encode_sse
from polar_addon.providers.anthropic_messages import PROVIDER
from polar_addon.providers.common import arguments_object as tool_input
from tests.support.providers import canned_http, completion

GENERATE = Route(kind="generate")
CTX = ResponseContext(response_id="msg_test1", created=1_700_000_000, model="claude-sonnet-4-6")
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=sdk-cli; cch=5f3e1;"
BASH = {
    "name": "Bash",
    "description": "Run a command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}
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


def parse(route: Route = GENERATE, **body: Any) -> CanonicalRequest:
    body.setdefault("model", "claude-sonnet-4-6")
    body.setdefault("max_tokens", 1024)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return PROVIDER.parse_request(body, route)


def client_for(status: int, body: bytes, content_type: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="x", base_url="http://polar.test", http_client=canned_http(status, body, content_type), max_retries=0
    )


def sse_bytes(events, interleave: bytes = b"") -> bytes:
    return b"".join(interleave + encode_sse(e) for e in events)


def sdk_stream_final(request: CanonicalRequest, comp: Completion, interleave: bytes = b"") -> dict[str, Any]:
    body = sse_bytes(PROVIDER.render_stream(request, comp, CTX), interleave)
    client = client_for(200, body, "text/event-stream")
    with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_message()
    # ParsedMessage adds parsed_output (structured outputs) to text blocks; the plain Message lacks it.
    return Message.model_validate(final.model_dump(exclude={"content": {"__all__": {"parsed_output"}}})).model_dump()


# ---------------------------------------------------------------- routes


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/v1/messages?beta=true", "generate"),
        ("POST", "/v1/messages", "generate"),
        ("POST", "/v1/messages/", "generate"),
        ("POST", "/v1/messages?beta=true?x", "generate"),  # the query is everything after the first '?'
        ("POST", "/v1/messagesX", None),
        ("POST", "/anthropic/v1/messages", "generate"),
        ("POST", "/v1/messages/count_tokens?beta=true", "count_tokens"),
        ("GET", "/api/claude_code/policy_limits", "local"),
        ("GET", "/api/claude_code/settings", "local"),
        ("GET", "/api/hello", "local"),
        ("GET", "/v1/messages", None),
        ("POST", "/v1/chat/completions", None),
        ("POST", "/api/claude_code/metrics", None),
    ],
)
def test_route(method: str, path: str, expected: str | None) -> None:
    route = PROVIDER.route(method, path)
    assert (route.kind if route else None) == expected


def test_local_answers_for_claude_code_account_calls() -> None:
    limits = PROVIDER.route("GET", "/api/claude_code/policy_limits").params
    assert limits["status"] == 200
    assert limits["body"] == {"restrictions": {}, "compliance_taints": [], "monitoring_notice": None, "defaults": {}}
    settings = PROVIDER.route("GET", "/api/claude_code/settings").params
    assert settings["status"] == 200 and settings["body"]["settings"] == {}
    assert isinstance(settings["body"]["uuid"], str) and isinstance(settings["body"]["checksum"], str)
    other = PROVIDER.route("GET", "/api/oauth/profile").params
    assert other == {
        "status": 404,
        "body": {
            "type": "error",
            "error": {"type": "not_found_error", "message": "/api/oauth/profile is not served by polar"},
        },
    }
    # The 404 is an error body the SDK reads as such.
    client = client_for(404, orjson.dumps(other["body"]), "application/json")
    with pytest.raises(anthropic.NotFoundError, match="is not served by polar"):
        client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- parse_request


def test_system_messages_inside_messages_join_the_system_prompt() -> None:
    # Claude Code 2.1.197 sends the list of agent types as messages[1] with role "system".
    req = parse(
        system="Top.",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Agent types: claude."},
            {"role": "user", "content": "go"},
        ],
    )
    assert req.messages == [
        {"role": "system", "content": "Top.\n\nAgent types: claude."},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "go"},
    ]


def test_system_blocks_joined_and_billing_header_stripped() -> None:
    system = [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": f"{BILLING}\nWork carefully."},
    ]
    req = parse(system=system)
    assert req.messages[0] == {"role": "system", "content": "You are Claude Code.\n\nWork carefully."}
    assert parse(system="Plain system.").messages[0] == {"role": "system", "content": "Plain system."}
    assert parse(system=[{"type": "text", "text": BILLING}]).messages == [{"role": "user", "content": "hi"}]
    assert req.api == "anthropic_messages" and req.model == "claude-sonnet-4-6"


def test_billing_header_strip_makes_requests_share_a_prefix() -> None:
    a = parse(system=[{"type": "text", "text": BILLING}, {"type": "text", "text": "S"}])
    b = parse(system=[{"type": "text", "text": BILLING.replace("5f3e1", "99999")}, {"type": "text", "text": "S"}])
    assert a.messages == b.messages


def test_multi_turn_with_tools_thinking_and_results() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>r</system-reminder>"},
                {"type": "text", "text": "fix it"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look first", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls", "timeout": 5}},
                {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "/a"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "also check tests"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "a.py",
                    "cache_control": {"type": "ephemeral"},
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "is_error": True,
                    "content": [{"type": "text", "text": "no such file"}],
                },
            ],
        },
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
    ]
    req = parse(messages=messages)
    assert req.messages == [
        {"role": "user", "content": "<system-reminder>r</system-reminder>\n\nfix it"},
        {
            "role": "assistant",
            "content": "Looking.",
            "reasoning_content": "look first",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command":"ls","timeout":5}'},
                },
                {"id": "toolu_2", "type": "function", "function": {"name": "Read", "arguments": '{"file_path":"/a"}'}},
            ],
        },
        # Tool results first (in order), then the user's text.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "[Tool Error] no such file"},
        {"role": "user", "content": "also check tests"},
        {"role": "assistant", "content": "Done."},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]


def test_tool_only_assistant_turn_has_null_content() -> None:
    req = parse(
        messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        ]
    )
    assert req.messages[1]["content"] is None and req.messages[1]["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}],
        [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
        [{"type": "document", "source": {}}],
    ],
)
def test_images_and_documents_are_rejected(content: list[dict[str, Any]]) -> None:
    with pytest.raises(PolarError) as err:
        parse(messages=[{"role": "user", "content": content}])
    assert err.value.status == 400 and "not supported" in err.value.message


def test_tools_server_tools_dropped_and_tool_choice_mapping() -> None:
    web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    req = parse(tools=[BASH, web], tool_choice={"type": "auto"})
    assert req.tools == [
        {
            "type": "function",
            "function": {"name": "Bash", "description": "Run a command", "parameters": BASH["input_schema"]},
        }
    ]
    assert req.tool_choice == "auto"
    assert parse(tools=[BASH], tool_choice={"type": "any"}).tool_choice == "required"
    assert parse(tools=[BASH], tool_choice={"type": "none"}).tool_choice == "none"
    named = parse(tools=[BASH], tool_choice={"type": "tool", "name": "Bash", "disable_parallel_tool_use": True})
    assert named.tool_choice == {"type": "function", "function": {"name": "Bash"}}
    # Claude Code sends tools=[] with a tool_choice on compaction turns; engines reject that.
    assert parse(tools=[], tool_choice={"type": "auto"}).tool_choice is None
    assert (
        parse(tools=[web], tool_choice={"type": "any"}).tools == []
        and parse(tools=[web], tool_choice={"type": "any"}).tool_choice is None
    )


@pytest.mark.parametrize(
    "thinking,expected",
    [
        (None, None),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
    ],
)
def test_thinking_flag(thinking: Any, expected: bool | None) -> None:
    body = {} if thinking is None else {"thinking": thinking}
    assert parse(**body).enable_thinking is expected


def test_sampling_and_stream() -> None:
    req = parse(
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        max_tokens=321,
        stop_sequences=["</done>"],
        stream=True,
        metadata={"user_id": "u"},
    )
    assert req.sampling == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=321, stop=["</done>"])
    assert req.stream is True
    assert parse().stream is False and parse().sampling.temperature is None
    assert parse(max_tokens=1).sampling.max_tokens == 1  # the smallest allowed


def test_count_tokens_body_needs_no_max_tokens() -> None:
    route = PROVIDER.route("POST", "/v1/messages/count_tokens")
    req = PROVIDER.parse_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [BASH]}, route
    )
    assert req.messages == [{"role": "user", "content": "hi"}] and req.sampling.max_tokens is None
    with pytest.raises(PolarError, match="max_tokens"):
        PROVIDER.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, GENERATE)


@pytest.mark.parametrize(
    "patch",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        {"model": ""},
        {"max_tokens": "many"},
        {"max_tokens": 0},
        {"system": 5},
        {"system": [{"type": "image"}]},
        {"temperature": True},
        {"stop_sequences": "END"},
        {"tool_choice": {"type": "sometimes"}},
        {"thinking": {"type": "maybe"}},
        {"tools": [{"input_schema": {}}]},
    ],
)
def test_invalid_requests_are_400(patch: dict[str, Any]) -> None:
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request(body, GENERATE)
    assert err.value.status == 400 and err.value.kind == "invalid_request" and err.value.message


USER_FIRST = {"role": "user", "content": "hi"}
REFUSED_TOOL_CHOICE = "'tool_choice' must be {type: auto|any|none} or {type: tool, name}"
REFUSED_SYSTEM = "'system' must be a string or a list of text blocks"


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"messages": []}, "'messages' is required and must be a non-empty list"),
        ({"messages": "hi"}, "'messages' is required and must be a non-empty list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "'messages' needs at least one user or assistant message"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0]: role must be 'user', 'assistant' or 'system', got 'tool'",
        ),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "messages[0]: content must be a string or a list of content blocks",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0]: unsupported content block type 'video'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0]: image blocks are not supported by this engine (text only)",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0]: text block needs a string 'text'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0]: tool_result block needs a string 'tool_use_id'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
            "messages[0]: content must be a string or a list of content blocks",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}],
                    }
                ]
            },
            "messages[0]: text block needs a string 'text'",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}],
                    }
                ]
            },
            "messages[0] tool_result: document blocks are not supported by this engine (text only)",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": 3}]},
            "messages[1]: content must be a string or a list of content blocks",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": [{"type": "text", "text": 1}]}]},
            "messages[1]: text block needs a string 'text'",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": [{"type": "thinking"}]}]},
            "messages[1]: thinking block needs a string 'thinking'",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
            "messages[1]: tool_use block needs a string 'id'",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
            "messages[1]: tool_use block needs a string 'name'",
        ),
        (
            {
                "messages": [
                    USER_FIRST,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]},
                ]
            },
            "messages[1]: tool_use input must be an object",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": [{"type": "image"}]}]},
            "messages[1]: image blocks are not supported by this engine (text only)",
        ),
        (
            {"messages": [USER_FIRST, {"role": "assistant", "content": [{"type": "video"}]}]},
            "messages[1]: unsupported content block type 'video'",
        ),
        ({"model": ""}, "'model' is required and must be a non-empty string"),
        ({"max_tokens": None}, "'max_tokens' is required"),
        ({"max_tokens": "many"}, "'max_tokens' must be an integer"),
        ({"max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"top_k": True}, "'top_k' must be an integer"),
        ({"temperature": True}, "'temperature' must be a number"),
        ({"system": 5}, REFUSED_SYSTEM),
        ({"system": ["plain"]}, REFUSED_SYSTEM),
        ({"system": [{"type": "image"}]}, REFUSED_SYSTEM),
        ({"system": [{"type": "text", "text": 5}]}, REFUSED_SYSTEM),
        ({"messages": [{"role": "system", "content": 5}, USER_FIRST]}, REFUSED_SYSTEM),
        ({"stop_sequences": "END"}, "'stop_sequences' must be a list of strings"),
        ({"stop_sequences": ["END", 1]}, "'stop_sequences' must be a string or a list of strings"),
        ({"tool_choice": {"type": "sometimes"}}, REFUSED_TOOL_CHOICE),
        ({"tool_choice": {"type": "sometimes", "name": "Bash"}}, REFUSED_TOOL_CHOICE),
        ({"tool_choice": {"type": "tool"}}, REFUSED_TOOL_CHOICE),
        ({"tool_choice": "auto"}, REFUSED_TOOL_CHOICE),
        ({"thinking": {"type": "maybe"}}, "'thinking.type' must be 'enabled', 'adaptive' or 'disabled'"),
        ({"thinking": "enabled"}, "'thinking.type' must be 'enabled', 'adaptive' or 'disabled'"),
        ({"tools": "Bash"}, "'tools' must be a list"),
        ({"tools": ["Bash"]}, "tools[0] must be an object"),
        ({"tools": [{"input_schema": {}}]}, "tools[0]: 'name' is required"),
        # A server tool is skipped, not the end of the list.
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}, {"input_schema": {}}]},
            "tools[1]: 'name' is required",
        ),
    ],
)
def test_invalid_requests_say_what_and_where(patch: dict[str, Any], message: str) -> None:
    body = {"model": "m", "max_tokens": 10, "messages": [USER_FIRST], **patch}
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request({k: v for k, v in body.items() if v is not None}, GENERATE)
    assert (err.value.status, err.value.kind, err.value.message) == (400, "invalid_request", message)


def test_a_tool_use_without_input_has_empty_arguments_and_server_tools_anywhere_are_dropped() -> None:
    req = parse(
        messages=[USER_FIRST, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}],
        tools=[{"type": "web_search_20250305", "name": "web_search"}, BASH],
    )
    assert req.messages[1]["tool_calls"] == [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    assert [t["function"]["name"] for t in req.tools] == ["Bash"]


def test_non_object_body_is_400() -> None:
    with pytest.raises(PolarError):
        PROVIDER.parse_request([1], GENERATE)  # type: ignore[arg-type]


# ---------------------------------------------------------------- render_response


@pytest.mark.parametrize(
    "finish,tools,matched,expected",
    [
        ("stop", False, None, ("end_turn", None)),
        ("stop", False, "</done>", ("stop_sequence", "</done>")),
        ("stop", False, "<|im_end|>", ("end_turn", None)),  # an EOS string is not a requested stop sequence
        ("length", False, None, ("max_tokens", None)),
        ("tool_calls", True, None, ("tool_use", None)),
        ("stop", True, None, ("tool_use", None)),
        ("length", True, None, ("max_tokens", None)),
        ("content_filter", False, None, ("refusal", None)),
        ("abort", False, None, ("max_tokens", None)),
        ("tool_calls", False, None, ("end_turn", None)),  # no call was parsed: a plain end of turn
    ],
)
def test_stop_reason_mapping(finish: str, tools: bool, matched: str | None, expected: tuple[str, str | None]) -> None:
    calls = [ToolCall("call_1", "Bash", '{"command": "ls"}')] if tools else None
    request = parse(stop_sequences=["</done>"])
    message = Message.model_validate(
        PROVIDER.render_response(request, completion(tool_calls=calls, finish_reason=finish, matched_stop=matched), CTX)
    )
    assert (message.stop_reason, message.stop_sequence) == expected


def test_non_stream_render_is_a_valid_message() -> None:
    calls = [ToolCall("call_1", "Bash", '{"command": "ls -la"}'), ToolCall("toolu_2", "Read", '{"file_path": "/a"}')]
    comp = completion(
        content="Checking.",
        reasoning="I should list files.",
        tool_calls=calls,
        finish_reason="tool_calls",
        cached_tokens=4,
    )
    message = Message.model_validate(PROVIDER.render_response(parse(), comp, CTX))
    assert (message.id, message.model, message.role, message.type) == (
        "msg_test1",
        "claude-sonnet-4-6",
        "assistant",
        "message",
    )
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, first, second = message.content
    assert thinking.thinking == "I should list files." and thinking.signature
    assert text.text == "Checking."
    assert (first.id, first.name, first.input) == ("toolu_call_1", "Bash", {"command": "ls -la"})
    assert (second.id, second.input) == ("toolu_2", {"file_path": "/a"})
    usage = message.usage
    assert (
        usage.input_tokens,
        usage.cache_read_input_tokens,
        usage.cache_creation_input_tokens,
        usage.output_tokens,
    ) == (7, 4, 0, 7)


def test_empty_turn_has_no_blocks_and_text_only_has_no_thinking() -> None:
    assert PROVIDER.render_response(parse(), completion(content=""), CTX)["content"] == []
    assert [b["type"] for b in PROVIDER.render_response(parse(), completion(), CTX)["content"]] == ["text"]


def test_tool_input_from_model_arguments() -> None:
    assert tool_input('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    assert tool_input("") == {} and tool_input("  ") == {}
    # Not a JSON object: a parse failure of the model's call, passed on whole.
    assert tool_input('{"a": ') == {"raw": '{"a": '}
    assert tool_input("[1, 2]") == {"raw": "[1, 2]"}


def test_rendered_turn_round_trips_as_history() -> None:
    """What Claude Code sends back after our tool_use turn normalizes to the same assistant message."""
    calls = [ToolCall("call_1", "Bash", '{"command": "ls"}')]
    comp = completion(content="Listing.", reasoning="think", tool_calls=calls, finish_reason="tool_calls")
    rendered = PROVIDER.render_response(parse(), comp, CTX)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": rendered["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": rendered["content"][2]["id"], "content": "a.py"}],
        },
    ]
    req = parse(messages=history)
    assert req.messages[1] == {
        "role": "assistant",
        "content": "Listing.",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "toolu_call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls"}'}}
        ],
    }
    assert req.messages[2] == {"role": "tool", "tool_call_id": "toolu_call_1", "content": "a.py"}


# ---------------------------------------------------------------- streaming through the SDK


STREAM_CASES = {
    "text": completion(content="The quick brown fox jumps over the lazy dog. " * 3),
    "thinking_text": completion(
        content="Answer: 42.", reasoning="Six times seven is forty-two, so the answer is 42.", cached_tokens=3
    ),
    "parallel_tools": completion(
        content="Let me look.",
        reasoning="Two tools at once.",
        tool_calls=[
            ToolCall("call_1", "Bash", '{"command": "ls -la /tmp && cat /etc/hostname", "timeout": 30}'),
            ToolCall("call_2", "Read", '{"file_path": "src/main.py", "limit": 200}'),
        ],
        finish_reason="tool_calls",
    ),
    "tool_only_no_args": completion(
        content=None, tool_calls=[ToolCall("call_9", "Noop", "")], finish_reason="tool_calls"
    ),
    "bad_args": completion(
        content=None, tool_calls=[ToolCall("call_8", "Bash", '{"command": "ls')], finish_reason="tool_calls"
    ),
    "stop_sequence": completion(content="partial answer", matched_stop="</done>"),
    "truncated": completion(content="cut off mid", finish_reason="length"),
    "empty": completion(content=""),
}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_sdk_accumulated_stream_equals_non_stream(name: str) -> None:
    comp = STREAM_CASES[name]
    request = parse(stream=True, stop_sequences=["</done>"])
    expected = Message.model_validate(PROVIDER.render_response(request, comp, CTX)).model_dump()
    assert sdk_stream_final(request, comp) == expected


def _sdk_events(comp: Completion, request: CanonicalRequest) -> list[Any]:
    """The SDK's own parse of our stream: its typed raw events, in order."""
    client = client_for(200, sse_bytes(PROVIDER.render_stream(request, comp, CTX)), "text/event-stream")
    with client.messages.create(
        model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}], stream=True
    ) as s:
        return list(s)


def test_sdk_stream_matches_the_spec_not_just_the_non_stream_render() -> None:
    """Against values written from the completion (11 prompt tokens, 3 of them cached; 7 sampled), not
    against the same translator's non-stream output: message_start already carries the prompt's
    usage (Claude Code sizes its context from it), message_delta the final output count."""
    request = parse(stream=True)
    events = _sdk_events(STREAM_CASES["thinking_text"], request)
    start = events[0]
    assert start.type == "message_start"
    assert (start.message.id, start.message.model, start.message.role) == (
        "msg_test1",
        "claude-sonnet-4-6",
        "assistant",
    )
    assert start.message.content == [] and start.message.stop_reason is None
    usage = start.message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (8, 3, 0)
    assert usage.output_tokens == 0
    delta = events[-2]
    assert delta.type == "message_delta" and delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == 7
    assert events[-1].type == "message_stop"
    thinking = "".join(
        e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert thinking == "Six times seven is forty-two, so the answer is 42." and text == "Answer: 42."

    final = sdk_stream_final(request, STREAM_CASES["parallel_tools"])
    assert [b["type"] for b in final["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert [(b["id"], b["name"], b["input"]) for b in final["content"][2:]] == [
        ("toolu_call_1", "Bash", {"command": "ls -la /tmp && cat /etc/hostname", "timeout": 30}),
        ("toolu_call_2", "Read", {"file_path": "src/main.py", "limit": 200}),
    ]
    assert final["stop_reason"] == "tool_use" and final["stop_sequence"] is None
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == (11, 7)
    cut = sdk_stream_final(parse(stream=True, stop_sequences=["</done>"]), STREAM_CASES["stop_sequence"])
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", "</done>")
    assert sdk_stream_final(request, STREAM_CASES["truncated"])["stop_reason"] == "max_tokens"
    assert sdk_stream_final(request, STREAM_CASES["bad_args"])["content"][0]["input"] == {"raw": '{"command": "ls'}


def test_pings_between_events_are_ignored_by_the_sdk() -> None:
    request = parse(stream=True)
    keep = PROVIDER.keepalive(request, CTX)
    assert keep == b'event: ping\ndata: {"type": "ping"}\n\n'
    comp = STREAM_CASES["parallel_tools"]
    assert sdk_stream_final(request, comp, interleave=keep) == sdk_stream_final(request, comp)


def test_stream_event_sequence() -> None:
    events = list(PROVIDER.render_stream(parse(stream=True), STREAM_CASES["parallel_tools"], CTX))
    assert all(e.event == e.data["type"] for e in events)
    names = [e.event for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0].data["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) == {
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    }
    # Each block opens, streams and closes before the next opens, with consecutive indexes.
    opened = [e.data["index"] for e in events if e.event == "content_block_start"]
    closed = [e.data["index"] for e in events if e.event == "content_block_stop"]
    assert opened == closed == [0, 1, 2, 3]
    # The spec's opening of each block kind: empty thinking and signature, empty text, input {} (filled by deltas).
    assert [e.data for e in events if e.event == "content_block_start"] == [
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_call_1", "name": "Bash", "input": {}},
        },
        {
            "type": "content_block_start",
            "index": 3,
            "content_block": {"type": "tool_use", "id": "toolu_call_2", "name": "Read", "input": {}},
        },
    ]
    deltas = [e.data["delta"]["type"] for e in events if e.event == "content_block_delta" and e.data["index"] == 0]
    assert deltas[-1] == "signature_delta" and set(deltas[:-1]) == {"thinking_delta"}
    json_pieces = [
        e.data["delta"]["partial_json"] for e in events if e.event == "content_block_delta" and e.data["index"] == 2
    ]
    assert len(json_pieces) > 1 and orjson.loads("".join(json_pieces)) == {
        "command": "ls -la /tmp && cat /etc/hostname",
        "timeout": 30,
    }
    assert events[-2].data["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2].data["usage"]["output_tokens"] == 7


# ---------------------------------------------------------------- errors and count_tokens


# kind -> Anthropic error type (docs.anthropic.com "Errors"); written out, not read from the translator.
ANTHROPIC_ERRORS = {
    "invalid_request": "invalid_request_error",
    "request_too_large": "request_too_large",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "context_length_exceeded": "invalid_request_error",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "api_error": "api_error",
    "storage_unavailable": "api_error",
}
assert sorted(ANTHROPIC_ERRORS) == sorted(ERROR_KINDS)


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_every_error_kind_has_its_anthropic_type(kind: str) -> None:
    body = PROVIDER.render_error(PolarError(500, kind, "boom"))
    message = "prompt is too long: boom" if kind == "context_length_exceeded" else "boom"
    assert body == {"type": "error", "error": {"type": ANTHROPIC_ERRORS[kind], "message": message}}
    [event] = PROVIDER.render_stream_error(PolarError(500, kind, "boom"), CTX)
    assert (event.event, event.data) == ("error", body)


def test_an_unknown_error_kind_is_an_api_error() -> None:
    assert PROVIDER.render_error(PolarError(500, "brand_new", "x"))["error"]["type"] == "api_error"


def test_context_length_error_reads_as_prompt_too_long() -> None:
    err = PROVIDER.render_error(PolarError(400, "context_length_exceeded", "40000 tokens > 32768 maximum"))["error"]
    assert err == {"type": "invalid_request_error", "message": "prompt is too long: 40000 tokens > 32768 maximum"}
    same = PROVIDER.render_error(PolarError(400, "context_length_exceeded", "prompt is too long: 5 tokens > 4 maximum"))
    assert same["error"]["message"] == "prompt is too long: 5 tokens > 4 maximum"
    # With the engine's counts, the exact shape Claude Code parses its two numbers from.
    counted = ContextLengthExceeded("engine said so", prompt_tokens=40000, window=32768)
    assert PROVIDER.render_error(counted)["error"]["message"] == "prompt is too long: 40000 tokens > 32768 maximum"


@pytest.mark.parametrize(
    "status,kind,exc",
    [
        (400, "invalid_request", anthropic.BadRequestError),
        (401, "authentication", anthropic.AuthenticationError),
        (404, "not_found", anthropic.NotFoundError),
        (529, "overloaded", anthropic.OverloadedError),
        (500, "api_error", anthropic.InternalServerError),
    ],
)
def test_sdk_reads_error_bodies(status: int, kind: str, exc: type[Exception]) -> None:
    error = PolarError(status, kind, f"{kind} happened")
    client = client_for(status, orjson.dumps(PROVIDER.render_error(error)), "application/json")
    with pytest.raises(exc) as raised:
        client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body == PROVIDER.render_error(error)


def test_sdk_raises_on_stream_error_event() -> None:
    head = list(PROVIDER.render_stream(parse(stream=True), completion(), CTX))[:3]
    error = PolarError(529, "overloaded", "engine unavailable")
    client = client_for(200, sse_bytes(head + list(PROVIDER.render_stream_error(error, CTX))), "text/event-stream")
    with pytest.raises(anthropic.APIStatusError, match="engine unavailable"):
        with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()


def test_count_tokens_through_the_sdk() -> None:
    client = client_for(200, orjson.dumps(PROVIDER.render_count_tokens(1234)), "application/json")
    counted = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens == 1234
