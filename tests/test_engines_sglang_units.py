"""SGLang's client (engines.sglang) against an in-process fake of SGLang 0.5.23's endpoints: the token-id extras every
chat call asks for, token input on ``/v1/completions`` with ``logprobs: 0`` (the sampled token's logprob alone),
``/v1/tokenize`` counts and in-place weight loads (``/update_weights_from_disk``, whose version tags every later
call). Refusals are checked in their exact words; a refused load names the checkpoint and SGLang's reason."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from polar_addon.canonical import CanonicalRequest, Completion, PolarError, SamplingParams
from polar_addon.engines.sglang import SGLangEngine
from tests.test_engines_vllm_units import MESSAGES, MODELS, TOOLS, Answer, serving

LPS = {"content": [{"token": "h", "bytes": [], "logprob": -0.5, "top_logprobs": []},
                   {"token": "i", "bytes": [], "logprob": -0.25, "top_logprobs": []}]}  # fmt: skip
CHAT = {
    "id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": None},
                 "logprobs": LPS, "finish_reason": "stop", "matched_stop": 2,
                 "prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8]}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    "metadata": {"weight_version": "step-2"},
}  # fmt: skip
COMPLETION = {
    "id": "x", "object": "text_completion", "created": 0, "model": "tiny",
    "choices": [{"index": 0, "text": "hi", "prompt_token_ids": [1, 2, 3], "token_ids": [7, 8],
                 "logprobs": {"token_logprobs": [-0.5, -0.25], "tokens": ["h", "i"], "text_offset": [0, 1],
                              "top_logprobs": []},
                 "finish_reason": "stop", "matched_stop": 2}],
    "metadata": {"weight_version": "step-2"},
}  # fmt: skip


def request(max_tokens: int | None = 8, thinking: bool | None = None, tools: bool = True) -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat",
        model="client-name",
        messages=MESSAGES,
        tools=TOOLS if tools else [],
        enable_thinking=thinking,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=4),
    )


def call(routes: dict[str, Answer], method: str, *args: Any) -> tuple[Any, list[tuple[str, str, Any]], str]:
    async def main() -> tuple[Any, list[tuple[str, str, Any]], str]:
        async with serving({"GET /v1/models": (200, MODELS), **routes}) as (url, seen):
            engine = SGLangEngine(url)
            try:
                return await getattr(engine, method)(*args), seen, url
            except PolarError as err:
                return err, seen, url
            finally:
                await engine.close()

    return asyncio.run(main())


def test_a_chat_call_asks_for_every_token_id_extra_sglang_knows() -> None:
    engine = SGLangEngine("http://h:30000")
    assert (engine.kind, engine.name) == ("sglang", "sglang:http://h:30000")
    assert engine.extra_body() == {"return_token_ids": True, "return_prompt_token_ids": True, "return_meta_info": True}
    completion, seen, url = call({"POST /v1/chat/completions": (200, CHAT)}, "complete", request())
    assert isinstance(completion, Completion)
    sent = seen[-1][2]
    assert (sent["return_token_ids"], sent["return_prompt_token_ids"], sent["return_meta_info"]) == (True, True, True)
    assert (list(completion.prompt_ids), completion.response_ids) == ([1, 2, 3], [7, 8])
    assert completion.logprobs == [-0.5, -0.25]
    assert (completion.weight_version, completion.engine) == ("step-2", f"sglang:{url}")


def test_token_input_asks_for_the_sampled_tokens_logprob_alone() -> None:
    completion, seen, _ = call({"POST /v1/completions": (200, COMPLETION)}, "complete_tokens", request(5), [1, 2, 3])
    assert isinstance(completion, Completion)
    assert [(m, p) for m, p, _ in seen] == [("GET", "/v1/models"), ("POST", "/v1/completions")]
    sent = seen[-1][2]
    assert (sent["model"], sent["prompt"], sent["max_tokens"]) == ("tiny", [1, 2, 3], 5)
    assert (sent["logprobs"], sent["return_token_ids"], sent["stream"]) == (0, True, False)
    assert (completion.response_ids, completion.logprobs, completion.weight_version) == (
        [7, 8],
        [-0.5, -0.25],
        "step-2",
    )
    assert (completion.message.content, completion.parse_failures) == ("hi", 0)


def test_tokenize_renders_the_chat_with_its_tools_and_thinking_flag() -> None:
    n, seen, _ = call({"POST /v1/tokenize": (200, {"tokens": [1, 2], "count": 12, "max_model_len": 64})},
                      "count_tokens", request(tools=False))  # fmt: skip
    assert n == 12
    assert seen[-1][:2] == ("POST", "/v1/tokenize")
    assert seen[-1][2] == {"model": "tiny", "messages": MESSAGES}
    n, seen, _ = call({"POST /v1/tokenize": (200, {"count": 0})}, "count_tokens", request(thinking=False))
    assert n == 0
    assert seen[-1][2] == {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    _, seen, _ = call({"POST /v1/tokenize": (200, {"count": 3})}, "count_tokens", request(thinking=True))
    assert seen[-1][2]["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("answer", [{"count": "12"}, {"tokens": [1, 2]}, [12], {"count": None}])
def test_a_tokenize_answer_without_a_whole_count_is_refused(answer: Any) -> None:
    err, _, _ = call({"POST /v1/tokenize": (200, answer)}, "count_tokens", request())
    assert isinstance(err, PolarError) and (err.status, err.kind) == (502, "api_error")
    assert err.message == "the engine's /v1/tokenize answered without a count"


LOADED = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def test_a_weight_load_sends_the_checkpoint_and_its_version_and_returns_sglangs_answer() -> None:
    answer, seen, _ = call(
        {"POST /update_weights_from_disk": (200, LOADED)}, "update_weights", "/ckpt/step-1", "step-1"
    )
    assert answer == LOADED
    assert seen == [("POST", "/update_weights_from_disk", {"model_path": "/ckpt/step-1", "weight_version": "step-1"})]
    _, seen, _ = call({"POST /update_weights_from_disk": (200, LOADED)}, "update_weights", "/ckpt/step-2")
    assert seen[-1][2] == {"model_path": "/ckpt/step-2"}  # no version: SGLang keeps its own


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({"success": False, "message": "Failed to get weights iterator: /ckpt/x not found"},
         "Failed to get weights iterator: /ckpt/x not found"),
        ({"message": "no success field"}, "no success field"),
        ({"success": False}, "None"),
        (["odd"], "['odd']"),
        ("loaded?", "loaded?"),
    ],
)  # fmt: skip
def test_a_refused_weight_load_names_the_checkpoint_and_sglangs_reason(answer: Any, reason: str) -> None:
    err, _, url = call({"POST /update_weights_from_disk": (200, answer)}, "update_weights", "/ckpt/x")
    assert isinstance(err, PolarError) and (err.status, err.kind) == (502, "api_error")
    assert err.message == f"engine {url} did not load /ckpt/x: {reason}"


def test_a_load_sglang_answers_with_an_http_error_keeps_its_words() -> None:
    refusal = (400, {"success": False, "message": "Failed to load /ckpt/x"})
    err, _, _ = call({"POST /update_weights_from_disk": refusal}, "update_weights", "/ckpt/x")
    assert isinstance(err, PolarError) and (err.status, err.kind, err.message) == (
        400,
        "invalid_request",
        "Failed to load /ckpt/x",
    )
