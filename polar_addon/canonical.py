"""The one request/response form every provider translates into and every engine consumes.

Messages follow OpenAI Chat Completions conventions because that is what SGLang and vLLM
apply their chat templates to:

- ``{"role": "system", "content": str}``: the leading system prompt (one, first, when present: every system text
  sent before the conversation starts, joined); Chat Completions clients may send more later, which stay in place
  (gptme's tool outputs; chat templates such as Qwen's render them where they are)
- ``{"role": "user", "content": str}``
- ``{"role": "assistant", "content": str | None, "reasoning_content": str (optional),
  "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}] (optional)}``
- ``{"role": "tool", "tool_call_id": str, "content": str}``

Tools are ``{"type": "function", "function": {"name", "description", "parameters"}}``.
This module has no I/O: providers build these, engines read them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

from polar_addon import context_compaction

# Engines sample greedily below this temperature (vLLM's _SAMPLING_EPS; SGLang's is 1e-6); polar records
# such a call as the greedy call it is, so a denormal temperature never reaches a division.
GREEDY_BELOW = 1e-5

# Canonical finish reasons (OpenAI's vocabulary); providers map them to their own.
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "abort"]


@dataclass
class SamplingParams:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 (or None): no top-k truncation
    min_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def effective_temperature(self) -> float:
        # The gateway fills every sampling parameter before a call reaches an engine (with_defaults);
        # engines called directly (tests, benches) sample at 1.0 when nothing was said.
        return 1.0 if self.temperature is None else float(self.temperature)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a call samples with when the client leaves a parameter out (addon options polar_temperature etc.).

    The untruncated distribution at T=1 by default: it is what the trainer recomputes, and it never
    depends on an engine's own fallback (SGLang and recent vLLM use the model's generation_config.json,
    Qwen3's is T=0.6, top_p 0.95, top_k 20, which would make every recorded value a guess).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"default temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"default top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"default top_k must be >= 0 (0: off), got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"default min_p must be in [0, 1], got {self.min_p!r}")


def with_defaults(sampling: SamplingParams, defaults: SamplingDefaults) -> SamplingParams:
    """Every parameter that shapes the sampled distribution made explicit, as the engine gets it and
    the record keeps it. A top_k of 0 or below (engines' spellings of "off") becomes 0; a temperature
    below GREEDY_BELOW becomes 0 (greedy), as the engines treat it."""
    top_k = defaults.top_k if sampling.top_k is None else max(int(sampling.top_k), 0)
    temperature = defaults.temperature if sampling.temperature is None else float(sampling.temperature)
    if 0 <= temperature < GREEDY_BELOW:
        temperature = 0.0
    return replace(
        sampling,
        temperature=temperature,
        top_p=defaults.top_p if sampling.top_p is None else float(sampling.top_p),
        top_k=top_k,
        min_p=defaults.min_p if sampling.min_p is None else float(sampling.min_p),
    )


@dataclass
class CanonicalRequest:
    api: str
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    # None: leave the chat template's default; True/False: chat_template_kwargs.enable_thinking.
    enable_thinking: bool | None = None
    # Provider details needed to answer in the provider's shape but not part of the prompt
    # (e.g. OpenAI stream_options.include_usage, Responses' previous_response_id).
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @cached_property
    def compaction_prompt(self) -> str | None:
        """Which harness's compaction call this is (context_compaction.compaction_prompt), found once: a session's
        continuity check asks it of every chain's request and of the new one, whose messages are never edited in
        place (a changed request is a new one), and a scan of a 32k-token message for each marker costs ~0.2 ms."""
        return context_compaction.compaction_prompt(self.messages)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanonicalRequest:
        data = dict(data)
        data["sampling"] = SamplingParams(**data.get("sampling") or {})
        return cls(**data)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text exactly as the model produced it


@dataclass
class AssistantMessage:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AssistantMessage:
        return cls(
            content=data.get("content"),
            reasoning=data.get("reasoning"),
            tool_calls=[ToolCall(**c) for c in data.get("tool_calls") or []],
        )


@dataclass(frozen=True)
class VersionSpan:
    """Response tokens ``[start, end)`` were sampled by weight version ``version``."""

    version: str
    start: int
    end: int


@dataclass
class Completion:
    """What an engine returns: the parsed message plus the exact tokens behind it."""

    message: AssistantMessage
    finish_reason: FinishReason
    prompt_ids: Sequence[int]  # a list; HTTP engines give an int32 array or the id text (token_ids.IdText)
    response_ids: list[int]
    logprobs: list[float]  # one per response token: log p(token) under the sampling temperature
    served_model: str
    engine: str  # which engine answered (e.g. "vllm:http://127.0.0.1:8000")
    matched_stop: str | None = None  # the stop string that ended generation, when one did
    weight_version: str | None = None  # the oldest version that sampled any of its tokens
    cached_tokens: int | None = None
    # Which version sampled which response tokens, where the engine says (vLLM's scale-out generate endpoint): more
    # than one span when new weights were pushed while it ran (polar loop --drain keep). None: not reported.
    weight_versions: list[VersionSpan] | None = None
    # Tool-call blocks polar's own parser (polar_tool_parser) could not read in this turn; None where the engine
    # parsed the text itself (SGLang's and vLLM's chat endpoints report no failures).
    parse_failures: int | None = None
    # Who produced message.tool_calls: "engine" (the engine's server parsed them, or a scripted turn gave them), a
    # polar_tool_parser name ("hermes", "qwen3_coder"), or an opt-in fallback ("fenced_json"); None: no calls.
    tool_call_parser: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.response_ids)


class PolarError(Exception):
    """An error with an HTTP status, rendered by each provider in its own shape.

    ``kind`` is canonical: invalid_request, request_too_large, authentication, not_found, context_length_exceeded,
    overloaded (engine down/busy: retryable), timeout, api_error, storage_unavailable.
    """

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class EngineFault(PolarError):
    """The engine itself failed: unreachable, or an HTTP 5xx other than busy. Counts toward taking it out of
    the proxy's pool (polar_addon.engines.affinity); ``refused``: nothing listens at its address."""

    def __init__(self, status: int, kind: str, message: str, *, refused: bool = False) -> None:
        super().__init__(status, kind, message)
        self.refused = refused


class ContextLengthExceeded(PolarError):
    """The prompt does not fit the served model's window: each provider words it the way its harness
    recognises (see the providers' ``render_error``). The counts are the engine's, when it said them."""

    def __init__(self, message: str, *, prompt_tokens: int | None = None, window: int | None = None) -> None:
        super().__init__(400, "context_length_exceeded", message)
        self.prompt_tokens = prompt_tokens
        self.window = window

    @property
    def counted(self) -> bool:
        return self.prompt_tokens is not None and self.window is not None
