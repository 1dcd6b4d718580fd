"""Token input on the real vLLM CPU engine (the shared ``vllm_server``): ``/v1/completions`` with a continuation
prompt samples after exactly the given ids, reports them back, and its logprobs are the model's; the proxy parses
the text it gets back with the configured tool parser."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from polar_addon.canonical import CanonicalRequest, SamplingParams
from polar_addon.continuity.delta import DeltaPrompt
from polar_addon.engines.vllm import VLLMEngine
from polar_addon.tool_parsers import ParserChoice
from tests.support.tito_sessions import TOOLS

pytestmark = pytest.mark.vllm

START = [{"role": "system", "content": "You are a file assistant."}, {"role": "user", "content": "What is here?"}]
TURN = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}


def request(messages: list[dict], temperature: float, seed: int = 7) -> CanonicalRequest:
    return CanonicalRequest(
        "openai_chat",
        "tiny",
        messages,
        tools=TOOLS,
        sampling=SamplingParams(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, max_tokens=12, seed=seed),
    )


def test_vllm_samples_after_exactly_the_continuation_prompt(
    vllm_server: str, tiny_model_dir: Path, reference_logprobs
) -> None:
    engine = VLLMEngine(vllm_server)
    engine.tokenizer_dir = str(tiny_model_dir)
    engine.tool_parsers = ParserChoice("tiny=hermes")

    async def main() -> tuple:
        first = await engine.complete(request(START, 1.0))  # fresh: vLLM renders the chat itself
        tok = engine.tokenizer()
        # The assistant turn as the template writes it after the generation prompt, up to <|im_end|>: the ids a
        # model that made this call would have sampled (what the scripted engine replays).
        full = tok(tok.apply_chat_template([*START, TURN], tools=TOOLS, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        tail = full[len(first.prompt_ids) :]
        sampled = tail[: tail.index(tok.convert_tokens_to_ids("<|im_end|>")) + 1]
        delta = engine.continuation(
            prompt_ids=first.prompt_ids,
            sampled_ids=sampled,
            history=[*START, TURN],
            new_messages=[RESULT],
            tools=TOOLS,
            enable_thinking=None,
        )
        assert isinstance(delta, DeltaPrompt), delta
        sampled_run = await engine.complete_tokens(request([*START, TURN, RESULT], 0.8), delta.prompt_ids)
        greedy_tokens = await engine.complete_tokens(request([*START, TURN, RESULT], 0.0), delta.prompt_ids)
        greedy_chat = await engine.complete(request([*START, TURN, RESULT], 0.0))
        await engine.close()
        return first, delta, sampled_run, greedy_tokens, greedy_chat

    first, delta, sampled_run, greedy_tokens, greedy_chat = asyncio.run(main())
    assert list(sampled_run.prompt_ids) == delta.prompt_ids  # what the engine reports it saw
    # This template renders history as generated: the continuation is the engine's own full render, token for token.
    tokenized = httpx.post(
        f"{vllm_server}/tokenize",
        json={"model": "tiny", "messages": [*START, TURN, RESULT], "tools": TOOLS, "add_generation_prompt": True},
    ).json()
    assert delta.prompt_ids == tokenized["tokens"]
    assert list(greedy_tokens.response_ids) == list(greedy_chat.response_ids)
    assert greedy_tokens.message.content == greedy_chat.message.content
    ref = reference_logprobs(delta.prompt_ids, sampled_run.response_ids, 0.8)
    assert sum(abs(a - b) for a, b in zip(sampled_run.logprobs, ref)) / len(ref) <= 1e-3
    assert sampled_run.finish_reason in ("length", "stop") and sampled_run.engine == f"vllm:{vllm_server}"
