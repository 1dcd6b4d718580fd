"""OpenAI Responses translator: input items, tools, previous_response_id, renders checked by the openai SDK."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseInputItemParam, ResponseStreamEvent
from pydantic import TypeAdapter

from polar_addon.canonical import ContextLengthExceeded, PolarError, ToolCall
from polar_addon.context_compaction import POLAR_COMPACTION_PROMPT, encode_summary, summary_message
from polar_addon.providers import ResponseContext, Route, StreamEvent, all_providers
from polar_addon.providers.openai_responses import PROVIDER, OpenAIResponsesProvider, ResponseHistory, custom_input
from tests.support.providers import canned_http, completion, sse_bytes

GENERATE = Route(kind="generate")
CTX = ResponseContext(response_id="resp_test1", created=1_700_000_000, model="qwen-test")
ERROR_KINDS = [
    "invalid_request",
    "request_too_large",
    "authentication",
    "not_found",
    "previous_response_not_found",
    "context_length_exceeded",
    "overloaded",
    "timeout",
    "api_error",
    "storage_unavailable",
]
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" LF hunk+ "*** End Patch"'},
}
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
# The shape of Codex 0.171's tool list (captured from a real run): a namespace and a hosted tool.
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        }
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


def parse(provider: OpenAIResponsesProvider = PROVIDER, **body: Any):
    body.setdefault("model", "qwen-test")
    body.setdefault("input", "hi")
    return provider.parse_request(body, GENERATE)


def client_for(status: int, body: bytes, content_type: str) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="x", base_url="http://polar.test/v1", http_client=canned_http(status, body, content_type), max_retries=0
    )


def sdk_final(body: bytes, tools: list[dict[str, Any]] | None = None) -> Response:
    """The openai SDK stream helper's final response for our SSE bytes."""
    client = client_for(200, body, "text/event-stream")
    with client.responses.stream(model="qwen-test", input="hi", tools=tools or []) as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


def raw_events(body: bytes) -> list[Any]:
    client = client_for(200, body, "text/event-stream")
    return list(client.responses.create(model="qwen-test", input="hi", stream=True))


def plain(response: Response) -> dict[str, Any]:
    # ParsedResponse adds parse results (None for unstructured text) that a plain Response has not.
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return Response.model_validate(strip(response.model_dump())).model_dump()


# ---------------------------------------------------------------- routes


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/v1/responses", "generate"),
        ("POST", "/openai/v1/responses?api-version=1", "generate"),
        ("post", "/responses", "generate"),
        ("POST", "/v1/responses/input_tokens", "count_tokens"),
        ("GET", "/v1/responses", None),  # Codex's WebSocket upgrade: handled by the WebSocket bridge
        ("POST", "/v1/responses/compact", "compact"),  # Codex remote compaction (v1)
        ("POST", "/v1/chat/completions", None),
    ],
)
def test_route(method: str, path: str, expected: str | None) -> None:
    route = PROVIDER.route(method, path)
    assert (route.kind if route else None) == expected


def test_registered_after_chat_and_messages() -> None:
    names = [p.name for p in all_providers()]
    assert names.index("openai_responses") > names.index("openai_chat")
    # No other provider claims a Responses path.
    assert [p.name for p in all_providers() if p.route("POST", "/v1/responses")] == ["openai_responses"]


# ---------------------------------------------------------------- input items


def test_string_input_and_instructions() -> None:
    req = parse(input="list files", instructions="You are a coder.")
    assert req.messages == [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "list files"},
    ]
    assert req.api == "openai_responses" and req.model == "qwen-test"


def test_instructions_and_developer_messages_form_one_system_message() -> None:
    req = parse(
        instructions="Base rules.",
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [
                    {"type": "input_text", "text": "Sandbox: read-only."},
                    {"type": "input_text", "text": "Skills: none."},
                ],
            },
            {"role": "user", "content": "hi"},  # EasyInputMessage: no type
            {"type": "message", "role": "system", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
        ],
    )
    assert req.messages == [
        {"role": "system", "content": "Base rules.\n\nSandbox: read-only.\n\nSkills: none.\n\nBe brief."},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "a\nb"},
    ]


def test_function_calls_and_outputs_grouped_into_assistant_tool_calls() -> None:
    req = parse(
        input=[
            {"type": "message", "role": "user", "content": "list then read"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "short"}],
                "content": [{"type": "reasoning_text", "text": "use ls then cat"}],
                "encrypted_content": None,
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {
                "type": "function_call",
                "id": "fc_1",
                "status": "completed",
                "call_id": "call_a",
                "name": "exec_command",
                "arguments": '{"cmd":"ls"}',
            },
            {"type": "function_call", "call_id": "call_b", "name": "read", "arguments": {"path": "x"}},
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_a", "output": "a.txt"},
            {
                "type": "function_call_output",
                "call_id": "call_b",
                "output": [{"type": "input_text", "text": "X"}, {"type": "input_text", "text": "Y"}],
            },
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "done"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        ]
    )
    assert req.messages == [
        {"role": "user", "content": "list then read"},
        {
            "role": "assistant",
            "content": "Looking.",
            # The raw reasoning wins over its summary; only the summary is there in the second turn.
            "reasoning_content": "use ls then cat",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": '{"path":"x"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_b", "content": "X\nY"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "done"},
    ]


def test_custom_tool_calls_are_single_string_function_calls() -> None:
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    req = parse(
        tools=[APPLY_PATCH],
        input=[
            {"type": "message", "role": "user", "content": "add a.txt"},
            {
                "type": "custom_tool_call",
                "id": "ctc_1",
                "status": "completed",
                "call_id": "call_p",
                "name": "apply_patch",
                "input": patch,
            },
            {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"},
        ],
    )
    assert req.messages[1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_p",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": orjson.dumps({"input": patch}).decode()},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_p", "content": "Done!"},
    ]
    (tool,) = req.tools
    fn = tool["function"]
    assert fn["name"] == "apply_patch" and fn["description"] == "Edit files with a patch."
    assert fn["parameters"]["required"] == ["input"] and fn["parameters"]["properties"]["input"]["type"] == "string"
    # The grammar tells the model what to write.
    assert APPLY_PATCH["format"]["definition"] in fn["parameters"]["properties"]["input"]["description"]
    assert req.extra["custom_tools"] == ["apply_patch"]


def test_codex_tool_list_namespace_flattened_hosted_tools_dropped() -> None:
    req = parse(tools=[EXEC, NAMESPACE, WEB_SEARCH], tool_choice="auto", parallel_tool_calls=True)
    assert [t["function"]["name"] for t in req.tools] == ["exec_command", "multi_agent_v1.close_agent"]
    assert req.tools[0] == {
        "type": "function",
        "function": {"name": "exec_command", "description": "Runs a command.", "parameters": EXEC["parameters"]},
    }
    assert req.extra["namespaced_tools"] == {"multi_agent_v1.close_agent": "multi_agent_v1"}
    assert req.extra["dropped_tools"] == ["web_search"] and req.tool_choice == "auto"
    # A namespaced call in the history reads back under the same flat name.
    hist = parse(
        tools=[NAMESPACE],
        input=[
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "close_agent",
                "namespace": "multi_agent_v1",
                "arguments": "{}",
            }
        ],
    )
    assert hist.messages[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("required", "required"),
        ({"type": "function", "name": "exec_command"}, {"type": "function", "function": {"name": "exec_command"}}),
        ({"type": "custom", "name": "apply_patch"}, {"type": "function", "function": {"name": "apply_patch"}}),
        ({"type": "allowed_tools", "mode": "required", "tools": []}, "required"),
        ("none", "none"),
    ],
)
def test_tool_choice(raw: Any, expected: Any) -> None:
    assert parse(tools=[EXEC, APPLY_PATCH], tool_choice=raw).tool_choice == expected


def test_tool_choice_dropped_without_tools() -> None:
    assert parse(tool_choice="auto").tool_choice is None
    assert parse(tools=[WEB_SEARCH], tool_choice="auto").tool_choice is None


