"""In-process transformers engine (``local:MODEL_DIR``): CPU, float32, one generation at a time.

Meant for tests, the demo and small models. It tokenizes like vLLM and SGLang do (chat template
rendered to text, then encoded without extra special tokens) and samples with its own loop so that
every detail the record depends on is explicit:

- logprobs are log_softmax(logits / T) of the sampled token, taken before top-k/top-p filtering
  (what SGLang reports and the trainer recomputes); greedy (T = 0) reports T = 1 values;
- a request ``seed`` seeds a private generator, so equal requests give equal tokens;
- an EOS id (generation_config + tokenizer) ends the turn and is kept in ``response_ids``;
- a stop string ends the turn with ``matched_stop`` set; as in vLLM, ``response_ids`` keep every
  sampled token (the stop string's tokens included) while the message text is cut before it.

Generation runs in a worker thread under a lock, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_addon.canonical import CanonicalRequest, Completion, ContextLengthExceeded, PolarError, SamplingParams
from polar_addon.continuity.delta import DeltaPrompt, NoDelta, continuation_prompt
from polar_addon.tool_parsers import ParserChoice

if TYPE_CHECKING:
    from polar_addon.engines import EngineSettings

log = logging.getLogger("polar")

DEFAULT_MAX_TOKENS = 256


def served_window(native: int | None, max_len: int) -> int | None:
    """The window served: the model's own (``max_position_embeddings``), lowered to ``max_len`` when one is given."""
    if native and max_len:
        return min(native, max_len)
    return native or max_len or None


