"""engines.openai_compat's answer builders (issue 29 audit): a text completion from an engine that has not read its
served model yet is recorded under the model the request named, as a chat answer is."""

from __future__ import annotations

from polar_addon.canonical import CanonicalRequest
from polar_addon.engines.openai_compat import parse_completion_response
from polar_addon.engines.vllm import VLLMEngine


def _completion_answer() -> dict:
    """A vLLM /v1/completions answer to a token prompt that names no model."""
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "The answer.",
                "finish_reason": "stop",
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [7, 8],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
            }
        ],
    }


def test_a_text_completion_without_a_served_model_is_recorded_under_the_requested_model() -> None:
    engine = VLLMEngine("http://127.0.0.1:1")
    assert engine._model is None  # no /v1/models read yet
    request = CanonicalRequest(
        api="openai_chat", model="the-requested-model", messages=[{"role": "user", "content": "q"}]
    )
    text, parsed = parse_completion_response(_completion_answer())
    completion = engine.text_completion(request, text, parsed)
    assert completion.served_model == "the-requested-model"
    assert (completion.message.content, completion.response_ids, completion.logprobs) == (
        "The answer.",
        [7, 8],
        [-0.5, -0.25],
    )
    assert completion.finish_reason == "stop" and completion.parse_failures == 0