def test_sampling_reasoning_and_extras() -> None:
    req = parse(
        temperature=0.7,
        top_p=0.9,
        max_output_tokens=64,
        stream=True,
        store=False,
        reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"],
    )
    s = req.sampling
    assert (s.temperature, s.top_p, s.max_tokens) == (0.7, 0.9, 64)
    assert req.stream is True and req.enable_thinking is True
    assert req.extra == {
        "store": False,
        "parallel_tool_calls": True,
        "reasoning_summary": "auto",
        "reasoning_effort": "low",
    }
    assert parse(reasoning={"effort": "none"}).enable_thinking is False
    assert parse(reasoning={"summary": "auto"}).enable_thinking is None
    assert parse().extra == {"store": True, "parallel_tool_calls": True, "reasoning_summary": None}


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"input": "hi"},
        {"model": "m"},
        {"model": "m", "input": 5},
        {"model": "m", "input": [5]},
        {"model": "m", "input": [{"type": "message", "role": "wizard", "content": "x"}]},
        {
            "model": "m",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}],
        },
        {"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": "output_text"}]}]},
        {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
        {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": {}}]},
        {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
        {"model": "m", "input": [{"type": "local_shell_call", "action": {"type": "exec"}}]},
        {"model": "m", "input": [{"type": "additional_tools", "role": "developer", "tools": {"type": "function"}}]},
        {"model": "m", "input": [{"type": "teleport_call", "call_id": "c"}]},
        {"model": "m", "input": "hi", "tools": [{"type": "function"}]},
        {"model": "m", "input": "hi", "tools": [{"type": "teleport", "name": "x"}]},
        {"model": "m", "input": "hi", "tools": {"type": "function", "name": "f"}},
        {"model": "m", "input": "hi", "tool_choice": "sometimes"},
        {"model": "m", "input": "hi", "temperature": "hot"},
        {"model": "m", "input": "hi", "max_output_tokens": 0},
        {"model": "m", "input": "hi", "stream": "yes"},
        {"model": "m", "input": "hi", "previous_response_id": 7},
        {"model": "m", "input": "hi", "instructions": [{"role": "user", "content": "x"}]},
    ],
)
def test_invalid_requests_are_400(body: Any) -> None:
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request(body, GENERATE)
    assert err.value.status == 400 and err.value.kind == "invalid_request" and err.value.message


def test_every_input_item_codex_sends_is_accepted() -> None:
    """Codex 0.171's item types (its ResponseItem enum): with its default model the tool list comes as an
    ``additional_tools`` item, not in ``tools``; that used to be a 400 for every `codex exec` without -m."""
    ns = {
        "type": "namespace",
        "name": "functions",
        "description": "",
        "tools": [
            {
                "type": "custom",
                "name": "exec",
                "description": "run JS",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {
                "type": "function",
                "name": "wait",
                "description": "wait",
                "strict": False,
                "parameters": {"type": "object", "properties": {}},
            },
        ],
    }
    loaded = {
        "type": "function",
        "name": "calendar_create",
        "description": "make an event",
        "parameters": {"type": "object", "properties": {}},
    }
    request = parse(
        OpenAIResponsesProvider(),
        tools=[EXEC],
        input=[
            {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [ns]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "plan my day"}]},
            {
                "type": "tool_search_call",
                "call_id": "ts_1",
                "execution": "client",
                "status": "completed",
                "arguments": {"query": "calendar"},
            },
            {
                "type": "tool_search_output",
                "call_id": "ts_1",
                "execution": "client",
                "status": "completed",
                "tools": [loaded],
            },
            {
                "type": "local_shell_call",
                "call_id": "ls_1",
                "status": "completed",
                "action": {"type": "exec", "command": ["ls"]},
            },
            {"type": "function_call_output", "call_id": "ls_1", "output": "a.txt"},
            {
                "type": "web_search_call",
                "id": "ws_1",
                "status": "completed",
                "action": {"type": "search", "query": "x"},
            },
            {"type": "compaction", "encrypted_content": "gAAA"},
            {"type": "agent_message", "content": [{"type": "input_text", "text": "subagent: done"}]},
        ],
    )
    names = [t["function"]["name"] for t in request.tools]
    assert names == ["exec_command", "functions.exec", "functions.wait", "calendar_create"]
    assert request.extra["custom_tools"] == ["functions.exec"]
    assert request.extra["namespaced_tools"]["functions.wait"] == "functions"
    assert request.extra["dropped_items"] == ["web_search_call", "compaction"]
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    roles = [m["role"] for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "user"]
    search_call, shell_call = request.messages[2]["tool_calls"][0], request.messages[4]["tool_calls"][0]
    assert search_call["function"] == {"name": "tool_search", "arguments": '{"query":"calendar"}'}
    assert request.messages[3] == {"role": "tool", "tool_call_id": "ts_1", "content": '["calendar_create"]'}
    assert shell_call["function"]["name"] == "local_shell" and '"command":["ls"]' in shell_call["function"]["arguments"]
    assert request.messages[-1] == {"role": "user", "content": "subagent: done"}


# ---------------------------------------------------------------- previous_response_id