class LocalEngine:
    kind = "local"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_len: int = 0,
        weight_version: str | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.name = f"{self.kind}:{self.model_dir}"
        # A served window smaller than the model's own (vLLM's --max-model-len): long-session tests
        # overflow it in a few turns. 0: the model's max_position_embeddings.
        self.max_len_override = max_len
        self.default_max_tokens = default_max_tokens
        self.weight_version = weight_version
        # How sampled text becomes content, reasoning and tool calls (polar_tool_parser).
        self.tool_parsers = ParserChoice()
        # Tokenizers and the model are not safe to share across threads: every use holds the lock.
        self.lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_ids: set[int] = set()
        self._max_len = 0

    # --- loading -------------------------------------------------------------------------

    def _ensure_loaded(self) -> None:
        if self._model is None:
            self._load(self.model_dir)

    def configure(self, settings: EngineSettings) -> None:
        self.tool_parsers = settings.tool_parsers  # its tokenizer is the model's own: tokenizer_dir is not for it

    def load(self) -> None:
        """Load the model now (the proxy does at start) instead of on the first call."""
        with self.lock:
            if self._model is not None:
                return
            log.warning("polar: loading the %s engine's model ...", self.name)
            started = time.monotonic()
            self._ensure_loaded()
            log.warning("polar: %s loaded in %.1f s", self.name, time.monotonic() - started)

    def _load(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(model_dir, "config.json").is_file():
            raise PolarError(503, "overloaded", f"local engine: no model at {model_dir}")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        eos: set[int] = set()
        configured = model.generation_config.eos_token_id if model.generation_config else None
        for value in configured if isinstance(configured, list) else [configured]:
            if value is not None:
                eos.add(int(value))
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self._tokenizer, self._model, self._eos_ids = tokenizer, model, eos
        native = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self._max_len = served_window(native, self.max_len_override) or 0

    def reload(self, model_dir: str | Path, weight_version: str | None = None) -> None:
        """Swap in new weights (e.g. a training checkpoint); later completions carry ``weight_version``."""
        with self.lock:
            self._load(str(model_dir))
            self.model_dir = str(model_dir)
            self.weight_version = weight_version

    @property
    def served_model(self) -> str:
        return Path(self.model_dir).name

    # --- tokenization (call with the lock held) -----------------------------------------------

    def render_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        enable_thinking: bool | None,
    ) -> list[int]:
        """Chat template -> text -> ids, the way vLLM and SGLang tokenize a chat request."""
        return self.encode(
            self.render_text(
                messages, tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
            )
        )

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        enable_thinking: bool | None,
    ) -> str:
        self._ensure_loaded()
        kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # jinja raises its own errors for messages the template rejects
            raise PolarError(400, "invalid_request", f"chat template failed: {exc}") from exc
        return text

    def prompt_ids(self, request: CanonicalRequest) -> list[int]:
        return self.render_ids(
            request.messages, request.tools, add_generation_prompt=True, enable_thinking=request.enable_thinking
        )

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        self._ensure_loaded()
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own, special tokens included (SGLang's logprob token texts)."""
        self._ensure_loaded()
        return self._tokenizer.batch_decode([[i] for i in ids])

    @property
    def eos_ids(self) -> set[int]:
        self._ensure_loaded()
        return self._eos_ids

    def token_id(self, token: str) -> int:
        self._ensure_loaded()
        return int(self._tokenizer.convert_tokens_to_ids(token))

    def check_context(self, prompt_len: int) -> None:
        if self._max_len and prompt_len >= self._max_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self._max_len} tokens. "
                f"However, your prompt contains {prompt_len} input tokens.",
                prompt_tokens=prompt_len,
                window=self._max_len,
            )

    # --- model (call with the lock held) -----------------------------------------------------

    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
        """Teacher-forced log_softmax(logits / T) of ``response_ids`` after ``prompt_ids`` (T = 0 -> 1)."""
        import torch

        self._ensure_loaded()
        if not response_ids:
            return []
        scale = temperature if temperature > 0 else 1.0
        ids = torch.tensor([prompt_ids + response_ids])
        with torch.inference_mode():
            logits = self._model(input_ids=ids, logits_to_keep=len(response_ids) + 1).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / scale, dim=-1)
        target = torch.tensor(response_ids)
        return logprobs.gather(1, target[:, None])[:, 0].tolist()

    def sample(
        self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int
    ) -> tuple[list[int], list[float], str, str | None, str]:
        """Sample up to ``max_tokens``; return (ids, logprobs, finish_reason, matched_stop, text)."""
        import torch

        self._ensure_loaded()
        temperature = sampling.effective_temperature()
        generator = torch.Generator()
        generator.manual_seed(sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little"))
        stops = [s for s in sampling.stop if s]
        ids: list[int] = []
        logprobs: list[float] = []
        with torch.inference_mode():
            out = self._model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
            for _ in range(max_tokens):
                logits = out.logits[0, -1].float()
                if temperature <= 0:
                    log_probs = torch.log_softmax(logits, dim=-1)
                    token = int(torch.argmax(logits))
                else:
                    scaled = logits / temperature
                    log_probs = torch.log_softmax(scaled, dim=-1)
                    probs = torch.softmax(
                        _filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p, sampling.min_p), dim=-1
                    )
                    token = int(torch.multinomial(probs, 1, generator=generator))
                ids.append(token)
                logprobs.append(float(log_probs[token]))
                if token in self._eos_ids:
                    return ids, logprobs, "stop", None, self.decode(ids)
                if stops:
                    text = self.decode(ids)
                    hits = [(text.find(s), s) for s in stops if s in text]
                    if hits:
                        at, matched = min(hits)
                        return ids, logprobs, "stop", matched, text[:at]
                out = self._model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
        return ids, logprobs, "length", None, self.decode(ids)

    # --- Engine protocol ----------------------------------------------------------------------

    def continuation(self, **kwargs: Any) -> DeltaPrompt | NoDelta:
        """The next prompt of a continuing session (continuity.delta.continuation_prompt with this model's
        tokenizer and template)."""
        with self.lock:
            self._ensure_loaded()
            return continuation_prompt(self._tokenizer, **kwargs)

    def _complete_sync(self, request: CanonicalRequest, given_prompt: list[int] | None = None) -> Completion:
        sampling = request.sampling
        if sampling.temperature is not None and sampling.temperature < 0:
            raise PolarError(400, "invalid_request", "temperature must be >= 0")
        max_tokens = self.default_max_tokens if sampling.max_tokens is None else sampling.max_tokens
        if max_tokens < 1:
            raise PolarError(400, "invalid_request", "max_tokens must be at least 1")
        with self.lock:
            prompt_ids = self.prompt_ids(request) if given_prompt is None else list(given_prompt)
            self.check_context(len(prompt_ids))
            if self._max_len:
                max_tokens = min(max_tokens, self._max_len - len(prompt_ids))
            ids, logprobs, finish, matched, text = self.sample(prompt_ids, sampling, max_tokens)
            weight_version = self.weight_version
        turn = self.tool_parsers.for_model(self.served_model)(text, request.tools)
        message = turn.message
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        return Completion(
            message=message,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_ids=prompt_ids,
            response_ids=ids,
            logprobs=logprobs,
            served_model=self.served_model,
            engine=self.name,
            matched_stop=matched,
            weight_version=weight_version,
            parse_failures=len(turn.failed),
            tool_call_parser=turn.parser,
        )

    async def complete(self, request: CanonicalRequest) -> Completion:
        return await asyncio.to_thread(self._complete_sync, request)

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        """Sample after exactly ``prompt_ids`` (token input); ``request`` gives the sampling parameters."""
        return await asyncio.to_thread(self._complete_sync, request, prompt_ids)

    def _count_sync(self, request: CanonicalRequest) -> int:
        with self.lock:
            return len(self.prompt_ids(request))

    async def count_tokens(self, request: CanonicalRequest) -> int:
        return await asyncio.to_thread(self._count_sync, request)

    async def close(self) -> None:
        with self.lock:
            self._model = None
            self._tokenizer = None


def _filter_top_k_top_p(scaled: Any, top_k: int | None, top_p: float | None, min_p: float | None = None) -> Any:
    """Mask logits outside the top-k / nucleus / min-p set (sampling only; recorded logprobs stay unfiltered)."""
    import torch

    if min_p is not None and min_p > 0:
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p)
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(min_p), float("-inf"))

    if top_k is not None and 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first token always stays.
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scaled
