"""Inference engines: one module per engine, each turning a CanonicalRequest into a Completion.

Engines never know which provider the client spoke. ``polar_engine`` is a comma-separated list
of specs, e.g. ``sglang:http://gpu1:30000,sglang:http://gpu2:30000`` or ``vllm:http://127.0.0.1:8000``
or ``local:models/tiny``. A session sticks to one engine (its prefix cache stays warm); new
sessions go to the engine with the fewest sessions.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from polar_addon.canonical import CanonicalRequest, Completion


class Engine(Protocol):
    name: str  # "kind:target", recorded as CaptureRecord.engine

    async def complete(self, request: CanonicalRequest) -> Completion:
        """Generate one completion with exact prompt ids, sampled ids and their logprobs.

        Raises PolarError: 503 "overloaded" when the engine is unreachable, 504 "timeout",
        400 "context_length_exceeded" / "invalid_request" for content it cannot take,
        502 "api_error" for malformed engine answers.
        """

    async def count_tokens(self, request: CanonicalRequest) -> int:
        """Prompt token count of ``request`` under the engine's chat template."""

    async def close(self) -> None: ...


def make_engine(spec: str, *, timeout_s: float) -> Engine:
    kind, _, target = spec.strip().partition(":")
    if not target:
        raise ValueError(f"engine spec {spec!r} must look like KIND:TARGET (sglang:URL, vllm:URL, local:MODEL_DIR)")
    if kind == "sglang":
        from polar_addon.engines.sglang import SGLangEngine

        return SGLangEngine(target, timeout_s=timeout_s)
    if kind == "vllm":
        from polar_addon.engines.vllm import VLLMEngine

        return VLLMEngine(target, timeout_s=timeout_s)
    if kind == "local":
        from polar_addon.engines.local import LocalEngine

        # local:DIR?max_len=N serves a smaller window than the model's own (long-session tests).
        model_dir, _, query = target.partition("?")
        options = dict(part.partition("=")[::2] for part in query.split("&") if part)
        unknown = set(options) - {"max_len"}
        if unknown:
            raise ValueError(f"engine spec {spec!r}: unknown option(s) {sorted(unknown)} (local takes max_len)")
        return LocalEngine(model_dir, max_len=int(options.get("max_len") or 0))
    if kind == "scripted":
        from polar_addon.engines.scripted import ScriptedEngine

        return ScriptedEngine(target)
    raise ValueError(f"unknown engine kind {kind!r} in {spec!r}: use sglang, vllm, local or scripted")


# A session forgotten here (idle while this many others started) only loses its engine affinity.
MAX_SESSIONS = 100_000


class EnginePool:
    """Session-sticky assignment of sessions to engines."""

    def __init__(self, engines: list[Engine], max_sessions: int = MAX_SESSIONS) -> None:
        if not engines:
            raise ValueError("at least one engine is required")
        self.engines = engines
        self.max_sessions = max_sessions
        # Most recently used last; sessions are released when they end, or forgotten oldest first.
        self._by_session: OrderedDict[str, int] = OrderedDict()
        self._load = [0] * len(engines)

    @classmethod
    def from_spec(cls, spec: str, *, timeout_s: float = 900.0) -> "EnginePool":
        return cls([make_engine(s, timeout_s=timeout_s) for s in spec.split(",") if s.strip()])

    def for_session(self, session_id: str) -> Engine:
        index = self._by_session.get(session_id)
        if index is None:
            index = min(range(len(self.engines)), key=lambda i: (self._load[i], i))
            self._by_session[session_id] = index
            self._load[index] += 1
            while len(self._by_session) > self.max_sessions:
                self.release(next(iter(self._by_session)))
        else:
            self._by_session.move_to_end(session_id)
        return self.engines[index]

    def __len__(self) -> int:
        return len(self._by_session)

    def release(self, session_id: str) -> None:
        index = self._by_session.pop(session_id, None)
        if index is not None:
            self._load[index] -= 1

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()