def test_previous_response_id_prepends_the_remembered_history() -> None:
    provider = OpenAIResponsesProvider()
    first = parse(
        provider,
        instructions="rules",
        input=[{"role": "developer", "content": "dev"}, {"role": "user", "content": "ls"}],
        tools=[EXEC],
    )
    call = ToolCall("call_1", "exec_command", '{"cmd":"ls"}')
    ctx1 = ResponseContext("resp_one", 1, "qwen-test")
    list(
        provider.render_stream(
            first, completion(content=None, reasoning="think", tool_calls=[call], finish_reason="tool_calls"), ctx1
        )
    )
    # Codex over its WebSocket: only the new items, pointing at the previous response.
    second = parse(
        provider,
        instructions="rules",
        previous_response_id="resp_one",
        tools=[EXEC],
        input=[{"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}],
    )
    assert second.messages == [
        {"role": "system", "content": "rules\n\ndev"},
        {"role": "user", "content": "ls"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]
    assert second.extra["previous_response_id"] == "resp_one"
    # Chains continue: the second response remembers the whole history, the non-stream render too.
    provider.render_response(second, completion(content="a.txt is there"), ResponseContext("resp_two", 2, "qwen-test"))
    third = parse(provider, previous_response_id="resp_two", input="thanks")
    assert [m["role"] for m in third.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert third.messages[0] == {"role": "system", "content": "dev"}  # instructions are per request
    assert third.messages[-2] == {"role": "assistant", "content": "a.txt is there"}


def test_unknown_previous_response_id() -> None:
    with pytest.raises(PolarError) as err:
        parse(OpenAIResponsesProvider(), previous_response_id="resp_gone", input="x")
    assert (err.value.status, err.value.kind) == (400, "previous_response_not_found")
    body = PROVIDER.render_error(err.value)["error"]
    assert (body["code"], body["param"]) == ("previous_response_not_found", "previous_response_id")


def test_history_is_bounded_and_parsed_inputs_are_not_kept() -> None:
    provider = OpenAIResponsesProvider(history_size=2)
    for i in range(3):
        provider.render_response(parse(provider, input=f"q{i}"), completion(), ResponseContext(f"resp_{i}", i, "m"))
    assert provider.history.get("resp_0") is None and provider.history.get("resp_2") is not None
    import gc

    gc.collect()
    assert provider._inputs == {}  # stashed items leave with their request


# ---------------------------------------------------------------- render_response


def test_non_stream_render_is_a_valid_response() -> None:
    calls = [
        ToolCall("call_1", "exec_command", '{"cmd": "ls"}'),
        ToolCall("call_2", "apply_patch", '{"input": "*** Begin Patch"}'),
        ToolCall("call_3", "multi_agent_v1.close_agent", '{"target": "a"}'),
    ]
    request = parse(
        tools=[EXEC, APPLY_PATCH, NAMESPACE], reasoning={"summary": "auto"}, max_output_tokens=100, temperature=0.5
    )
    body = PROVIDER.render_response(
        request, completion(content="On it.", reasoning="plan", tool_calls=calls, cached_tokens=4), CTX
    )
    parsed = Response.model_validate(body)
    assert (parsed.id, parsed.created_at, parsed.model, parsed.status) == (
        "resp_test1",
        1_700_000_000,
        "qwen-test",
        "completed",
    )
    assert (parsed.max_output_tokens, parsed.temperature) == (100, 0.5)
    assert [o.type for o in parsed.output] == [
        "reasoning",
        "message",
        "function_call",
        "custom_tool_call",
        "function_call",
    ]
    reasoning, message, fn, custom, namespaced = parsed.output
    assert reasoning.content[0].text == "plan" and reasoning.summary[0].text == "plan"
    assert message.content[0].text == "On it." and parsed.output_text == "On it."
    assert (fn.call_id, fn.name, fn.arguments) == ("call_1", "exec_command", '{"cmd": "ls"}')
    assert (custom.call_id, custom.name, custom.input) == ("call_2", "apply_patch", "*** Begin Patch")
    assert (namespaced.name, namespaced.namespace, namespaced.arguments) == (
        "close_agent",
        "multi_agent_v1",
        '{"target": "a"}',
    )
    assert len({o.id for o in parsed.output}) == 5
    u = parsed.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens, u.input_tokens_details.cached_tokens) == (11, 7, 18, 4)


def test_summary_only_when_asked_and_truncation_is_incomplete() -> None:
    body = PROVIDER.render_response(parse(), completion(reasoning="r", finish_reason="length"), CTX)
    assert body["output"][0]["summary"] == [] and body["output"][0]["content"] == [
        {"type": "reasoning_text", "text": "r"}
    ]
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][1]["status"] == "incomplete"


def test_tool_only_turn_has_no_message_and_empty_turn_has_an_empty_one() -> None:
    only = PROVIDER.render_response(
        parse(tools=[EXEC]), completion(content=None, tool_calls=[ToolCall("c", "exec_command", "{}")]), CTX
    )
    assert [o["type"] for o in only["output"]] == ["function_call"]
    empty = PROVIDER.render_response(parse(), completion(content=None), CTX)
    assert empty["output"][0]["content"][0]["text"] == ""


@pytest.mark.parametrize(
    "arguments,expected",
    [
        ('{"input": "patch text"}', "patch text"),
        ('{"patch": "patch text"}', "patch text"),
        ("*** Begin Patch", "*** Begin Patch"),
        ('{"input": 5}', '{"input": 5}'),
        ('["a"]', '["a"]'),
    ],
)
def test_custom_input(arguments: str, expected: str) -> None:
    assert custom_input(arguments) == expected


# ---------------------------------------------------------------- streaming through the SDK


STREAM_CASES = {
    "text": completion(content="The quick brown fox jumps over the lazy dog. " * 3),
    "reasoning_text": completion(content="Answer: 42.", reasoning="Six times seven is forty-two, so the answer is 42."),
    "tools": completion(
        content="Let me look.",
        tool_calls=[
            ToolCall("call_1", "exec_command", '{"cmd": "ls -la /tmp && cat /etc/hostname"}'),
            ToolCall("call_2", "apply_patch", '{"input": "*** Begin Patch\\n*** Add File: a\\n+x\\n*** End Patch"}'),
            ToolCall("call_3", "multi_agent_v1.close_agent", '{"target": "agent-1"}'),
        ],
        finish_reason="tool_calls",
        cached_tokens=8,
    ),
    "tool_only": completion(
        content=None, tool_calls=[ToolCall("call_9", "exec_command", "")], finish_reason="tool_calls"
    ),
    "truncated": completion(content="", reasoning="thinking for a long", finish_reason="length"),
}
STREAM_REQUEST = {"tools": [EXEC, APPLY_PATCH, NAMESPACE], "reasoning": {"summary": "auto"}, "stream": True}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_sdk_stream_final_equals_non_stream(name: str) -> None:
    comp = STREAM_CASES[name]
    request = parse(**STREAM_REQUEST)
    expected = Response.model_validate(PROVIDER.render_response(request, comp, CTX)).model_dump()
    assert plain(sdk_final(sse_bytes(PROVIDER.render_stream(request, comp, CTX)))) == expected


def _sdk_stream_final(name: str) -> dict[str, Any]:
    request = parse(**STREAM_REQUEST)
    return plain(sdk_final(sse_bytes(PROVIDER.render_stream(request, STREAM_CASES[name], CTX))))


def _items(response: dict[str, Any]) -> list[dict[str, Any]]:
    keep = ("type", "status", "call_id", "name", "namespace", "arguments", "input", "role")
    out = []
    for item in response["output"]:
        row = {k: item[k] for k in keep if item.get(k) is not None}
        if item["type"] == "message":
            row["text"] = [c["text"] for c in item["content"]]
        if item["type"] == "reasoning":
            row["summary"] = [s["text"] for s in item["summary"]]
        out.append(row)
    return out


def test_sdk_stream_parse_carries_the_completion() -> None:
    """The SDK's own parse of our stream against values written from the completions and the API's
    item types (not against our non-stream render): Codex reads exactly these fields."""
    tools = _sdk_stream_final("tools")
    assert (tools["id"], tools["status"], tools["incomplete_details"]) == ("resp_test1", "completed", None)
    assert _items(tools) == [
        {"type": "message", "status": "completed", "role": "assistant", "text": ["Let me look."]},
        {
            "type": "function_call",
            "status": "completed",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd": "ls -la /tmp && cat /etc/hostname"}',
        },
        {
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "call_2",
            "name": "apply_patch",
            "input": "*** Begin Patch\n*** Add File: a\n+x\n*** End Patch",
        },
        {
            "type": "function_call",
            "status": "completed",
            "call_id": "call_3",
            "name": "close_agent",
            "namespace": "multi_agent_v1",
            "arguments": '{"target": "agent-1"}',
        },
    ]
    usage = tools["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (11, 7, 18)
    assert usage["input_tokens_details"]["cached_tokens"] == 8

    thought = _sdk_stream_final("reasoning_text")
    assert _items(thought) == [
        {"type": "reasoning", "summary": ["Six times seven is forty-two, so the answer is 42."]},
        {"type": "message", "status": "completed", "role": "assistant", "text": ["Answer: 42."]},
    ]
    cut = _sdk_stream_final("truncated")
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert _items(cut)[-1] == {"type": "message", "status": "incomplete", "role": "assistant", "text": [""]}
    [only] = _items(_sdk_stream_final("tool_only"))
    assert (only["type"], only["call_id"], only["name"]) == ("function_call", "call_9", "exec_command")


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_stream_events_are_typed_numbered_and_rebuild_every_item(name: str) -> None:
    comp = STREAM_CASES[name]
    request = parse(**STREAM_REQUEST)
    events = raw_events(sse_bytes(PROVIDER.render_stream(request, comp, CTX)))
    # Every event is one the SDK knows (an unknown type would come back as a bare BaseModel).
    assert all(type(e).__name__.startswith("Response") for e in events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[-1].response.id == "resp_test1"
    final = events[-1].response.output
    # Each item's deltas rebuild exactly the item output_item.done carries, under one item id.
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.model_dump() for d in done] == [o.model_dump() for o in final]
    for index, item in enumerate(done):
        own = [e for e in events if getattr(e, "output_index", None) == index]
        assert own[0].type == "response.output_item.added" and own[-1].type == "response.output_item.done"
        assert all(getattr(e, "item_id", item.id) == item.id for e in own)
        deltas = {}
        for e in own:
            if e.type.endswith(".delta"):
                deltas.setdefault(e.type, []).append(e.delta)
        if item.type == "message":
            assert "".join(deltas.get("response.output_text.delta", [])) == item.content[0].text
        elif item.type == "function_call":
            assert "".join(deltas.get("response.function_call_arguments.delta", [])) == item.arguments
        elif item.type == "custom_tool_call":
            assert "".join(deltas["response.custom_tool_call_input.delta"]) == item.input
        else:
            assert "".join(deltas["response.reasoning_text.delta"]) == item.content[0].text
            assert "".join(deltas["response.reasoning_summary_text.delta"]) == item.summary[0].text
            kinds = [e.type for e in own]
            assert kinds.index("response.reasoning_summary_part.added") < kinds.index(
                "response.reasoning_summary_part.done"
            )


def test_codex_reads_what_it_needs() -> None:
    """Codex (codex-rs/codex-api/src/sse/responses.rs) takes items only from output_item.done, needs
    response.id on response.completed and all three usage counts."""
    request = parse(**STREAM_REQUEST)
    events = [e.data for e in PROVIDER.render_stream(request, STREAM_CASES["tools"], CTX)]
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in items] == ["message", "function_call", "custom_tool_call", "function_call"]
    assert all(isinstance(i["arguments"], str) for i in items if i["type"] == "function_call")
    assert items[2]["input"].startswith("*** Begin Patch\n") and items[3]["namespace"] == "multi_agent_v1"
    completed = events[-1]["response"]
    assert completed["id"] == "resp_test1"
    assert {"input_tokens", "output_tokens", "total_tokens"} <= set(completed["usage"])


def test_deterministic_render() -> None:
    request = parse(**STREAM_REQUEST)
    comp = STREAM_CASES["tools"]
    assert [e.data for e in PROVIDER.render_stream(request, comp, CTX)] == [
        e.data for e in PROVIDER.render_stream(request, comp, CTX)
    ]


# ---------------------------------------------------------------- keep-alive


def test_stream_keepalive_sends_the_prelude_then_in_progress_and_numbering_continues() -> None:
    provider = OpenAIResponsesProvider()
    request = parse(provider, **STREAM_REQUEST)
    comp = STREAM_CASES["reasoning_text"]
    ctx = ResponseContext("resp_slow", 5, "qwen-test")
    keep = b"".join(provider.keepalive(request, ctx) for _ in range(3))
    body = keep + sse_bytes(provider.render_stream(request, comp, ctx))
    events = raw_events(body)
    assert [e.type for e in events[:5]] == [
        "response.created",
        "response.in_progress",
        "response.in_progress",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert sum(e.type == "response.created" for e in events) == 1
    # The SDK's stream helper accepts it, with the same final response as without keep-alives.
    provider2 = OpenAIResponsesProvider()
    request2 = parse(provider2, **STREAM_REQUEST)
    fresh = ResponseContext("resp_slow", 5, "qwen-test")
    assert plain(sdk_final(body)) == plain(sdk_final(sse_bytes(provider2.render_stream(request2, comp, fresh))))


# ---------------------------------------------------------------- errors


# kind -> (type, code); Codex reads the code (context_length_exceeded: compact; anything else: retry).
RESPONSES_ERRORS = {
    "invalid_request": ("invalid_request_error", None),
    "request_too_large": ("invalid_request_error", None),
    "authentication": ("authentication_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "previous_response_not_found": ("invalid_request_error", "previous_response_not_found"),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("server_error", "server_is_overloaded"),
    "timeout": ("server_error", "timeout"),
    "api_error": ("server_error", "server_error"),
    "storage_unavailable": ("server_error", "storage_unavailable"),
}
assert sorted(RESPONSES_ERRORS) == sorted(ERROR_KINDS)


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_every_error_kind_has_its_openai_type_and_code(kind: str) -> None:
    err = PROVIDER.render_error(PolarError(500, kind, "boom"))["error"]
    kind_type, code = RESPONSES_ERRORS[kind]
    param = "previous_response_id" if kind == "previous_response_not_found" else None
    assert err == {"message": "boom", "type": kind_type, "param": param, "code": code}
    # Streamed, the failure is a response.failed event carrying the same code.
    *_, failed = PROVIDER.render_stream_error(PolarError(500, kind, "boom"), CTX)
    assert failed.data["type"] == "response.failed"
    assert failed.data["response"]["status"] == "failed"
    assert failed.data["response"]["error"] == {"code": code, "message": "boom"}


def test_an_unknown_error_kind_is_a_server_error() -> None:
    err = PROVIDER.render_error(PolarError(500, "brand_new", "x"))["error"]
    assert (err["type"], err["code"]) == ("server_error", "server_error")


@pytest.mark.parametrize(
    "status,kind,exc",
    [
        (400, "context_length_exceeded", openai.BadRequestError),
        (400, "previous_response_not_found", openai.BadRequestError),
        (401, "authentication", openai.AuthenticationError),
        (503, "overloaded", openai.InternalServerError),
    ],
)
def test_sdk_reads_error_bodies(status: int, kind: str, exc: type[Exception]) -> None:
    error = PolarError(status, kind, f"{kind} happened")
    client = client_for(status, orjson.dumps(PROVIDER.render_error(error)), "application/json")
    with pytest.raises(exc) as raised:
        client.responses.create(model="qwen-test", input="hi")
    assert raised.value.body == PROVIDER.render_error(error)["error"] and raised.value.code == raised.value.body["code"]


@pytest.mark.parametrize("after_keepalive", [False, True])
def test_stream_error_is_response_failed_with_a_code_codex_understands(after_keepalive: bool) -> None:
    provider = OpenAIResponsesProvider()
    request = parse(provider, stream=True)
    ctx = ResponseContext("resp_fail", 5, "qwen-test")
    prefix = provider.keepalive(request, ctx) if after_keepalive else b""
    error = PolarError(400, "context_length_exceeded", "prompt of 9000 tokens exceeds the limit of 4096")
    events = raw_events(sse_bytes(provider.render_stream_error(error, ctx), prefix))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert [e.sequence_number for e in events] == [0, 1, 2]
    failed = events[-1].response
    assert failed.status == "failed" and failed.id == "resp_fail"
    assert (failed.error.code, failed.error.message) == ("context_length_exceeded", error.message)


def test_count_tokens() -> None:
    assert PROVIDER.render_count_tokens(12) == {"object": "response.input_tokens", "input_tokens": 12}
    req = PROVIDER.parse_request({"model": "m", "input": "hi"}, Route(kind="count_tokens"))
    assert req.messages == [{"role": "user", "content": "hi"}]


def test_stream_events_are_stream_events() -> None:
    assert all(
        isinstance(e, StreamEvent) and e.event == e.data["type"]
        for e in PROVIDER.render_stream(parse(stream=True), completion(), CTX)
    )


def test_parse_does_not_mutate_the_body() -> None:
    body = {
        "model": "m",
        "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}],
        "tools": [NAMESPACE, APPLY_PATCH],
    }
    before = copy.deepcopy(body)
    PROVIDER.parse_request(body, GENERATE)
    assert body == before


# ---------------------------------------------------------------- exact messages and details


@pytest.mark.parametrize(
    "body,message",
    [
        ({"input": "hi"}, "'model' is required and must be a non-empty string"),
        ({"model": "m"}, "'input' is required and must be a string or a list of items"),
        ({"model": "m", "input": 5}, "'input' is required and must be a string or a list of items"),
        ({"model": "m", "input": [5]}, "input[0] must be an object"),
        (
            {"model": "m", "input": [{"type": "message", "role": "wizard", "content": "x"}]},
            "input[0]: unsupported role 'wizard'",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0]: input_image parts are not supported by this engine (text only)",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0]: input_file parts are not supported by this engine (text only)",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input[0]: input_audio parts are not supported by this engine (text only)",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
            "input[0]: unsupported content part type 'output_text'",
        ),
        (
            {"model": "m", "input": [{"role": "system", "content": [{"type": "output_text", "text": "x"}]}]},
            "input[0]: unsupported content part type 'output_text'",
        ),
        (
            {"model": "m", "input": [{"role": "assistant", "content": [{"type": "reasoning_text", "text": "x"}]}]},
            "input[0]: unsupported content part type 'reasoning_text'",
        ),
        (
            {"model": "m", "input": [{"type": "reasoning", "summary": [{"text": 1}]}]},
            "input[0]: reasoning summary parts need a string 'text'",
        ),
        (
            {"model": "m", "input": [{"type": "reasoning", "summary": ["x"]}]},
            "input[0]: reasoning summary parts need a string 'text'",
        ),
        (
            {"model": "m", "input": [{"type": "reasoning", "content": {"type": "reasoning_text", "text": "x"}}]},
            "input[0]: reasoning 'content' must be a list",
        ),
        (
            {"model": "m", "input": [{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}]},
            "input[0]: unsupported reasoning part type 'output_text'",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0]: 'function_call' needs a string 'call_id'",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "call_id": "", "name": "f"}]},
            "input[0]: 'function_call' needs a string 'call_id'",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": ""}]},
            "input[0]: 'function_call' needs a string 'name'",
        ),
        (
            {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
            "input[0]: 'function_call_output' needs a string 'call_id'",
        ),
        (
            {
                "model": "m",
                "input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}],
            },
            "input[0]: input_image parts are not supported by this engine (text only)",
        ),
        (
            {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": {}}]},
            "input[0]: custom_tool_call 'input' must be a string",
        ),
        (
            {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
            "input[0]: item_reference needs server-side item storage, which polar does not keep; send the item itself",
        ),
        (
            {"model": "m", "input": [{"type": "local_shell_call", "action": {}}]},
            "input[0]: 'local_shell_call' needs a string 'call_id'",
        ),
        (
            {"model": "m", "input": [{"type": "additional_tools", "tools": {}}]},
            "input[0]: additional_tools needs a list 'tools'",
        ),
        ({"model": "m", "input": [{"type": "teleport_call"}]}, "input[0]: unsupported input item type 'teleport_call'"),
        ({"model": "m", "input": [{"content": "no type no role"}]}, "input[0]: unsupported input item type None"),
        ({"model": "m", "input": "hi", "tools": [{"type": "function"}]}, "tools[0]: 'function' needs a string 'name'"),
        ({"model": "m", "input": "hi", "tools": [5]}, "tools[0] must be an object"),
        ({"model": "m", "input": "hi", "tools": [{"type": 5}]}, "tools[0]: 'type' must be a string"),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": [1]}]},
            "tools[0]: 'parameters' must be an object",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": {}}]},
            "tools[0]: namespace tools need a list 'tools'",
        ),
        (
            {
                "model": "m",
                "input": "hi",
                "tools": [
                    {"type": "namespace", "name": "n", "tools": [{"type": "namespace", "name": "m", "tools": []}]}
                ],
            },
            "tools[0].tools[0]: unsupported tool type 'namespace'",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "teleport", "name": "x"}]},
            "tools[0]: unsupported tool type 'teleport'",
        ),
        ({"model": "m", "input": "hi", "tools": {"type": "function", "name": "f"}}, "'tools' must be a list"),
        (
            {"model": "m", "input": "hi", "tool_choice": "sometimes"},
            "'tool_choice' must be 'auto', 'none', 'required', {type: function|custom, name} "
            "or {type: allowed_tools, mode}",
        ),
        (
            {"model": "m", "input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "none"}},
            "'tool_choice' must be 'auto', 'none', 'required', {type: function|custom, name} "
            "or {type: allowed_tools, mode}",
        ),
        ({"model": "m", "input": "hi", "temperature": "hot"}, "'temperature' must be a number"),
        ({"model": "m", "input": "hi", "top_p": True}, "'top_p' must be a number"),
        ({"model": "m", "input": "hi", "max_output_tokens": 0}, "'max_output_tokens' must be >= 1"),
        ({"model": "m", "input": "hi", "max_output_tokens": 2147483648}, "'max_output_tokens' must be <= 2147483647"),
        ({"model": "m", "input": "hi", "stream": "yes"}, "'stream' must be a boolean"),
        ({"model": "m", "input": "hi", "previous_response_id": 7}, "'previous_response_id' must be a string"),
        (
            {"model": "m", "input": "hi", "instructions": [{"role": "user", "content": "x"}]},
            "'instructions' may hold only system or developer messages",
        ),
        ({"model": "m", "input": "hi", "instructions": 5}, "'instructions' must be a string or a list of messages"),
        ({"model": "m", "input": "hi", "reasoning": "high"}, "'reasoning' must be an object"),
    ],
)
def test_invalid_requests_say_what_and_where(body: dict[str, Any], message: str) -> None:
    with pytest.raises(PolarError) as err:
        OpenAIResponsesProvider().parse_request(body, GENERATE)
    assert (err.value.status, err.value.kind, err.value.message) == (400, "invalid_request", message)


def test_a_body_that_is_not_an_object_and_an_unknown_previous_response_are_named() -> None:
    with pytest.raises(PolarError) as err:
        PROVIDER.parse_request([{"model": "m", "input": "hi"}], GENERATE)  # type: ignore[arg-type]
    assert (err.value.status, err.value.kind, err.value.message) == (
        400,
        "invalid_request",
        "request body must be a JSON object",
    )
    with pytest.raises(PolarError) as err:
        parse(OpenAIResponsesProvider(), previous_response_id="resp_x")
    assert (err.value.status, err.value.kind, err.value.message) == (
        400,
        "previous_response_not_found",
        "Previous response with id 'resp_x' not found.",
    )


def test_the_response_object_echoes_the_request_settings() -> None:
    """Every field of the Response object as the API reference lists it, written by hand."""
    provider = OpenAIResponsesProvider()
    first = parse(provider)
    provider.render_response(first, completion(), ResponseContext("resp_prev", 1, "qwen-test"))
    request = parse(
        provider,
        previous_response_id="resp_prev",
        tools=[EXEC],
        tool_choice={"type": "function", "name": "exec_command"},
        parallel_tool_calls=False,
        store=False,
        temperature=0.5,
        top_p=0.25,
        max_output_tokens=9,
        reasoning={"effort": "high", "generate_summary": "concise"},
    )
    body = provider.render_response(request, completion(content="ok"), CTX)
    assert body == {
        "id": "resp_test1",
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": 9,
        "model": "qwen-test",
        "output": [
            {
                "id": "msg_test1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}],
            }
        ],
        "parallel_tool_calls": False,
        "previous_response_id": "resp_prev",
        "reasoning": {"effort": "high", "summary": "concise"},
        "store": False,
        "temperature": 0.5,
        "text": {"format": {"type": "text"}},
        "tool_choice": {"type": "function", "name": "exec_command"},
        "tools": [],
        "top_p": 0.25,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 11,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 7,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 18,
        },
        "metadata": {},
    }
    Response.model_validate(body)
    plain_body = PROVIDER.render_response(parse(reasoning={"summary": "none"}), completion(finish_reason="abort"), CTX)
    assert (
        plain_body["tool_choice"],
        plain_body["parallel_tool_calls"],
        plain_body["store"],
        plain_body["reasoning"],
    ) == ("auto", True, True, {"effort": None, "summary": None})
    assert (plain_body["status"], plain_body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [
        PROVIDER.render_response(parse(tools=[EXEC], tool_choice=c), completion(), CTX)["tool_choice"]
        for c in ("none", "required")
    ] == ["none", "required"]


def test_reasoning_settings() -> None:
    assert parse(reasoning={"effort": "minimal", "summary": "detailed"}).extra["reasoning_summary"] == "detailed"
    assert parse(reasoning={"summary": "none"}).extra["reasoning_summary"] is None
    assert parse(reasoning={"generate_summary": "auto"}).extra["reasoning_summary"] == "auto"
    assert parse(reasoning={}).enable_thinking is None and "reasoning_effort" not in parse(reasoning={}).extra
    request = parse(reasoning={"effort": "none", "summary": "auto"})
    assert (request.enable_thinking, request.extra["reasoning_effort"]) == (False, "none")
    # A summary is rendered only when asked for.
    body = PROVIDER.render_response(parse(reasoning={"generate_summary": "auto"}), completion(reasoning="r"), CTX)
    assert body["output"][0] == {
        "id": "rs_test1",
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "r"}],
        "content": [{"type": "reasoning_text", "text": "r"}],
        "encrypted_content": None,
    }


