"""The capture gateway: one intercepted provider call in, one provider-shaped reply out.

No mitmproxy here: the addon hands over method, path, headers, body and identity, and sends back
what :meth:`Gateway.handle` returns. A reply is either complete (:class:`FullReply`, sent with
``Response.make``) or a live stream (:class:`StreamReply`) that the addon relays through a small
loopback server, so a slow engine can keep the client's idle timer alive with the provider's own
keep-alive events while it works.

Every model call is recorded: the record is durable (journal fsync) before the first byte of the
answer leaves; a call whose record cannot be persisted is answered with a 503 instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from polar_addon.canonical import (
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    PolarError,
    SamplingDefaults,
    with_defaults,
)
from polar_addon.capture import Identity, logprob_problem, record_failed, record_ok
from polar_addon.continuity.chains import (
    FRESH,
    NO_TOKEN_INPUT,
    TITO_OFF,
    ChainTip,
    PromptPlan,
    TitoStore,
    judge,
    plan_prompt,
    token_input_engine,
)
from polar_addon.continuity.check import Continues
from polar_addon.engines import EnginePool, TokenInputEngine
from polar_addon.harness_id import harness_name
from polar_addon.providers import Provider, ResponseContext, Route, all_providers, encode_sse
from polar_addon.store import StorageUnavailable, TraceStore

log = logging.getLogger("polar")

# Bounds on the per-session memory of sampled tool-call arguments (see _restore_sampled_arguments).
MAX_REMEMBERED_SESSIONS = 10_000
MAX_REMEMBERED_CALLS = 256
# A session forgotten here (idle while 200k others started) and then seen again gets a second "running"
# row, whose later started_at wins; its calls and rewards are untouched.
MAX_SEEN_SESSIONS = 200_000
# orjson writes at most 254 levels; tools, schemas and messages are re-serialized into records, and the
# translators walk them recursively. No real request comes near this.
MAX_JSON_DEPTH = 128
# Bodies larger than this are read and translated on a worker thread.
PARSE_OFF_LOOP_BYTES = 256 * 1024
# The sampling parameters a fixed-sampling proxy (GatewayConfig.sampling_fixed) takes from its options, never from
# the client.
_POLICY_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")


@dataclass
class GatewayConfig:
    keepalive_s: float = 5.0  # first keep-alive after this long without an answer, then every keepalive_s
    max_body_bytes: int = 16 * 1024 * 1024  # polar_max_body_mb's default
    max_tokens_cap: int = 0  # 0: no cap; else clamp (and fill in) max_tokens
    # What a call samples with where the client said nothing; sent to the engine and recorded.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # True: the defaults apply to every call, whatever the client asks (rollouts: the agent under training must not
    # choose how it is sampled; one greedy or top-p call would make `polar train` refuse the whole batch, and a fixed
    # seed would collapse a group's samples into one).
    sampling_fixed: bool = False
    # Token continuity across a session's turns (continuity.chains.tito_mode): auto | on | off.
    tito: str = "auto"


@dataclass
class FullReply:
    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass
class StreamReply:
    status: int
    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream"


@dataclass
class IncomingCall:
    method: str
    path: str  # with query string
    headers: dict[str, str]  # lower-case names
    body: bytes
    identity: Identity
    host: str = ""
    started_at: float = field(default_factory=time.time)


def _json(status: int, payload: Any) -> FullReply:
    return FullReply(status, orjson.dumps(payload))


def _canonical_arguments(text: str) -> str:
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS).decode()
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # not JSON, or nested past what orjson writes
        return text


def _json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, counted up to ``limit + 1`` (level by level: no recursion limit, and no
    tuple per node, which cost 194 us on a harness-sized body: 59 us now)."""
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > limit:
            return depth
        below: list[Any] = []
        keep = below.append
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    keep(child)
        level = below
    return depth


def _printable_headers(headers: dict[str, str]) -> dict[str, str]:
    """Header values as valid UTF-8 text: mitmproxy hands non-UTF-8 bytes over as lone surrogates, which
    no JSON encoder writes (a User-Agent lands in every record)."""
    clean = {}
    for name, value in headers.items():
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        clean[name] = value
    return clean


