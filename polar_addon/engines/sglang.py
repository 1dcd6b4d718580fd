"""SGLang (0.5.23) through its OpenAI-compatible server.

The request asks for every token-id extra 0.5.23 knows (``return_token_ids``,
``return_prompt_token_ids``, ``return_meta_info``); older and newer SGLang builds answer with
differently named fields, all of which ``parse_chat_response`` reads. Logprobs are
log_softmax(logits / T) of the sampled token, not renormalised for top-p/top-k (SGLang's
sampler), unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.

Token input (continuity.chains, once ``polar_tokenizer`` names the served model's tokenizer): ``/v1/completions``
with the prompt as token ids. SGLang 0.5.23's ``CompletionRequest`` takes ``prompt: List[int]`` (passed on as
``GenerateReqInput.input_ids``) and ``return_token_ids``, which answers with ``choices[0].prompt_token_ids`` (the
ids after tokenization: the given ones) and ``choices[0].token_ids`` (``output_ids``); ``logprobs: 0`` sets
``return_logprob`` with no alternatives, one ``logprobs.token_logprobs`` entry per sampled token, the same
values as the chat endpoint's ``meta_info.output_token_logprobs``. ``metadata.weight_version`` names the
weights. (The native ``/generate`` takes ``input_ids`` too, but its request class, ``io_struct.GenerateReqInput``,
cannot be loaded without torch and most of SGLang, so no contract test could hold it to the wire format; this
endpoint's classes can, and its errors are the ``ErrorResponse`` already read.)
"""

from __future__ import annotations

from typing import Any

from polar_addon.canonical import CanonicalRequest, Completion, PolarError
from polar_addon.engines.openai_compat import HTTPEngine


class SGLangEngine(HTTPEngine):
    kind = "sglang"

    def extra_body(self) -> dict[str, Any]:
        return {"return_token_ids": True, "return_prompt_token_ids": True, "return_meta_info": True}

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        """Token input: ``/v1/completions`` with the prompt as token ids (HTTPEngine.complete_prompt_ids)."""
        return await self.complete_prompt_ids(request, prompt_ids, logprobs=0)

    async def count_tokens(self, request: CanonicalRequest) -> int:
        """SGLang's ``POST /v1/tokenize`` with messages renders them as for a chat completion."""
        body: dict[str, Any] = {"model": await self.served_model(), "messages": request.messages}
        if request.tools:
            body["tools"] = request.tools
        if request.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": request.enable_thinking}
        data = await self.request_json("POST", "/v1/tokenize", body)
        count = data.get("count") if isinstance(data, dict) else None
        if not isinstance(count, int):
            raise PolarError(502, "api_error", "the engine's /v1/tokenize answered without a count")
        return count

    async def update_weights(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        """Load new weights in place (``POST /update_weights_from_disk``); in-flight requests finish first.

        ``weight_version`` becomes ``meta_info.weight_version`` of every later completion, so
        captured turns say which policy sampled them. Raises PolarError when SGLang refuses.
        """
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        data = await self.request_json("POST", "/update_weights_from_disk", body)
        if not isinstance(data, dict) or not data.get("success"):
            message = data.get("message") if isinstance(data, dict) else data
            raise PolarError(502, "api_error", f"engine {self.url} did not load {model_path}: {message}")
        return data