def test_items_the_api_allows() -> None:
    req = parse(
        tools=[
            {"type": "custom", "name": "free"},
            {"type": "function", "name": "bare"},
            {"type": "function", "name": "bare", "description": "a second definition is ignored"},
            {
                "type": "namespace",
                "name": "ns",
                "tools": [
                    {
                        "type": "custom",
                        "name": "raw",
                        "description": None,
                        "format": {"type": "grammar", "definition": "x"},
                    }
                ],
            },
            {"type": "file_search"},
        ],
        input=[
            {"type": "message", "role": "developer", "content": "one"},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "two"}]},
            {"type": "reasoning", "summary": [{"text": "s1"}, {"type": "text", "text": "s2"}]},
            {"type": "reasoning", "content": [], "summary": []},  # nothing readable: no assistant turn from it
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"type": "message", "role": "assistant", "content": "again"},
            {"type": "function_call", "call_id": "c1", "name": "bare"},  # no arguments
            {"type": "custom_tool_call", "call_id": "c2", "name": "free"},  # no input
            {"type": "local_shell_call", "call_id": "c3", "action": "ls"},
            {"type": "tool_search_call", "call_id": "c4"},
            {"type": "function_call_output", "call_id": "c1"},
            {
                "type": "tool_search_output",
                "tools": [{"type": "function", "name": "late"}],
            },  # no call_id: no tool message
            {
                "type": "custom_tool_call_output",
                "call_id": "c2",
                "output": [{"type": "output_text", "text": "o"}, {"type": "text", "text": "p"}],
            },
            {"type": "compaction_summary"},
            {"type": "ghost_snapshot"},
            {"type": "reasoning", "summary": [{"text": "after"}]},
        ],
    )
    assert req.messages == [
        {"role": "system", "content": "one\n\ntwo"},
        {
            "role": "assistant",
            "content": "no\n\nagain",
            "reasoning_content": "s1\n\ns2",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bare", "arguments": ""}},
                {"id": "c2", "type": "function", "function": {"name": "free", "arguments": '{"input":""}'}},
                {"id": "c3", "type": "function", "function": {"name": "local_shell", "arguments": "ls"}},
                {"id": "c4", "type": "function", "function": {"name": "tool_search", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": ""},
        {"role": "tool", "tool_call_id": "c2", "content": "o\np"},
        {"role": "assistant", "content": None, "reasoning_content": "after"},
    ]
    free = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "The raw input of this tool (free text)."}},
        "required": ["input"],
        "additionalProperties": False,
    }
    assert req.tools == [
        {"type": "function", "function": {"name": "free", "parameters": free}},
        {"type": "function", "function": {"name": "bare", "parameters": {"type": "object", "properties": {}}}},
        {
            "type": "function",
            "function": {
                "name": "ns.raw",
                "parameters": {
                    **free,
                    "properties": {
                        "input": {
                            "type": "string",
                            "description": "The raw input of this tool, written in this  grammar:\nx",
                        }
                    },
                },
            },
        },
        {"type": "function", "function": {"name": "late", "parameters": {"type": "object", "properties": {}}}},
    ]
    assert req.extra == {
        "store": True,
        "parallel_tool_calls": True,
        "reasoning_summary": None,
        "custom_tools": ["free", "ns.raw"],
        "namespaced_tools": {"ns.raw": "ns"},
        "dropped_tools": ["file_search"],
        "dropped_items": ["compaction_summary", "ghost_snapshot"],
    }
    # A custom tool whose format is not a grammar is free text.
    text_format = parse(tools=[{"type": "custom", "name": "t", "format": {"type": "text"}}]).tools[0]
    assert (
        text_format["function"]["parameters"]["properties"]["input"]["description"]
        == "The raw input of this tool (free text)."
    )
    # Instructions as a list of system messages; input as an empty list.
    listed = parse(instructions=[{"role": "system", "content": "a"}, {"role": "developer", "content": "b"}], input=[])
    assert listed.messages == [{"role": "system", "content": "a\n\nb"}]
    # A user message and an agent message each end the assistant turn before them.
    turns = parse(
        input=[
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "y"},
            {"type": "agent_message", "content": "z"},
            {"role": "assistant", "content": "w"},
        ]
    ).messages
    assert [m["content"] for m in turns] == ["x", "u", "y", "z", "w"]


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("auto", "auto"),
        (
            {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
            {"type": "function", "function": {"name": "multi_agent_v1.close_agent"}},
        ),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, "auto"),
    ],
)
def test_tool_choice_details(raw: Any, expected: Any) -> None:
    assert parse(tools=[EXEC, NAMESPACE], tool_choice=raw).tool_choice == expected