def _response_id(provider: Provider) -> str:
    prefix = {"anthropic_messages": "msg_", "openai_responses": "resp_", "gemini": ""}.get(provider.name, "chatcmpl-")
    return prefix + uuid.uuid4().hex[:24]


class Gateway:
    def __init__(
        self,
        pool: EnginePool,
        store: TraceStore,
        config: GatewayConfig | None = None,
        providers: list[Provider] | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.config = config or GatewayConfig()
        self.providers = providers if providers is not None else all_providers()
        # Sessions that already have their "running" row, most recent last (bounded: a fleet proxy runs for days).
        self._seen_sessions: OrderedDict[str, None] = OrderedDict()
        # session -> {(tool name, canonical arguments): arguments text exactly as sampled}
        self._sampled_arguments: OrderedDict[str, OrderedDict[tuple[str, str], str]] = OrderedDict()
        self.tito = TitoStore()

    def match(self, method: str, path: str) -> tuple[Provider, Route] | None:
        for provider in self.providers:
            route = provider.route(method, path)
            if route is not None:
                return provider, route
        return None

    def owns(self, method: str, path: str) -> bool:
        """Whether ``handle`` answers this request (a provider route). Rewards and statuses are not
        here: they need the control token (polar_addon.control)."""
        return self.match(method, path) is not None

    def error_reply(self, method: str, path: str, err: PolarError) -> FullReply:
        """``err`` in the shape of the provider that owns ``path`` (a generic one elsewhere)."""
        matched = self.match(method, path)
        if matched is None:
            return _json(err.status, {"error": {"type": err.kind, "message": err.message}})
        return _json(err.status, matched[0].render_error(err))

    async def handle(self, call: IncomingCall) -> FullReply | StreamReply:
        """Never raises: whatever goes wrong, the caller gets an answer in its provider's shape.

        An exception escaping here would make mitmproxy forward the request upstream, real API key
        included and unrecorded (issue 11).
        """
        call = replace(call, headers=_printable_headers(call.headers))
        try:
            return await self._handle(call)
        except Exception as exc:
            log.exception("polar: unexpected error answering %s %s", call.method, call.path.split("?", 1)[0])
            err = PolarError(500, "api_error", f"polar internal error ({type(exc).__name__})")
            matched = self.match(call.method, call.path)
            if matched is not None:
                await self._record_failure(call, matched[0].name, None, err)
            return self.error_reply(call.method, call.path, err)

    async def _handle(self, call: IncomingCall) -> FullReply | StreamReply:
        matched = self.match(call.method, call.path)
        if matched is None:
            return _json(
                404,
                {"error": {"type": "not_found", "message": f"polar: no provider route for {call.method} {call.path}"}},
            )
        provider, route = matched
        if route.kind == "local":
            return _json(route.params.get("status", 200), route.params.get("body", {}))
        try:
            if len(call.body) > PARSE_OFF_LOOP_BYTES:
                # A multi-megabyte body takes seconds to read and translate: not on the event loop.
                request = await asyncio.to_thread(self._parse, provider, route, call)
            else:
                request = self._parse(provider, route, call)
        except PolarError as err:
            # Unparseable input is still a call the harness made: record it as failed.
            await self._record_failure(call, provider.name, None, err)
            return _json(err.status, provider.render_error(err))
        if route.kind == "count_tokens":
            try:
                count = await self.pool.for_session(call.identity.session_id).count_tokens(request)
            except PolarError as err:
                return _json(err.status, provider.render_error(err))
            return _json(200, provider.render_count_tokens(count))
        return await self._generate(provider, request, call)

    def _parse(self, provider: Provider, route: Route, call: IncomingCall) -> CanonicalRequest:
        if len(call.body) > self.config.max_body_bytes:
            raise PolarError(
                413,
                "request_too_large",
                f"request body of {len(call.body)} bytes exceeds the proxy limit of {self.config.max_body_bytes}",
            )
        try:
            body = orjson.loads(call.body) if call.body else None
        except orjson.JSONDecodeError as exc:
            raise PolarError(400, "invalid_request", f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise PolarError(400, "invalid_request", "request body must be a JSON object")
        depth = _json_depth(body, MAX_JSON_DEPTH)
        if depth > MAX_JSON_DEPTH:
            raise PolarError(400, "invalid_request", f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        route = replace(route, session=call.identity.session_id, body_bytes=len(call.body))
        try:
            request = provider.parse_request(body, route)
        except PolarError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as exc:
            # The translator met a shape it does not expect: the input is at fault, say so in a 400.
            log.info("polar: %s could not read a request: %s: %s", provider.name, type(exc).__name__, exc)
            raise PolarError(
                400, "invalid_request", f"request could not be read ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        if self.config.sampling_fixed:
            asked = {
                k: getattr(request.sampling, k) for k in _POLICY_SAMPLING if getattr(request.sampling, k) is not None
            }
            if asked:
                request.extra["client_sampling"] = asked
            request.sampling = replace(request.sampling, **dict.fromkeys(_POLICY_SAMPLING))
        request.sampling = with_defaults(request.sampling, self.config.sampling_defaults)
        cap = self.config.max_tokens_cap
        if cap > 0:
            current = request.sampling.max_tokens
            request.extra["client_max_tokens"] = current
            request.sampling.max_tokens = cap if current is None else min(current, cap)
        self._restore_sampled_arguments(call.identity.session_id, request)
        return request

    def _restore_sampled_arguments(self, session: str, request: CanonicalRequest) -> None:
        """Give tool-call arguments in the history back the exact text the model sampled.

        Anthropic and Gemini clients echo tool inputs as JSON objects, which the provider must
        re-serialize; a different spacing would change the re-rendered prompt and break the token
        prefix that trajectory merging needs. Same JSON value, same text as sampled.
        """
        known = self._sampled_arguments.get(session)
        if not known:
            return
        for message in request.messages:
            for call in message.get("tool_calls") or []:
                fn = call.get("function") or {}
                text = known.get((fn.get("name"), _canonical_arguments(fn.get("arguments") or "")))
                if text is not None:
                    fn["arguments"] = text

    def _remember_sampled_arguments(self, session: str, completion: Completion) -> None:
        if not completion.message.tool_calls:
            return
        known = self._sampled_arguments.setdefault(session, OrderedDict())
        self._sampled_arguments.move_to_end(session)
        for call in completion.message.tool_calls:
            known[(call.name, _canonical_arguments(call.arguments))] = call.arguments
        while len(known) > MAX_REMEMBERED_CALLS:
            known.popitem(last=False)
        while len(self._sampled_arguments) > MAX_REMEMBERED_SESSIONS:
            self._sampled_arguments.popitem(last=False)

    async def _generate(
        self, provider: Provider, request: CanonicalRequest, call: IncomingCall
    ) -> FullReply | StreamReply:
        ctx = ResponseContext(response_id=_response_id(provider), created=int(call.started_at), model=request.model)
        try:
            self.store.check_writable()
        except StorageUnavailable as exc:
            err = PolarError(
                503, "storage_unavailable", f"polar cannot persist captured calls right now ({exc}); retry later"
            )
            return _json(err.status, provider.render_error(err))
        task = asyncio.ensure_future(self._complete_and_record(provider, request, call))
        if not request.stream:
            try:
                completion = await task
            except PolarError as err:
                return _json(err.status, provider.render_error(err))
            return _json(200, provider.render_response(request, completion, ctx))
        done, _ = await asyncio.wait({task}, timeout=self.config.keepalive_s)
        if done:
            try:
                completion = task.result()
            except PolarError as err:
                if err.kind == "context_length_exceeded" and getattr(provider, "overflow_in_stream", False):
                    body = b"".join(encode_sse(e) for e in provider.render_stream_error(err, ctx))
                    return FullReply(200, body, "text/event-stream")
                return _json(err.status, provider.render_error(err))
            body = b"".join(encode_sse(e) for e in provider.render_stream(request, completion, ctx))
            return FullReply(200, body, "text/event-stream")
        return StreamReply(200, self._stream(provider, request, ctx, task))

    async def _stream(
        self, provider: Provider, request: CanonicalRequest, ctx: ResponseContext, task: asyncio.Future[Completion]
    ) -> AsyncIterator[bytes]:
        # Headers are already out: keep the client alive until the (persisted) answer is ready.
        yield provider.keepalive(request, ctx)
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.config.keepalive_s)
            if done:
                break
            yield provider.keepalive(request, ctx)
        try:
            completion = task.result()
            events = [encode_sse(e) for e in provider.render_stream(request, completion, ctx)]
        except Exception as exc:
            # Headers are out: the error can only be told in the stream's own words.
            err = (
                exc
                if isinstance(exc, PolarError)
                else PolarError(500, "api_error", f"polar internal error ({type(exc).__name__})")
            )
            if not isinstance(exc, PolarError):
                log.exception("polar: rendering a stream failed")
            for event in provider.render_stream_error(err, ctx):
                yield encode_sse(event)
            return
        for chunk in events:
            yield chunk

    async def _complete_and_record(
        self, provider: Provider, request: CanonicalRequest, call: IncomingCall
    ) -> Completion:
        session = call.identity.session_id
        await self._note_session(call, request)
        try:
            engine = self.pool.for_session(session)
        except PolarError as err:  # its engine was taken out, or none is live
            await self._record_failure(call, provider.name, request, err)
            raise
        # The tito gate: None when this call's tokens neither continue nor start a chain.
        token_engine = token_input_engine(engine, self.config.tito)
        plan = await self._plan_prompt(session, request, token_engine)
        t0 = time.monotonic()
        try:
            # The client's model name is echoed back; engines send their own served name.
            if token_engine is not None and plan.prompt_ids is not None:
                completion = await token_engine.complete_tokens(request, plan.prompt_ids)
            else:
                completion = await engine.complete(request)
        except PolarError as err:
            await self._record_failure(call, provider.name, request, err, engine=engine.name)
            await self._end_lost_sessions(self.pool.failed(engine, err), engine.name)
            raise
        except Exception as exc:  # an engine bug must not take the proxy down with it
            log.exception("polar: engine %s failed", engine.name)
            # The exception text may name the engine's URL: it stays in the proxy log.
            err = PolarError(502, "api_error", f"engine error ({type(exc).__name__}); see the proxy log")
            await self._record_failure(call, provider.name, request, err, engine=engine.name)
            raise err from exc
        self.pool.succeeded(engine)
        problem = logprob_problem(completion.logprobs)
        if problem is not None:
            # A sentinel or impossible value would be trained on as if the engine had sampled with it.
            err = PolarError(502, "api_error", f"engine {engine.name} answered an unusable logprob: {problem}")
            await self._record_failure(call, provider.name, request, err, engine=engine.name)
            raise err
        record = record_ok(
            identity=call.identity,
            seq=-1,
            request=request,
            completion=completion,
            harness=harness_name(call.headers.get("user-agent"), request),
            started_at=call.started_at,
            engine_latency_s=time.monotonic() - t0,
            prompt_source=plan.source,
            prompt_reason=plan.reason,
        )
        try:
            await self.store.append(record)
        except StorageUnavailable as exc:
            # Answering without persisting would silently lose training data.
            raise PolarError(
                503, "storage_unavailable", f"polar could not persist this call ({exc}); retry later"
            ) from exc
        except Exception as exc:  # a record the store refuses (e.g. a value its columns cannot hold)
            log.exception("polar: the store refused a record of session %s", session)
            err = PolarError(500, "api_error", f"polar could not record this call ({type(exc).__name__})")
            await self._record_failure(call, provider.name, None, err)
            raise err from exc
        self._remember_sampled_arguments(session, completion)
        if token_engine is not None:
            chain = ChainTip(
                request,
                completion.message,
                completion.prompt_ids,
                completion.response_ids,
                completion.finish_reason,
                engine.name,
                completion.matched_stop,
            )
            self.tito.remember(session, chain, replaces=plan.continued)
        return self._as_client_sees(request, completion)

    async def _plan_prompt(
        self, session: str, request: CanonicalRequest, engine: TokenInputEngine | None
    ) -> PromptPlan:
        """Continue the session's token chain when the request continues it (continuity.chains), else render in full.
        ``engine``: the session's engine past the tito gate (token_input_engine), None where continuity is off."""
        if engine is None:
            return PromptPlan(None, FRESH, TITO_OFF if self.config.tito == "off" else NO_TOKEN_INPUT)
        chains = self.tito.chains(session)
        verdicts = judge(chains, request, engine.name)
        if not any(isinstance(v, Continues) for v in verdicts):
            # Nothing to render: a hop to a worker thread and back would cost more than the plan (~0.3 ms).
            return plan_prompt(chains, request, engine.name, engine.continuation, verdicts)
        # Rendering the delta runs the chat template twice: off the event loop.
        return await asyncio.to_thread(plan_prompt, chains, request, engine.name, engine.continuation, verdicts)

    @staticmethod
    def _as_client_sees(request: CanonicalRequest, completion: Completion) -> Completion:
        """A generation cut by the proxy's own max_tokens cap ends normally for the client.

        The client asked for more tokens than the operator allows; telling it "length" would make
        harnesses treat the turn as an overflow (Claude Code aborts). The record keeps "length".
        """
        if "client_max_tokens" not in request.extra or completion.finish_reason != "length":
            return completion
        asked = request.extra["client_max_tokens"]
        if asked is not None and asked <= len(completion.response_ids):
            return completion
        return replace(completion, finish_reason="stop")

    async def _end_lost_sessions(self, sessions: list[str], engine: str) -> None:
        """Sessions whose engine was taken out end as error now: their later calls are refused anyway."""
        for session in sessions:
            try:
                await self.store.session_update(
                    session,
                    status="error",
                    ended_at=time.time(),
                    metadata={"error": f"engine {engine} taken out mid-session"},
                )
            except StorageUnavailable as exc:
                log.warning("polar: could not end session %r of a lost engine: %s", session, exc)

    async def _record_failure(
        self,
        call: IncomingCall,
        api: str,
        request: CanonicalRequest | None,
        err: PolarError,
        *,
        engine: str | None = None,
    ) -> None:
        error = f"{err.status} {err.kind}: {err.message}"
        if isinstance(err, ContextLengthExceeded) and err.prompt_tokens is not None:
            # The prompt is not stored for a failed call: its length is, in a fixed shape (prompt_tokens=N window=M).
            error = f"{err.status} {err.kind}: prompt_tokens={err.prompt_tokens} window={err.window}: {err.message}"
        record = record_failed(
            identity=call.identity,
            seq=-1,
            api=api,
            request=request,
            error=error,
            engine=engine,
            harness=harness_name(call.headers.get("user-agent"), request),
            started_at=call.started_at,
        )
        try:
            await self._note_session(call, request)
            await self.store.append(record)
        except StorageUnavailable as exc:
            log.warning("polar: could not record failed call for session %r: %s", call.identity.session_id, exc)
        except Exception:  # the failure is answered either way; losing its record must not raise anew
            log.exception("polar: could not record failed call for session %r", call.identity.session_id)

    async def _note_session(self, call: IncomingCall, request: CanonicalRequest | None) -> None:
        ident = call.identity
        if ident.session_id in self._seen_sessions:
            self._seen_sessions.move_to_end(ident.session_id)
            return
        self._seen_sessions[ident.session_id] = None
        while len(self._seen_sessions) > MAX_SEEN_SESSIONS:
            self._seen_sessions.popitem(last=False)
        await self.store.session_update(
            ident.session_id,
            task_id=ident.task_id,
            group_id=ident.group_id,
            sample_index=ident.sample_index,
            harness=harness_name(call.headers.get("user-agent"), request),
            status="running",
            started_at=call.started_at,
        )

    async def close(self) -> None:
        await self.pool.close()
        await self.store.aclose()
