"""engines.openai_compat beyond its measured halves (issue 29): what a token-level answer's stop string and an
answer's prompt-cache count become in the recorded Completion. SGLang names the stop string ``matched_stop`` on its
completions endpoint (vLLM ``stop_reason``); both engines report cached prompt tokens. No server: the parsers and the
answer builders are called on the engines' JSON."""

from __future__ import annotations

from typing import Any

import pytest

from polar_addon.canonical import CanonicalRequest
from polar_addon.engines.openai_compat import HTTPEngine, parse_chat_response, parse_completion_response

REQUEST = CanonicalRequest(api="openai_chat", model="client-name", messages=[{"role": "user", "content": "q"}])


def completion_answer(**choice: Any) -> dict[str, Any]:
    """A /v1/completions answer to a token prompt, with the choice's extra fields."""
    return {
        "object": "text_completion",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "done",
                "finish_reason": "stop",
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [7, 8],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                **choice,
            }
        ],
    }


@pytest.mark.parametrize(
    "stops,matched",
    [
        ({"matched_stop": "</answer>"}, "</answer>"),  # SGLang
        ({"stop_reason": "</answer>"}, "</answer>"),  # vLLM
        ({"matched_stop": "</answer>", "stop_reason": "STOP"}, "</answer>"),  # SGLang's own name first
        ({"matched_stop": 151645}, None),  # a stop token id (EOS), not a stop string
    ],
    ids=["sglang", "vllm", "both", "token_id"],
)
def test_a_token_answers_stop_string_is_recorded_under_either_engines_name(stops: dict, matched: str | None) -> None:
    engine = HTTPEngine("http://127.0.0.1:1")
    text, parsed = parse_completion_response(completion_answer(**stops))
    completion = engine.text_completion(REQUEST, text, parsed)
    assert (completion.matched_stop, completion.finish_reason, completion.message.content) == (matched, "stop", "done")


def test_a_token_answers_cached_prompt_tokens_reach_the_completion() -> None:
    engine = HTTPEngine("http://127.0.0.1:1")
    answer = completion_answer()
    answer["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}
    text, parsed = parse_completion_response(answer)
    completion = engine.text_completion(REQUEST, text, parsed)
    assert completion.cached_tokens == 2
    assert (completion.served_model, list(completion.prompt_ids), completion.response_ids) == (
        "tiny",
        [1, 2, 3],
        [7, 8],
    )


@pytest.mark.parametrize("cached", [0, 3])
def test_a_chat_answers_cache_count_reaches_the_completion_a_zero_too(cached: int) -> None:
    engine = HTTPEngine("http://127.0.0.1:1")
    answer = {
        "model": "tiny",
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": cached}},
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
                "token_ids": [7],
                "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]},
            }
        ],
    }
    completion = engine.chat_completion(REQUEST, parse_chat_response(answer))
    # 0 is a cache miss the engine reported, not an unknown count.
    assert completion.cached_tokens == cached
    assert (completion.message.content, completion.logprobs, completion.engine) == (
        "hi",
        [-0.5],
        "http:http://127.0.0.1:1",
    )


def test_an_answer_without_a_cache_count_records_none() -> None:
    engine = HTTPEngine("http://127.0.0.1:1")
    text, parsed = parse_completion_response(completion_answer())
    assert engine.text_completion(REQUEST, text, parsed).cached_tokens is None