def test_rendered_calls_the_api_allows() -> None:
    request = parse(tools=[APPLY_PATCH, {"type": "namespace", "name": "ns", "tools": [APPLY_PATCH]}])
    calls = [ToolCall("c1", "apply_patch", "raw text"), ToolCall("c2", "ns.apply_patch", '{"input": "x"}')]
    body = PROVIDER.render_response(request, completion(content=None, tool_calls=calls), CTX)
    assert body["output"] == [
        {
            "id": "ctc_test1_0",
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "c1",
            "name": "apply_patch",
            "input": "raw text",
        },
        {
            "id": "ctc_test1_1",
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "c2",
            "name": "apply_patch",
            "input": "x",
            "namespace": "ns",
        },
    ]
    fn = PROVIDER.render_response(
        parse(tools=[EXEC]), completion(content="a", tool_calls=[ToolCall("c", "exec_command", "{}")]), CTX
    )
    assert fn["output"][1] == {
        "id": "fc_test1_0",
        "type": "function_call",
        "status": "completed",
        "call_id": "c",
        "name": "exec_command",
        "arguments": "{}",
    }


def test_custom_input_of_one_string_among_others() -> None:
    assert custom_input('{"a": "x", "b": 1}') == '{"a": "x", "b": 1}'  # two keys: the model's own text
    assert custom_input('{"a": 1}') == '{"a": 1}'
    assert custom_input('"just a string"') == '"just a string"'


