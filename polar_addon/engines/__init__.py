"""Inference engines: one module per engine, each turning a CanonicalRequest into a Completion.

Engines never know which provider the client spoke. ``polar_engine`` is a comma-separated list
of specs (polar_addon.engines.spec), e.g. ``sglang:http://gpu1:30000,sglang:http://gpu2:30000``
or ``vllm:http://127.0.0.1:8000`` or ``local:models/tiny``. A session sticks to one engine (its prefix cache
stays warm); new sessions go to the live engine with the fewest sessions; an engine that fails is taken out and
its sessions end as error (polar_addon.engines.affinity).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

from polar_addon.canonical import CanonicalRequest, Completion, EngineFault, PolarError
from polar_addon.continuity.delta import DeltaPrompt, NoDelta
from polar_addon.engines.affinity import MAX_SESSIONS, MAX_STRIKES, REVIVE_AFTER_S, Affinity, NoLiveEngine, SessionLost
from polar_addon.engines.spec import EngineSpec
from polar_addon.tool_parsers import ParserChoice

log = logging.getLogger("polar")


@dataclass(frozen=True)
class EngineSettings:
    """The proxy's options an engine takes at setup: how text it decodes itself is parsed into tool calls and
    reasoning (polar_tool_parser), and the served model's tokenizer for token input (polar_tokenizer; engines that
    decode with a model of their own ignore it)."""

    tool_parsers: ParserChoice = field(default_factory=ParserChoice)
    tokenizer_dir: str | None = None


class Engine(Protocol):
    """What the gateway asks of an engine. Setup, in this order at proxy start: ``configure`` (again whenever the
    proxy's options change), then ``load``."""

    name: str  # "kind:target", recorded as CaptureRecord.engine

    def configure(self, settings: EngineSettings) -> None:
        """Take the proxy's settings; called before ``load`` and whenever the options change while running."""

    def load(self) -> None:
        """Load what the engine runs in process (a model) now: a wrong path fails at proxy start, not on the first
        call, and the first call is not slow. Nothing to do for an engine served elsewhere. Raises PolarError."""

    async def complete(self, request: CanonicalRequest) -> Completion:
        """Generate one completion with exact prompt ids, sampled ids and their logprobs.

        Raises PolarError: 503 "overloaded" when the engine is unreachable, 504 "timeout",
        400 "context_length_exceeded" / "invalid_request" for content it cannot take,
        502 "api_error" for malformed engine answers.
        """

    async def count_tokens(self, request: CanonicalRequest) -> int:
        """Prompt token count of ``request`` under the engine's chat template."""

    async def close(self) -> None: ...


@runtime_checkable
class TokenInputEngine(Engine, Protocol):
    """An engine that samples after a prompt given as token ids (token continuity, polar_addon.continuity)."""

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        """Like ``complete``, but after exactly ``prompt_ids``; ``request`` gives the sampling parameters and tools.
        The engine parses nothing: tool calls and reasoning come from polar_tool_parser, whose failed blocks the
        Completion counts (``parse_failures``)."""

    def continuation(self, **kwargs: Any) -> DeltaPrompt | NoDelta:
        """The next prompt of a continuing session with the served model's tokenizer and template
        (continuity.delta.continuation_prompt's keyword arguments). Blocking: call off the event loop."""


def takes_token_input(engine: Engine) -> TypeGuard[TokenInputEngine]:
    """Whether ``engine`` samples after token ids. Only the gate (continuity.chains.token_input_engine) asks, on every
    call: ``isinstance`` against the runtime-checkable protocol walks all its members (~30 us), and ``engine`` is an
    Engine already, so its two token-input methods decide (as the protocol check does: present and not None)."""
    return all(callable(getattr(engine, name, None)) for name in _TOKEN_INPUT_METHODS)


_TOKEN_INPUT_METHODS = ("complete_tokens", "continuation")


def make_engine(spec: str | EngineSpec, *, timeout_s: float) -> Engine:
    parsed = spec if isinstance(spec, EngineSpec) else EngineSpec.parse(spec)
    if parsed.kind in ("sglang", "vllm"):
        from polar_addon.engines.sglang import SGLangEngine
        from polar_addon.engines.vllm import VLLMEngine

        engine = (
            SGLangEngine(parsed.target, timeout_s=timeout_s)
            if parsed.kind == "sglang"
            else VLLMEngine(
                parsed.target, timeout_s=timeout_s, token_versions=parsed.token_versions, model=parsed.model
            )
        )
        # vLLM never reports a version, SGLang only once update_weights_from_disk was given one (its own tag wins
        # over all but its placeholder ``default``): a loop that restarts vLLM on each checkpoint starts each
        # rollout's proxy with the version that server now holds.
        engine.weight_version = parsed.weight_version
        return engine
    if parsed.kind == "local":
        from polar_addon.engines.local import LocalEngine

        # weight_version: what a loop that restarts the proxy on each checkpoint tags its captures with.
        return LocalEngine(parsed.target, max_len=parsed.max_len, weight_version=parsed.weight_version)
    from polar_addon.engines.scripted import ScriptedEngine

    return ScriptedEngine(parsed.target)


class EnginePool:
    """The engines of one proxy, with each session sticky to one of them (rules: polar_addon.engines.affinity)."""

    def __init__(
        self,
        engines: list[Engine],
        *,
        max_strikes: int = MAX_STRIKES,
        revive_after_s: float = REVIVE_AFTER_S,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine is required")
        self.engines = engines
        self.affinity = Affinity(
            len(engines), max_strikes=max_strikes, revive_after_s=revive_after_s, max_sessions=max_sessions
        )

    @classmethod
    def from_spec(cls, spec: str, *, timeout_s: float = 900.0) -> EnginePool:
        return cls([make_engine(one, timeout_s=timeout_s) for one in EngineSpec.parse_list(spec)])

    def for_session(self, session_id: str) -> Engine:
        """The session's engine. Raises PolarError when its engine was taken out, or no engine is live."""
        try:
            return self.engines[self.affinity.engine_for(session_id, time.monotonic())]
        except SessionLost as exc:
            # Clients never learn where the engine lives: its name goes to the proxy log only.
            raise PolarError(
                502,
                "api_error",
                "the engine serving this session was taken out after failing; "
                "the session cannot go on (it is never moved to another engine mid-session)",
            ) from exc
        except NoLiveEngine as exc:
            raise PolarError(503, "overloaded", "every engine of this proxy is failing; retry later") from exc

    def configure(self, settings: EngineSettings) -> None:
        for engine in self.engines:
            engine.configure(settings)

    def load(self) -> None:
        for engine in self.engines:
            engine.load()

    def index(self, engine: Engine) -> int:
        return next(i for i, e in enumerate(self.engines) if e is engine)

    def succeeded(self, engine: Engine) -> None:
        self.affinity.succeeded(self.index(engine))

    def failed(self, engine: Engine, err: PolarError) -> list[str]:
        """Count ``err`` against ``engine`` if it is the engine's own fault; the sessions lost if it is taken out."""
        if not isinstance(err, EngineFault):
            return []  # busy, timeout or a request it cannot take: the engine is alive
        lost = self.affinity.failed(self.index(engine), time.monotonic(), refused=err.refused)
        if lost is None:
            return []
        log.warning(
            "polar: engine %s taken out (%s); %d session(s) on it end as error", engine.name, err.message, len(lost)
        )
        return lost

    def __len__(self) -> int:
        return len(self.affinity)

    def release(self, session_id: str) -> None:
        self.affinity.release(session_id)

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()
