"""Token continuity on real vLLM through a real mitmdump: multi-turn chat sessions from the official openai and
anthropic SDKs on the ending model (tests/support/ending_model.py, whose answers end at ``<|im_end|>``), what vLLM
itself answered (a recording forwarder between the proxy and vLLM), and first-step importance ratios of the built
traces. Shared by tests/test_tito_vllm_sessions.py and bench/continuity.py --vllm."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from polar_addon.capture import CaptureRecord
from polar_cli.trace import Trace
from tests.support.slow_forwarder import Exchange
from tests.support.tito_sessions import ANTHROPIC_TOOLS, TOOLS

TEMPERATURE = 0.6  # Qwen3's recommended temperature, set by the client; top_p/top_k left to polar (1 and off)
# Far above the ending model's answers (1-27 tokens measured): a turn cut by length would end the chain.
MAX_TOKENS = 256
SYSTEM = "You are a file assistant."


def _http(proxy: Any, session: str) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )


def openai_chat(proxy: Any, session: str, *, user_turns: int, seed: int = 0) -> None:
    """A chat of ``user_turns`` questions; each answer goes back as the SDK returned it."""
    client = openai.OpenAI(api_key="sk-not-a-real-key", http_client=_http(proxy, session), max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(user_turns):
        messages.append({"role": "user", "content": f"What does file {turn} say?"})
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
            seed=seed + turn,
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def anthropic_chat(proxy: Any, session: str, *, user_turns: int) -> None:
    """The same through the Messages API (no seed there: vLLM samples with its own)."""
    client = anthropic.Anthropic(api_key="sk-ant-not-real", http_client=_http(proxy, session), max_retries=0)
    messages: list[dict[str, Any]] = []
    for turn in range(user_turns):
        messages.append({"role": "user", "content": f"What does file {turn} say?"})
        reply = client.messages.create(
            model="tiny",
            max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
            system=SYSTEM,
            messages=messages,
            tools=ANTHROPIC_TOOLS,
        )
        blocks = [b.model_dump(exclude_none=True) for b in reply.content]
        # An answer that is only <|im_end|> has no text block; the Messages API refuses an empty assistant turn.
        messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})


def engine_answers(exchanges: Sequence[Exchange]) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, sampled ids, sampled logprobs) of every generation, as vLLM reported them, in call order."""
    out = []
    for ex in exchanges:
        if ex.path == "/v1/chat/completions":
            choice = ex.response["choices"][0]
            logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
            out.append((ex.response["prompt_token_ids"], choice["token_ids"], logprobs))
        elif ex.path == "/v1/completions":
            choice = ex.response["choices"][0]
            assert choice["prompt_token_ids"] == ex.request["prompt"], "vLLM sampled after other ids than polar sent"
            out.append((choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def trainer_logprobs(model_dir: Path) -> Callable[[Trace], list[float]]:
    """``fn(trace)``: the logprob of every completion token as polar's trainer computes it on its first step: the
    model loaded as TraceGRPOTrainer loads it (fp32 parameters, ``model_init_kwargs={"dtype": torch.float32}``),
    compute in fp32 (``--dtype auto`` without a GPU), one forward over prompt + completion, TRL's
    ``selective_log_softmax`` of logits / T (``_get_per_token_logps_and_entropies``)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def compute(trace: Trace) -> list[float]:
        ids = torch.tensor([list(trace.prompt_ids) + list(trace.completion_ids)])
        keep = len(trace.completion_ids)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[:, -keep - 1 : -1, :] / trace.temperature
        return selective_log_softmax(logits, ids[:, -keep:])[0].tolist()

    return compute


@dataclass
class RatioFigures:
    tokens: int  # trainable (loss-mask 1) tokens
    min: float  # of exp(trainer logprob - behaviour logprob) over them
    max: float
    mean_abs_dev: float  # mean |ratio - 1|

    @property
    def max_abs_dev(self) -> float:
        return max(1 - self.min, self.max - 1)


def first_step_ratios(traces: Sequence[Trace], logprobs: Callable[[Trace], list[float]]) -> RatioFigures:
    """pi_theta / pi_behaviour of every trainable token before any update: 1 where the trace is what was sampled."""
    import math

    ratios: list[float] = []
    for trace in traces:
        mine = logprobs(trace)
        ratios += [math.exp(a - b) for a, b, m in zip(mine, trace.behavior_logprobs, trace.loss_mask) if m]
    return RatioFigures(len(ratios), min(ratios), max(ratios), sum(abs(r - 1) for r in ratios) / len(ratios))


def full_render_delta(tokenized: list[int], end_id: int, prefix_ends: int) -> list[int]:
    """The ids of a full render after its ``prefix_ends``-th end-of-turn token: what the continuation's delta must
    be where the template renders the new messages the same after any history."""
    seen = 0
    for i, tok in enumerate(tokenized):
        seen += tok == end_id
        if seen == prefix_ends:
            return tokenized[i + 1 :]
    raise AssertionError(f"the full render has fewer than {prefix_ends} end-of-turn tokens")


def by_session(records: Sequence[CaptureRecord]) -> dict[str, list[CaptureRecord]]:
    out: dict[str, list[CaptureRecord]] = {}
    for record in sorted(records, key=lambda r: (r.session_id, r.seq)):
        out.setdefault(record.session_id, []).append(record)
    return out