def test_overflow_messages_in_openai_wording() -> None:
    counted = PROVIDER.render_error(ContextLengthExceeded("x", prompt_tokens=40000, window=32768))["error"]
    assert counted == {
        "message": "Your input exceeds the context window of this model. (40000 input tokens > 32768 maximum) "
        "Please adjust your input and try again.",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }
    plain_overflow = PROVIDER.render_error(ContextLengthExceeded("prompt too long"))["error"]["message"]
    assert (
        plain_overflow == "Your input exceeds the context window of this model. (prompt too long) "
        "Please adjust your input and try again."
    )


def test_a_stream_error_in_full() -> None:
    provider = OpenAIResponsesProvider()
    ctx = ResponseContext("resp_f", 7, "qwen-test")
    events = list(provider.render_stream_error(PolarError(503, "overloaded", "busy"), ctx))
    start = {
        "id": "resp_f",
        "object": "response",
        "created_at": 7,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "qwen-test",
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        "usage": None,
        "metadata": {},
    }
    assert [(e.event, e.data) for e in events] == [
        ("response.created", {"type": "response.created", "sequence_number": 0, "response": start}),
        ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": start}),
        (
            "response.failed",
            {
                "type": "response.failed",
                "sequence_number": 2,
                "response": {**start, "status": "failed", "error": {"code": "server_is_overloaded", "message": "busy"}},
            },
        ),
    ]
    # After three keep-alives (created, in_progress, then two in_progress) only the failure is left, numbered on.
    provider.keepalive(parse(provider, stream=True), ctx)
    provider.keepalive(parse(provider, stream=True), ctx)
    [failed] = provider.render_stream_error(PolarError(500, "brand_new", "x"), ctx)
    assert failed.data["sequence_number"] == 3 and failed.data["response"]["error"] == {
        "code": "server_error",
        "message": "x",
    }


def test_keepalive_bytes() -> None:
    provider = OpenAIResponsesProvider()
    ctx = ResponseContext("resp_k", 3, "qwen-test")
    request = parse(provider, stream=True)
    first, second = provider.keepalive(request, ctx), provider.keepalive(request, ctx)
    assert first.startswith(b"event: response.created\ndata: ") and first.count(b"\n\n") == 2
    assert b'"sequence_number":0' in first and b'"sequence_number":1' in first
    assert second.startswith(b"event: response.in_progress\ndata: ") and second.count(b"\n\n") == 1
    assert b'"sequence_number":2' in second and ctx.stream_state == {"next_sequence_number": 3}
    assert [e.data["sequence_number"] for e in provider.render_stream(request, completion(content="a"), ctx)][0] == 3


