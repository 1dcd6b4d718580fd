"""OpenAI Responses and Gemini end to end: the official SDKs through a real mitmdump with the polar addon.

Regular mode (HTTPS_PROXY + mitmproxy's CA, session in the proxy credentials). The scripted engine
answers (tool calls need it: the random tiny model never makes one), with genuine tokens and
logprobs from the tiny model: turn one calls tools, turn two answers in text.
"""

from __future__ import annotations

import ssl

import httpx
import openai
import orjson
import pytest
from google import genai
from google.genai import types

from tests.support.proxy import run_mitmdump
from tests.support.shards import session_records

PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
SCRIPT_TURNS = [
    {
        "content": "Adding it.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            {"type": "function", "function": {"name": "apply_patch", "arguments": {"input": PATCH}}},
        ],
    },
    {"content": "The sum is 5."},
]
ADD_OAI = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
PATCH_OAI = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"',
    },
}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("responses-gemini")
    script = root / "script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": SCRIPT_TURNS}))
    with run_mitmdump(
        f"scripted:{script}", root / "shards", options={"polar_shard_seconds": "0.2", "polar_keepalive": "1"}
    ) as p:
        yield p


def http_client(proxy, session: str) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )


def records(proxy, session: str) -> list:
    return session_records(proxy.out, session)


def summary(response) -> list[tuple]:
    """Output items without their per-call ids."""
    out = []
    for o in response.output:
        if o.type == "message":
            out.append((o.type, o.status, [c.text for c in o.content]))
        else:
            out.append((o.type, o.name, getattr(o, "arguments", None), getattr(o, "input", None)))
    return out


def test_openai_responses_sdk_tools_stream_and_previous_response_id(proxy):
    client = openai.OpenAI(api_key="sk-not-a-real-key", http_client=http_client(proxy, "resp-1"), max_retries=0)
    kwargs = dict(
        model="tiny", instructions="You can add.", input="add 2 and 3, then write a.txt", tools=[ADD_OAI, PATCH_OAI]
    )
    plain = client.responses.create(**kwargs)
    assert [o.type for o in plain.output] == ["message", "function_call", "custom_tool_call"]
    message, call, patch = plain.output
    assert message.content[0].text == "Adding it." and (call.name, orjson.loads(call.arguments)) == (
        "add",
        {"a": 2, "b": 3},
    )
    assert (patch.name, patch.input) == ("apply_patch", PATCH)
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0

    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == "Adding it."
    assert summary(final) == summary(plain)

    # Only the tool results, pointing at the plain response (instructions are per request, as at OpenAI).
    follow = client.responses.create(
        model="tiny",
        instructions="You can add.",
        previous_response_id=plain.id,
        tools=[ADD_OAI, PATCH_OAI],
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
            {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done!"},
        ],
    )
    assert follow.output_text == "The sum is 5."
    calls = records(proxy, "resp-1")
    assert [r.api for r in calls] == ["openai_responses"] * 3 and all(r.status == "ok" for r in calls)
    last = calls[-1].messages
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "tool"]
    assert last[2]["tool_calls"][1]["function"] == {
        "name": "apply_patch",
        "arguments": orjson.dumps({"input": PATCH}).decode(),
    }
    assert calls[-1].prompt_ids[: len(calls[0].prompt_ids)] == calls[0].prompt_ids

    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", previous_response_id="resp_unknown", input="x")
    assert err.value.code == "previous_response_not_found"


def test_google_genai_sdk_function_calls_stream_and_count(proxy):
    http = http_client(proxy, "gem-1")
    client = genai.Client(api_key="not-a-real-key", http_options=types.HttpOptions(httpx_client=http))
    add = types.FunctionDeclaration(
        name="add",
        description="Add two integers.",
        parameters=types.Schema(
            type="OBJECT", properties={"a": types.Schema(type="INTEGER"), "b": types.Schema(type="INTEGER")}
        ),
    )
    patch = types.FunctionDeclaration(
        name="apply_patch",
        description="Edit files.",
        parameters=types.Schema(type="OBJECT", properties={"input": types.Schema(type="STRING")}),
    )
    config = types.GenerateContentConfig(
        system_instruction="You can add.", tools=[types.Tool(function_declarations=[add, patch])]
    )
    question = [types.Content(role="user", parts=[types.Part(text="add 2 and 3")])]

    plain = client.models.generate_content(model="tiny", contents=question, config=config)
    assert plain.text == "Adding it."
    assert [(c.name, c.args) for c in plain.function_calls] == [
        ("add", {"a": 2, "b": 3}),
        ("apply_patch", {"input": PATCH}),
    ]
    chunks = list(client.models.generate_content_stream(model="tiny", contents=question, config=config))
    assert "".join(c.text or "" for c in chunks) == "Adding it."
    assert [(c.name, c.args) for c in chunks[-1].function_calls] == [(c.name, c.args) for c in plain.function_calls]
    assert chunks[-1].usage_metadata.prompt_token_count == plain.usage_metadata.prompt_token_count > 0

    history = question + [
        plain.candidates[0].content,
        types.Content(
            role="user",
            parts=[
                types.Part(function_response=types.FunctionResponse(id=c.id, name=c.name, response={"output": "ok"}))
                for c in plain.function_calls
            ],
        ),
    ]
    assert client.models.generate_content(model="tiny", contents=history, config=config).text == "The sum is 5."
    count = client.models.count_tokens(model="tiny", contents=question)
    assert count.total_tokens > 0

    # Without alt=sse, streamGenerateContent answers one JSON array of the same chunks.
    body = {
        "contents": [{"role": "user", "parts": [{"text": "add 2 and 3"}]}],
        "tools": [{"functionDeclarations": [{"name": "add", "parameters": {"type": "OBJECT"}}]}],
    }
    array = http.post(
        "https://generativelanguage.googleapis.com/v1beta/models/tiny:streamGenerateContent",
        json=body,
        headers={"x-goog-api-key": "not-a-real-key"},
    )
    assert array.status_code == 200 and isinstance(array.json(), list)
    assert array.json()[-1]["candidates"][0]["finishReason"] == "STOP"

    calls = records(proxy, "gem-1")
    assert [r.api for r in calls] == ["gemini"] * 4 and all(r.status == "ok" for r in calls)
    assert [m["role"] for m in calls[2].messages] == ["system", "user", "assistant", "tool", "tool"]
    assert calls[2].prompt_ids[: len(calls[0].prompt_ids)] == calls[0].prompt_ids
