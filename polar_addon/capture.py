"""Capture records: one per model call, the unit everything downstream reads.

A record holds the full (expanded) token arrays. The trace store may write prompts compactly
(a reference to the previous call plus a tail), but every reader hands back records with full
arrays, so nothing downstream ever sees the compact form.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from polar_addon.call_roles import DISCARDED, call_role
from polar_addon.canonical import CanonicalRequest, Completion


@dataclass(frozen=True)
class Identity:
    """Who a call belongs to. ``session_id`` is always set (generated when the client gave none)."""

    session_id: str
    task_id: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    # Where session_id came from: proxy_auth, header, api_key, generated.
    source: str = "generated"


@dataclass
class CaptureRecord:
    record_id: str
    session_id: str
    seq: int  # 0-based call number within the session, in the order the proxy received calls
    api: str  # openai_chat | anthropic_messages | openai_responses | gemini
    status: str  # "ok" or "failed"
    task_id: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    harness: str | None = None  # the client's User-Agent
    requested_model: str | None = None
    served_model: str | None = None
    engine: str | None = None
    started_at: float = 0.0  # unix seconds: request received by the proxy
    engine_latency_s: float | None = None
    finished_at: float = 0.0  # unix seconds: record made (before the response leaves the proxy)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: no top-k truncation
    min_p: float | None = None
    max_tokens: int | None = None
    # Readers always give a list. A record the gateway makes from an HTTP engine's answer holds an int32
    # array or the engine's own text of the ids (token_ids.IdText), never 32k Python ints.
    prompt_ids: Sequence[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | None = None
    weight_version: str | None = None
    # JSON text of the canonical request's messages / tools / tool_choice, and of the response message.
    messages_json: str = "[]"
    tools_json: str = "[]"
    tool_choice_json: str = "null"
    response_json: str = "null"
    error: str | None = None  # why a failed call failed
    # Where the engine prompt came from: "continuity" (previous prompt + sampled ids + the new messages' tokens)
    # or "fresh" (a full render), and why (continuity.chains: the divergence, "first_call", "state_lost", ...).
    prompt_source: str | None = None
    prompt_reason: str | None = None
    # Tool-call blocks in the response that polar's own parser (polar_tool_parser) could not read: > 0 is a failed
    # parse, which the build scores 0 but keeps trainable (polar_cli.build.rewards). None: the engine parsed the
    # text itself (SGLang's and vLLM's chat endpoints), or the record predates the field.
    parse_failures: int | None = None
    # Who produced the response's tool calls: "engine" (the engine's server, or a scripted turn), the polar_tool_parser
    # that decoded them ("hermes", "qwen3_coder"), or the opt-in fallback "fenced_json" (a call the model wrote as
    # fenced JSON). None: the response holds no tool call, or the record predates the field.
    tool_call_parser: str | None = None
    # What the call is for (polar_addon.call_roles): "agent", "auxiliary" (a harness's side job: title, classifier,
    # compaction, ...) or "discarded" (failed); role_reason names the side job or why. None: the record predates
    # the fields (readers decide it from the request then, polar_cli.build.roles).
    role: str | None = None
    role_reason: str | None = None
    # The engine's per-token versions (canonical.Completion.weight_versions) as JSON text; None: it gave none.
    weight_versions_json: str | None = None

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: asdict() deep-copies every token list (~50 ms for an 8k-token record).
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def messages(self) -> list[dict[str, Any]]:
        return orjson.loads(self.messages_json)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return orjson.loads(self.tools_json)

    @property
    def response_message(self) -> dict[str, Any] | None:
        return orjson.loads(self.response_json)


# A sampled token's log-probability is <= 0; engines round, so allow float noise above it.
LOGPROB_SLACK = 1e-4
# Below this the token could not have been sampled (e^-100 per token over a 10^6-token vocabulary is
# 1e-37): such a value is a sentinel (vLLM writes -9999.0 for -inf) or a numerical failure, and one
# of them makes exp(new - old) overflow in the trainer.
MIN_SAMPLED_LOGPROB = -100.0


def logprob_problem(logprobs: Sequence[float]) -> str | None:
    """Why ``logprobs`` cannot be the behaviour logprobs of sampled tokens, or None when they can."""
    # The common case in three C-speed passes (a NaN or an infinity makes the sum non-finite).
    if not logprobs or (
        math.isfinite(sum(logprobs)) and min(logprobs) >= MIN_SAMPLED_LOGPROB and max(logprobs) <= LOGPROB_SLACK
    ):
        return None
    for i, value in enumerate(logprobs):
        if not math.isfinite(value):
            return f"token {i} has logprob {value!r} (not finite)"
        if value > LOGPROB_SLACK:
            return f"token {i} has logprob {value!r} (> 0: not a log-probability)"
        if value < MIN_SAMPLED_LOGPROB:
            return f"token {i} has logprob {value!r} (below {MIN_SAMPLED_LOGPROB:g}: a sentinel, not a sampled token)"
    return None


def new_record_id() -> str:
    return uuid.uuid4().hex


def _request_fields(request: CanonicalRequest) -> dict[str, Any]:
    s = request.sampling
    return dict(
        requested_model=request.model,
        temperature=s.effective_temperature(),
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        messages_json=orjson.dumps(request.messages).decode(),
        tools_json=orjson.dumps(request.tools).decode(),
        tool_choice_json=orjson.dumps(request.tool_choice).decode(),
    )


def record_ok(
    *,
    identity: Identity,
    seq: int,
    request: CanonicalRequest,
    completion: Completion,
    harness: str | None,
    started_at: float,
    engine_latency_s: float,
    prompt_source: str | None = None,
    prompt_reason: str | None = None,
) -> CaptureRecord:
    role = call_role(request.messages, request.tools)
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=identity.session_id,
        task_id=identity.task_id,
        group_id=identity.group_id,
        sample_index=identity.sample_index,
        seq=seq,
        api=request.api,
        status="ok",
        harness=harness,
        served_model=completion.served_model,
        engine=completion.engine,
        started_at=started_at,
        engine_latency_s=engine_latency_s,
        finished_at=time.time(),
        prompt_ids=completion.prompt_ids,
        response_ids=completion.response_ids,
        logprobs=completion.logprobs,
        finish_reason=completion.finish_reason,
        matched_stop=completion.matched_stop,
        weight_version=completion.weight_version,
        response_json=orjson.dumps(completion.message).decode(),  # orjson writes dataclasses as asdict() would
        prompt_source=prompt_source,
        prompt_reason=prompt_reason,
        parse_failures=completion.parse_failures,
        tool_call_parser=completion.tool_call_parser,
        role=role.role,
        role_reason=role.reason,
        weight_versions_json=None
        if completion.weight_versions is None
        else orjson.dumps(completion.weight_versions).decode(),
        **_request_fields(request),
    )


def record_failed(
    *,
    identity: Identity,
    seq: int,
    api: str,
    request: CanonicalRequest | None,
    error: str,
    harness: str | None,
    started_at: float,
    engine: str | None = None,
) -> CaptureRecord:
    """A failed call is recorded (so no call disappears) but never becomes training data. ``engine``: the
    engine it was sent to, if it got that far."""
    fields = _request_fields(request) if request is not None else {}
    return CaptureRecord(
        record_id=new_record_id(),
        session_id=identity.session_id,
        task_id=identity.task_id,
        group_id=identity.group_id,
        sample_index=identity.sample_index,
        seq=seq,
        api=api,
        status="failed",
        harness=harness,
        started_at=started_at,
        finished_at=time.time(),
        error=error,
        engine=engine,
        role=DISCARDED.role,
        role_reason=DISCARDED.reason,
        **fields,
    )