def test_compaction_calls() -> None:
    provider = OpenAIResponsesProvider()
    user = {"type": "message", "role": "user", "content": "fix it"}
    body = {
        "model": "m",
        "stream": True,
        "tool_choice": "required",
        "tools": [EXEC],
        "input": [user, {"role": "assistant", "content": "ok"}, "not an item"],
    }
    with pytest.raises(PolarError, match=r"^input\[2\] must be an object$"):
        provider.parse_request(body, provider.route("POST", "/v1/responses/compact"))
    body["input"] = body["input"][:2] + [{"role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    compact = provider.parse_request(body, provider.route("POST", "/v1/responses/compact"))
    assert (compact.stream, compact.tool_choice, compact.extra["compaction"]) == (False, "none", "remote_v1")
    answer = provider.render_response(compact, completion(content="  summary \n"), ResponseContext("resp_c", 0, "m"))
    assert answer == {
        "output": [
            user,
            body["input"][2],
            {"id": "cmp_c", "type": "compaction", "encrypted_content": encode_summary("summary")},
        ]
    }
    assert provider.history.get("resp_c") is None  # a compaction answer starts no chain
    trigger = provider.parse_request({**body, "input": [user, {"type": "compaction_trigger"}]}, GENERATE)
    assert (trigger.stream, trigger.tool_choice, trigger.extra["compaction"]) == (True, "none", "remote_v2")
    assert trigger.messages[-1] == {"role": "user", "content": POLAR_COMPACTION_PROMPT}
    assert trigger.extra["dropped_items"] == ["compaction_trigger"]
    [item] = provider.render_response(trigger, completion(content=None), ResponseContext("resp_d", 0, "m"))["output"]
    assert item == {"id": "cmp_d", "type": "compaction", "encrypted_content": encode_summary("")}
    # Our own compaction item reads back as the summary; an empty one too.
    again = provider.parse_request(
        {"model": "m", "input": [{"type": "compaction", "encrypted_content": encode_summary("S")}]}, GENERATE
    )
    assert again.messages == [summary_message("S")] and "dropped_items" not in again.extra
    assert provider.parse_request({"model": "m", "input": [item]}, GENERATE).messages == [summary_message("")]


def test_response_history_bounds_in_detail() -> None:
    history = ResponseHistory(size=3, max_bytes=100, session_bytes=50)
    history.remember("a1", [{"n": 1}], session="a", cost=20)
    history.remember("a2", [{"n": 2}], session="a", cost=20)
    assert (len(history), history.total_bytes, history.get("a1")) == (2, 40, [{"n": 1}])
    history.remember("a3", [], session="a", cost=20)  # 60 > 50 for session a: its least recently used goes
    assert (history.get("a2"), history.total_bytes, len(history)) == (None, 40, 2)
    history.remember("a3", [], session="a", cost=5)  # the same id again replaces its entry
    assert (history.total_bytes, len(history)) == (25, 2)
    history.remember("b1", [], session="b", cost=50)  # exactly at both bounds: kept
    assert history.get("b1") == [] and history.total_bytes == 75
    history.get("a1")  # used: a3 is now the least recently used
    history.remember("c1", [], session="c", cost=1)  # a fourth entry: over the count
    assert [r for r in ("a1", "a3", "b1", "c1") if history.get(r) is not None] == ["a1", "b1", "c1"]
    history.remember("d1", [], session="d", cost=49)  # 20 + 50 + 1 + 49 > 100: the least recently used goes
    assert (history.total_bytes, history.get("a1"), history.get("d1")) == (100, None, [])
    history.remember("big", [], session="e", cost=51)  # over one session's share: not remembered at all
    assert history.get("big") is None
    # One prewarm per session: a second replaces the first, a real turn stays.
    history = ResponseHistory(size=10, max_bytes=1000, session_bytes=1000)
    history.remember("t", [], session="s", cost=1)
    history.remember("p1", [], session="s", cost=1, prewarm=True)
    history.remember("p2", [], session="s", cost=1, prewarm=True)
    history.remember("q", [], session="other", cost=1, prewarm=True)
    assert [r for r in ("t", "p1", "p2", "q") if history.get(r) is not None] == ["t", "p2", "q"]
    assert history.total_bytes == 3
    # An entry's cost: the request body and every earlier body and output of its chain.
    provider = OpenAIResponsesProvider()
    first = provider.parse_request({"model": "m", "input": "hi"}, Route(kind="generate", session="s", body_bytes=100))
    provider.render_response(first, completion(content="a"), ResponseContext("resp_1", 0, "m"))
    one = provider.history.entry("resp_1")
    out = provider.history.get("resp_1")[-1:]
    assert (one.session, one.cost, one.prewarm) == ("s", 100 + len(orjson.dumps(out)), False)
    second = provider.parse_request(
        {"model": "m", "input": "more", "previous_response_id": "resp_1"},
        Route(kind="generate", session="s", body_bytes=10),
    )
    provider.remember(second, "resp_2", [], prewarm=True)
    two = provider.history.entry("resp_2")
    assert (two.cost, two.prewarm, len(two.items)) == (one.cost + 10, True, 3)


# ---------------------------------------------------------------- the stream as the spec assembles it

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def _assemble(events: list[StreamEvent]) -> list[dict[str, Any]]:
    """The output items as a client following the Responses streaming reference builds them: an item
    starts as output_item.added announces it, a part as its *part.added event opens it, text grows by
    the deltas, and each *.done event must carry exactly what was assembled so far."""
    items: dict[int, dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    for event in events:
        d = event.data
        assert event.event == d["type"]  # the SSE event name is the data's type
        kind = d["type"]
        if kind == "response.output_item.added":
            assert d["output_index"] == len(items)
            items[d["output_index"]] = copy.deepcopy(d["item"])
            continue
        if "output_index" not in d:
            continue
        item = items[d["output_index"]]
        assert kind == "response.output_item.done" or d["item_id"] == item["id"]
        if kind in ("response.content_part.added", "response.reasoning_summary_part.added"):
            parts = item["content" if kind == "response.content_part.added" else "summary"]
            assert d["content_index" if "content_index" in d else "summary_index"] == len(parts)
            parts.append(copy.deepcopy(d["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            item["content"][d["content_index"]]["text"] += d["delta"]
        elif kind == "response.reasoning_summary_text.delta":
            item["summary"][d["summary_index"]]["text"] += d["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert d["text"] == item["content"][d["content_index"]]["text"]
        elif kind == "response.reasoning_summary_text.done":
            assert d["text"] == item["summary"][d["summary_index"]]["text"]
        elif kind == "response.content_part.done":
            assert d["part"] == item["content"][d["content_index"]]
        elif kind == "response.reasoning_summary_part.done":
            assert d["part"] == item["summary"][d["summary_index"]]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += d["delta"]
        elif kind == "response.function_call_arguments.done":
            assert (d["name"], d["arguments"]) == (item["name"], item["arguments"])
        elif kind == "response.custom_tool_call_input.delta":
            item["input"] += d["delta"]
        elif kind == "response.custom_tool_call_input.done":
            assert d["input"] == item["input"]
        elif kind == "response.output_item.done":
            # Only the status moves on (in_progress -> completed); everything else was streamed.
            assert {**item, "status": d["item"].get("status")} == {**d["item"], "status": d["item"].get("status")}
            done.append(d["item"])
        else:
            raise AssertionError(f"unexpected event {kind}")
    return done


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_stream_events_assemble_the_final_items_as_the_spec_says(name: str) -> None:
    """Every event validates strictly as the SDK's own ResponseStreamEvent (literal types, required
    fields, logprobs a list); the items assembled from the events are the completed response's output;
    an item is announced empty (no text, no parts, in_progress) and filled by the events that follow."""
    request = parse(**STREAM_REQUEST)
    events = list(PROVIDER.render_stream(request, STREAM_CASES[name], CTX))
    for event in events:
        STREAM_EVENT.validate_python(event.data, strict=True)
    completed = events[-1].data["response"]
    assert _assemble(events) == completed["output"]
    for event in events:
        if event.data["type"] == "response.output_item.added":
            item = event.data["item"]
            if item["type"] == "reasoning":
                assert (item["summary"], item["content"]) == ([], [])
            elif item["type"] == "message":
                assert (item["status"], item["content"]) == ("in_progress", [])
            elif item["type"] == "function_call":
                assert (item["status"], item["arguments"]) == ("in_progress", "")
            else:
                assert (item["status"], item["input"]) == ("in_progress", "")
        if event.data["type"].endswith("part.added"):
            assert event.data["part"]["text"] == ""


def test_routes_with_a_trailing_slash_or_a_question_mark_in_the_query() -> None:
    assert PROVIDER.route("POST", "/v1/responses/") == Route(kind="generate")
    assert PROVIDER.route("POST", "/v1/responses/compact/") == Route(kind="compact")
    assert PROVIDER.route("POST", "/v1/responses?api-version=1?x") == Route(kind="generate")
    assert PROVIDER.route("POST", "/v1/responsesX") is None  # only slashes are trimmed


def test_a_reasoning_part_without_a_type_is_read_as_its_fields_kind() -> None:
    request = parse(
        input=[{"type": "reasoning", "content": [{"text": "plan"}]}, {"role": "assistant", "content": "ok"}]
    )
    assert request.messages[-1] == {"role": "assistant", "content": "ok", "reasoning_content": "plan"}


def test_a_custom_tool_whose_format_is_not_an_object_takes_free_text() -> None:
    request = parse(tools=[{"type": "custom", "name": "note", "format": "text"}])
    assert request.tools[0]["function"]["parameters"]["properties"]["input"] == {
        "type": "string",
        "description": "The raw input of this tool (free text).",
    }


def _sse_blocks(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event, read as the SSE format defines it: blocks end in a blank line."""
    *blocks, tail = raw.split(b"\n\n")
    assert tail == b""
    out = []
    for block in blocks:
        event, data = block.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: ")
        out.append((event[len(b"event: ") :].decode(), orjson.loads(data[len(b"data: ") :])))
    return out


def test_keepalives_are_whole_valid_events_of_the_stream() -> None:
    provider = OpenAIResponsesProvider()
    ctx = ResponseContext("resp_k2", 3, "qwen-test")
    request = parse(provider, stream=True, temperature=0.5)
    first = _sse_blocks(provider.keepalive(request, ctx))
    later = _sse_blocks(provider.keepalive(request, ctx))
    assert [name for name, _ in first] == ["response.created", "response.in_progress"] and [n for n, _ in later] == [
        "response.in_progress"
    ]
    for name, data in first + later:
        STREAM_EVENT.validate_python(data, strict=True)
        assert data["type"] == name and data["response"]["status"] == "in_progress"
        assert (data["response"]["id"], data["response"]["temperature"]) == ("resp_k2", 0.5)
    assert [d["sequence_number"] for _, d in first + later] == [0, 1, 2]
    assert later[0][1]["response"] == first[1][1]["response"]


def test_a_compact_request_whose_inputs_are_gone_keeps_no_window() -> None:
    provider = OpenAIResponsesProvider()
    compact = provider.parse_request({"model": "m", "input": "fix it"}, provider.route("POST", "/v1/responses/compact"))
    copy_of = dataclasses.replace(compact)  # not the object parsed: its inputs are not known
    answer = provider.render_response(copy_of, completion(content="S"), ResponseContext("resp_w", 0, "m"))
    assert answer == {"output": [{"id": "cmp_w", "type": "compaction", "encrypted_content": encode_summary("S")}]}


def test_a_streamed_compaction_assembles_as_the_spec_says() -> None:
    provider = OpenAIResponsesProvider()
    request = provider.parse_request(
        {
            "model": "m",
            "stream": True,
            "input": [{"role": "user", "content": "fix it"}, {"type": "compaction_trigger"}],
        },
        GENERATE,
    )
    events = list(provider.render_stream(request, completion(content="summary"), CTX))
    for event in events:
        STREAM_EVENT.validate_python(event.data, strict=True)
    item = {"id": "cmp_test1", "type": "compaction", "encrypted_content": encode_summary("summary")}
    assert _assemble(events) == events[-1].data["response"]["output"] == [item]


def test_a_grammar_tool_names_its_syntax_and_its_definition() -> None:
    request = parse(tools=[APPLY_PATCH])
    assert request.tools[0]["function"]["parameters"]["properties"]["input"]["description"] == (
        "The raw input of this tool, written in this lark grammar:\n" + APPLY_PATCH["format"]["definition"]
    )


# ---------------------------------------------------------------- from the sixth round's run of the slow end

INPUT_ITEM = TypeAdapter(ResponseInputItemParam)


def test_history_bounds_at_their_edges_and_the_refusal_logged(caplog: pytest.LogCaptureFixture) -> None:
    history = ResponseHistory(size=10, max_bytes=10, session_bytes=20)
    history.remember("free", [])  # no cost given: counted as nothing
    assert (history.get("free"), history.total_bytes) == ([], 0)
    history.remember("whole", [], session="s", cost=10)  # exactly the overall bound: kept
    assert (history.get("whole"), history.total_bytes) == ([], 10)
    with caplog.at_level(logging.WARNING, logger="polar"):
        history.remember("huge", [], session="s", cost=11)
    assert history.get("huge") is None
    assert [r.getMessage() for r in caplog.records if r.name == "polar"] == [
        "polar: response huge (11 bytes of history) is over the history bound; "
        "a request continuing from it will get previous_response_not_found"
    ]


def test_replacing_an_entry_takes_only_its_own_cost_off_its_session() -> None:
    history = ResponseHistory(size=10, max_bytes=1000, session_bytes=50)
    history.remember("a1", [], session="s", cost=30)
    history.remember("a2", [], session="s", cost=10)
    history.remember("a1", [], session="s", cost=5)  # the session now holds 10 + 5
    history.remember("a3", [], session="s", cost=20)  # 35 <= 50: nothing of the session goes
    assert [r for r in ("a1", "a2", "a3") if history.get(r) is not None] == ["a1", "a2", "a3"]
    assert history.total_bytes == 35


def test_a_request_this_provider_did_not_parse_keeps_only_its_output() -> None:
    # The gateway remembers every rendered response; a request whose parsed inputs are not here (another
    # provider instance parsed it) still chains from its output, costed by that output alone.
    request = parse(OpenAIResponsesProvider())
    provider = OpenAIResponsesProvider()
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}]
    provider.remember(request, "resp_x", output)
    entry = provider.history.entry("resp_x")
    assert (entry.items, entry.session, entry.cost, entry.prewarm) == (output, None, len(orjson.dumps(output)), False)


def test_item_content_parts_the_api_allows_in_assistant_and_agent_messages() -> None:
    assistant = {"type": "message", "role": "assistant", "content": [{"type": "input_text", "text": "typed back"}]}
    INPUT_ITEM.validate_python(assistant)  # an EasyInputMessage of any role may hold input parts
    # Codex's multi-agent message (no SDK type): its parts as a message's, input or output text.
    agent = {
        "type": "agent_message",
        "content": [{"type": "output_text", "text": "from"}, {"type": "text", "text": "the other agent"}],
    }
    req = parse(input=[{"type": "message", "role": "user", "content": "go"}, assistant, agent])
    assert req.messages == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "typed back"},
        {"role": "user", "content": "from\nthe other agent"},
    ]


def test_a_tool_search_output_lists_the_names_of_the_tools_it_loaded() -> None:
    item = {"type": "tool_search_output", "call_id": "ts1", "tools": [EXEC, WEB_SEARCH]}
    INPUT_ITEM.validate_python(item)
    req = parse(input=[{"type": "tool_search_call", "call_id": "ts1", "arguments": {"q": "run"}}, item])
    # A hosted tool has no name: it is listed as "" (the engine still sees how many were loaded).
    assert req.messages[-1] == {"role": "tool", "tool_call_id": "ts1", "content": '["exec_command",""]'}
    assert [t["function"]["name"] for t in req.tools] == ["exec_command"]


def test_polar_compaction_item_ends_the_assistant_turn_before_it() -> None:
    summary = {"type": "compaction", "encrypted_content": encode_summary("the summary")}
    req = parse(
        input=[
            {"type": "message", "role": "assistant", "content": "before"},
            summary,
            {"type": "message", "role": "assistant", "content": "after"},
        ]
    )
    assert req.messages == [
        {"role": "assistant", "content": "before"},
        summary_message("the summary"),
        {"role": "assistant", "content": "after"},
    ]


def test_instructions_as_items_leave_out_what_nothing_reads() -> None:
    req = parse(instructions=[{"role": "developer", "content": "rules"}, {"type": "web_search_call", "id": "ws_1"}])
    assert req.messages[0] == {"role": "system", "content": "rules"}


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"input": [{"type": "additional_tools", "tools": [{"type": "function"}]}]},
            "input[0].tools[0]: 'function' needs a string 'name'",
        ),
        (
            {"input": [{"type": "tool_search_output", "tools": [{"type": "function"}]}]},
            "input[0].tools[0]: 'function' needs a string 'name'",
        ),
        (
            {"input": [{"type": "tool_search_output", "tools": "exec_command"}]},
            "input[0]: tool_search_output 'tools' must be a list",
        ),
        (
            {"input": [{"type": "tool_search_output", "call_id": "", "tools": []}]},
            "input[0]: 'tool_search_output' needs a string 'call_id'",
        ),
        (
            {"input": [{"type": "agent_message", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0]: input_image parts are not supported by this engine (text only)",
        ),
        ({"tools": [{"type": "namespace", "tools": [EXEC]}]}, "tools[0]: 'namespace' needs a string 'name'"),
        (
            {"tool_choice": {"type": "function"}},
            "'tool_choice' must be 'auto', 'none', 'required', {type: function|custom, name} "
            "or {type: allowed_tools, mode}",
        ),
    ],
)
def test_invalid_items_and_tools_say_where(body: dict[str, Any], message: str) -> None:
    with pytest.raises(PolarError) as err:
        parse(OpenAIResponsesProvider(), **body)
    assert (err.value.status, err.value.kind, err.value.message) == (400, "invalid_request", message)
