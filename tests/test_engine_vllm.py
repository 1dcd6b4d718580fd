"""VLLMEngine against a real vLLM CPU server on the tiny model."""

from __future__ import annotations

import asyncio
import socket

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from polar_addon.canonical import CanonicalRequest, PolarError, SamplingParams
from polar_addon.engines.openai_compat import chat_body
from polar_addon.engines.vllm import VLLMEngine

pytestmark = pytest.mark.vllm
VLLM_MODEL_NAME = "tiny"  # the vllm_server fixture's --served-model-name

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Open setup.py and tell me the version."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "setup.py"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "version='1.2.3'"},
]


def request(**sampling) -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat", model="whatever-the-client-said", messages=MESSAGES, tools=TOOLS,
        tool_choice="auto", sampling=SamplingParams(**sampling),
    )  # fmt: skip


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(coro):
    return asyncio.run(coro)


async def _complete(url: str, req: CanonicalRequest):
    engine = VLLMEngine(url, timeout_s=120)
    try:
        return await engine.complete(req), await engine.count_tokens(req)
    finally:
        await engine.close()


def test_ids_match_chat_template_and_raw_vllm_answer(vllm_server, tiny_model_dir):
    req = request(temperature=1.0, max_tokens=16, seed=7)
    completion, counted = run(_complete(vllm_server, req))

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert list(completion.prompt_ids) == tok(text, add_special_tokens=False)["input_ids"]
    assert counted == len(completion.prompt_ids)

    # The same seeded request sent raw: the engine must hand back exactly what vLLM said.
    body = chat_body(req, VLLM_MODEL_NAME) | {"return_token_ids": True}
    raw = httpx.post(f"{vllm_server}/v1/chat/completions", content=orjson.dumps(body),
                     headers={"content-type": "application/json"}, timeout=120).json()  # fmt: skip
    choice = raw["choices"][0]
    assert list(completion.prompt_ids) == raw["prompt_token_ids"]
    assert completion.response_ids == choice["token_ids"]
    assert completion.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert len(completion.response_ids) == len(completion.logprobs) == 16
    assert completion.finish_reason == choice["finish_reason"] == "length"
    assert completion.message.content == choice["message"]["content"]
    assert completion.served_model == VLLM_MODEL_NAME
    assert completion.engine == f"vllm:{vllm_server}"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_pass(vllm_server, reference_logprobs, temperature):
    completion, _ = run(_complete(vllm_server, request(temperature=temperature, max_tokens=24, seed=3)))
    ref = reference_logprobs(completion.prompt_ids, completion.response_ids, temperature)
    diffs = [abs(a - b) for a, b in zip(completion.logprobs, ref, strict=True)]
    assert sum(diffs) / len(diffs) <= 1e-3, diffs


def test_stop_string_keeps_sampled_tokens(vllm_server):
    # Seeded sampling is reproducible, and a stop string does not change what is sampled.
    free_run, _ = run(_complete(vllm_server, request(temperature=1.0, max_tokens=24, seed=11)))
    text = free_run.message.content or ""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, f"sampled output too short to cut: {text!r}"
    cut, _ = run(_complete(vllm_server, request(temperature=1.0, max_tokens=24, seed=11, stop=[stop])))
    assert cut.finish_reason == "stop"
    assert cut.matched_stop == stop
    assert cut.message.content == text[: text.find(stop)]
    # vLLM keeps the tokens that spelled the stop string; they are a prefix of the free run.
    assert 0 < len(cut.response_ids) < len(free_run.response_ids)
    assert cut.response_ids == free_run.response_ids[: len(cut.response_ids)]
    assert cut.logprobs == free_run.logprobs[: len(cut.logprobs)]


def test_thinking_flag_is_accepted_and_counted_alike(vllm_server):
    """vLLM takes the flag (chat_template_kwargs) on both routes, and /tokenize counts what the
    generation saw. The shared server's tiny template ignores the flag; that it reaches a template
    that reads it is checked with a Qwen3-style template through the local and SGLang engines."""
    req = request(temperature=0, max_tokens=4)
    req.enable_thinking = False
    completion, counted = run(_complete(vllm_server, req))
    assert counted == len(completion.prompt_ids)


def test_errors_are_canonical(vllm_server):
    async def scenario():
        engine = VLLMEngine(vllm_server, timeout_s=60)
        try:
            with pytest.raises(PolarError) as too_long:
                await engine.complete(request(max_tokens=200_000))
            assert (too_long.value.status, too_long.value.kind) == (400, "context_length_exceeded")
            bad = request(max_tokens=4)
            bad.tool_choice = {"type": "function", "function": {"name": "no_such_tool"}}
            with pytest.raises(PolarError) as invalid:
                await engine.complete(bad)
            assert (invalid.value.status, invalid.value.kind) == (400, "invalid_request")
            assert invalid.value.message
        finally:
            await engine.close()
        down = VLLMEngine(f"http://127.0.0.1:{closed_port()}", timeout_s=5)
        try:
            with pytest.raises(PolarError) as unreachable:
                await down.complete(request(max_tokens=4))
            assert (unreachable.value.status, unreachable.value.kind) == (503, "overloaded")
        finally:
            await down.close()

    run(scenario())


def test_the_served_window_is_vllms_max_model_len(vllm_server):
    from polar_cli.rollout.window import engine_window

    assert engine_window(f"vllm:{vllm_server}") == 100000  # the fixture's --max-model-len
