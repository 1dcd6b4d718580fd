"""polar's mitmproxy addon: ``mitmdump --listen-host 127.0.0.1 -s polar_addon/addon.py --set polar_engine=... --set polar_out=DIR``.

mitmproxy glue only: options, which flows are ours, identity from proxy credentials, and how a
reply goes back (``Response.make`` for a finished body, a loopback relay for a live stream).
Everything else lives in :mod:`polar_addon.gateway`.

Regular mode: the harness sets ``HTTPS_PROXY=http://SESSION@127.0.0.1:8080`` and trusts
mitmproxy's CA. Reverse mode (``--mode reverse:https://api.anthropic.com``): the harness's base URL
points at mitmdump; every request on a model route is ours whatever the reverse target.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Iterable, Sequence

import orjson
from mitmproxy import ctx, exceptions, http
from mitmproxy.connection import Client
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from polar_addon import identity
from polar_addon.canonical import PolarError, SamplingDefaults
from polar_addon.continuity.chains import tito_mode, token_input_engine
from polar_addon.control import (
    CONTROL_HOST,
    MAX_CONTROL_BODY_BYTES,
    ControlPlane,
    check_token,
    is_control_path,
    load_or_create_token,
    token_file,
)
from polar_addon.engines import EnginePool
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall
from polar_addon.relay import (
    OVER_BUDGET,
    STREAM_PREFIX,
    TOO_LARGE,
    BodyBudget,
    CountedBody,
    HeapTrim,
    StreamRelay,
    one_chunk,
)
from polar_addon.responses_websocket import ResponsesWebSocket, is_responses_upgrade
from polar_addon.store import TraceStore
from polar_addon.tool_parsers import ParserChoice

log = logging.getLogger("polar")

PROVIDER_HOSTS = frozenset({"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com"})
# Headers never forwarded into the gateway's view of a call (secrets stay out of records).
SECRET_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "proxy-authorization", "cookie")


def _seconds(name: str) -> float:
    # mitmproxy options have no float type: durations are strings parsed here.
    raw = getattr(ctx.options, name)
    try:
        value = float(raw)
    except ValueError:
        raise exceptions.OptionsError(f"polar: {name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise exceptions.OptionsError(f"polar: {name} must be positive, got {raw!r}")
    return value


def _sampling_defaults() -> SamplingDefaults:
    opts = ctx.options
    try:
        return SamplingDefaults(
            temperature=float(opts.polar_temperature),
            top_p=float(opts.polar_top_p),
            top_k=opts.polar_top_k,
            min_p=float(opts.polar_min_p),
        )
    except ValueError as exc:
        raise exceptions.OptionsError(
            f"polar: sampling defaults (polar_temperature, polar_top_p, polar_top_k, polar_min_p): {exc}"
        ) from None


def _tito() -> str:
    try:
        return tito_mode(ctx.options.polar_tito)
    except ValueError as exc:
        raise exceptions.OptionsError(f"polar: {exc}") from None


def _engine_options(pool: EnginePool) -> None:
    """polar_tool_parser and polar_tokenizer onto the engines that decode or render themselves."""
    try:
        parsers = ParserChoice(ctx.options.polar_tool_parser)
    except ValueError as exc:
        raise exceptions.OptionsError(f"polar: polar_tool_parser: {exc}") from None
    for engine in pool.engines:
        target = getattr(engine, "local", engine)  # the scripted engine decodes with its local engine
        if hasattr(target, "tool_parsers"):
            target.tool_parsers = parsers
        if hasattr(engine, "tokenizer_dir"):
            engine.tokenizer_dir = ctx.options.polar_tokenizer or None


def start_banner(engine: str, store: TraceStore, modes: list[str], host: str, port: int | None) -> str:
    """What this proxy does, in one line: engine, output (and journal), and where each mode listens."""
    listeners = []
    for mode in modes or ["regular"]:
        spec, at, own_port = mode.rpartition("@")
        if not at or not own_port.isdigit():
            spec, own_port = mode, str(port or 8080)
        listeners.append(f"{spec} on {host or '*'}:{own_port}")
    return f"engine {engine}; output {store.uri} (journal {store.journal_root}); listening: {', '.join(listeners)}"


def intercept_patterns(polar_hosts: Iterable[str], modes: Iterable[str]) -> list[str]:
    """mitmproxy ``allow_hosts`` regexes (matched against ``host:port``): the provider hosts, polar.local,
    ``polar_hosts`` and every reverse-mode target. TLS to any other host passes through untouched."""
    names = sorted(PROVIDER_HOSTS | {CONTROL_HOST})
    patterns = ["^(?:" + "|".join(re.escape(n) for n in names) + r"):\d+$"]
    for entry in polar_hosts:
        host, sep, port = entry.rpartition(":")
        patterns.append(f"^{re.escape(entry)}$" if sep and port.isdigit() and host else f"^{re.escape(entry)}:\\d+$")
    for spec in modes:
        mode = ProxyMode.parse(spec)
        if isinstance(mode, ReverseMode):
            host, port = mode.address
            patterns.append(f"^{re.escape(host)}:{port}$")
    return patterns


def _host(name: str) -> str:
    # DNS names are case-insensitive and may end in a dot: API.OpenAI.com. is still a model host.
    return name.lower().rstrip(".")


def _cut_connection(flow: http.HTTPFlow) -> None:
    """Close the connection of a flow whose request body is late. mitmproxy has no read timeout of its own but a
    10-minute idle one, which a client trickling a byte now and then never reaches; this is what that idle
    timeout does (ConnectionHandler.on_timeout)."""
    server = ctx.master.addons.get("proxyserver")
    handler = server.connections.get(flow.client_conn.id) if server is not None else None
    transport = handler.transports.get(handler.client) if handler is not None else None
    if transport is None or transport.handler is None:
        return  # already gone
    log.warning(
        "polar: a request body from %s was not complete after polar_body_timeout (%s s): connection closed",
        flow.client_conn.peername,
        ctx.options.polar_body_timeout,
    )
    transport.handler.cancel("polar_body_timeout")


class Polar:
    def __init__(self) -> None:
        self.gateway: Gateway | None = None
        self.relay = StreamRelay()
        self.websockets = ResponsesWebSocket(lambda: self.gateway, self._still_live)
        self.control: ControlPlane | None = None
        self._proxy_auth: dict[str, str] = {}  # client connection id -> Proxy-Authorization from CONNECT
        self._allow_hosts_set: list[str] | None = None  # what we last put into allow_hosts
        self.budget = BodyBudget(0)  # its limit set by `configure`
        self.heap = HeapTrim()

    def load(self, loader) -> None:
        loader.add_option(
            "polar_engine",
            str,
            "",
            "Inference engine spec(s), comma-separated: sglang:URL, vllm:URL, local:MODEL_DIR. "
            "Each session stays on one engine; a failing engine is taken out and its sessions end as error.",
        )
        loader.add_option(
            "polar_out",
            str,
            "shards",
            "Where trace shards go: a directory or a pyarrow filesystem URI (s3://bucket/prefix).",
        )
        loader.add_option(
            "polar_hosts",
            Sequence[str],
            [],
            "Extra HOST or HOST:PORT whose model API calls are captured (besides the provider hosts).",
        )
        loader.add_option(
            "polar_block_other",
            bool,
            False,
            "Refuse all non-model traffic (403, CONNECT to other hosts and raw TCP included) instead of passing it through (sandboxes).",
        )
        loader.add_option(
            "polar_sessions",
            str,
            "claimed",
            "Where a call's session, task, group and sample come from. claimed: "
            "whatever the caller says (API key polar:session=..., proxy credentials, x-polar-* headers): "
            "TRUST ON CLAIM, for capturing your own harness. registered: only sessions registered on the "
            "control plane (POST /sessions/ID/register with the control token), their labels from the "
            "registration, the caller's credential its secret alone; claims, unknown secrets and ended "
            "sessions are refused (polar rollout's own proxy; set it for a proxy that trains an untrusted "
            "policy).",
            choices=identity.SESSION_MODES,
        )
        loader.add_option(
            "polar_control_token",
            str,
            "",
            "Bearer token required to post rewards and statuses (default: generated into <polar_out>/.control-token, mode 0600).",
        )
        loader.add_option(
            "polar_keepalive",
            str,
            "5",
            "Seconds between keep-alive events sent to a streaming client while the engine works.",
        )
        loader.add_option("polar_engine_timeout", str, "900", "Seconds to wait for one engine completion.")
        loader.add_option(
            "polar_max_tokens", int, 0, "Clamp (and fill in) max_tokens of every call; 0 leaves it to the client."
        )
        loader.add_option(
            "polar_temperature",
            str,
            "1.0",
            "Sampling temperature of calls whose client sets none (sent to the engine and recorded).",
        )
        loader.add_option(
            "polar_top_p",
            str,
            "1.0",
            "top_p of calls whose client sets none; below 1 truncates sampling, which polar train refuses.",
        )
        loader.add_option(
            "polar_top_k",
            int,
            0,
            "top_k of calls whose client sets none; 0 is off (above 0 truncates, which polar train refuses).",
        )
        loader.add_option(
            "polar_sampling",
            str,
            "client",
            "Whose sampling parameters a call uses: client (the defaults above fill in "
            "what the client leaves out) or fixed (the defaults above for every call, the client's temperature, top_p, "
            "top_k, min_p and seed ignored: rollouts, where the agent under training must not choose how it is sampled).",
            choices=("client", "fixed"),
        )
        loader.add_option(
            "polar_min_p",
            str,
            "0.0",
            "min_p of calls whose client sets none; above 0 truncates, which polar train refuses.",
        )
        loader.add_option(
            "polar_tito",
            str,
            "auto",
            "Token continuity across a session's turns: auto (on for engines that take token input), "
            "on, off. A continuing call's prompt is the previous prompt + the sampled ids + only the new messages' tokens.",
        )
        loader.add_option(
            "polar_tool_parser",
            str,
            "hermes",
            "How the proxy parses tool calls and reasoning out of text it decodes itself "
            "(local engines, and every engine given token input): hermes, qwen25, qwen3_coder, or MODEL=NAME,... per served model.",
        )
        loader.add_option(
            "polar_tokenizer",
            str,
            "",
            "Tokenizer directory of the model a vLLM or SGLang engine serves: turns on its token "
            "input (token continuity); without it the engine renders every call in full.",
        )
        loader.add_option(
            "polar_max_body_mb",
            int,
            16,
            "Largest request body accepted, in MiB (a long harness session's "
            "call is a few MiB; a larger one is refused in the caller's protocol, 413).",
        )
        loader.add_option(
            "polar_client_inflight_mb",
            int,
            256,
            "Request-body MiB one client address may have in flight "
            "at once, over all its connections, until each call is answered (sandboxes all arrive from "
            "loopback: for them this is the proxy's total); a call over it is refused in the caller's "
            "protocol, 429, retryable.",
        )
        loader.add_option(
            "polar_body_timeout",
            str,
            "60",
            "Seconds a client has to send a request body polar reads; a "
            "body still incomplete then (a client that stalls or trickles) has its connection closed.",
        )
        loader.add_option("polar_shard_records", int, 512, "Records per Parquet shard before it is sealed.")
        loader.add_option("polar_shard_seconds", str, "30", "Seconds before an open shard is sealed.")

    def configure(self, updated: set[str]) -> None:
        if updated & {"polar_hosts", "mode", "allow_hosts", "ignore_hosts"}:
            self._intercept_only_model_hosts()
        if "polar_block_other" in updated and ctx.options.polar_block_other:
            # Non-HTTP bytes after a CONNECT would otherwise be relayed as raw TCP to any host:port.
            ctx.options.rawtcp = False
        if "polar_client_inflight_mb" in updated:
            self.budget.limit = ctx.options.polar_client_inflight_mb * 1024 * 1024
        if "polar_body_timeout" in updated:
            _seconds("polar_body_timeout")  # a bad value fails at start, not at the first body
        if not any(name.startswith("polar_") for name in updated):
            return
        opts = ctx.options
        if not opts.polar_engine:
            raise exceptions.OptionsError("polar: set --set polar_engine=sglang:URL|vllm:URL|local:MODEL_DIR")
        if self.gateway is not None and not updated & {
            "polar_engine",
            "polar_out",
            "polar_shard_records",
            "polar_shard_seconds",
            "polar_engine_timeout",
        }:
            self.gateway.config = self._gateway_config()
            _engine_options(self.gateway.pool)
            if "polar_control_token" in updated and self.control is not None:
                self.control.token = self._control_token()
            return
        if self.gateway is not None:
            raise exceptions.OptionsError(
                "polar: engine and output options cannot change while running; restart mitmdump"
            )
        try:
            pool = EnginePool.from_spec(opts.polar_engine, timeout_s=_seconds("polar_engine_timeout"))
        except ValueError as exc:
            raise exceptions.OptionsError(f"polar: {exc}") from exc
        for engine in pool.engines:
            # In-process engines load their model now: a wrong path fails here, and the first call is not slow.
            load = getattr(engine, "load", None)
            if load is not None:
                log.warning("polar: loading the %s engine's model ...", engine.name)
                started = time.monotonic()
                try:
                    load()
                except PolarError as exc:
                    raise exceptions.OptionsError(f"polar: {exc.message}") from exc
                log.warning("polar: %s loaded in %.1f s", engine.name, time.monotonic() - started)
        _engine_options(pool)
        store = TraceStore(
            opts.polar_out,
            shard_max_records=opts.polar_shard_records,
            shard_max_seconds=_seconds("polar_shard_seconds"),
        )
        self.gateway = Gateway(pool, store, self._gateway_config())
        if self.gateway.config.tito == "on":
            for engine in pool.engines:
                if token_input_engine(engine, "on") is None:
                    log.warning(
                        "polar: polar_tito=on, but engine %s takes no token input: its calls are rendered in full",
                        engine.name,
                    )
        self.control = ControlPlane(
            store, self._control_token(), on_session_end=pool.release, sessions_mode=lambda: ctx.options.polar_sessions
        )

    def _control_token(self) -> str:
        opts = ctx.options
        if opts.polar_control_token:
            try:
                return check_token(opts.polar_control_token)
            except ValueError as exc:
                raise exceptions.OptionsError(f"polar: {exc}") from None
        path = token_file(opts.polar_out, opts.confdir)
        token = load_or_create_token(path)
        log.info("polar: control token (for reward/status posts) in %s", path)
        return token

    def _intercept_only_model_hosts(self) -> None:
        """Intercept TLS only to model hosts; an operator's own allow_hosts / ignore_hosts is left alone."""
        opts = ctx.options
        if opts.ignore_hosts or (opts.allow_hosts and list(opts.allow_hosts) != self._allow_hosts_set):
            return
        patterns = intercept_patterns(opts.polar_hosts, opts.mode)
        if patterns != list(opts.allow_hosts):
            self._allow_hosts_set = patterns
            opts.allow_hosts = patterns

    def _gateway_config(self) -> GatewayConfig:
        opts = ctx.options
        return GatewayConfig(
            keepalive_s=_seconds("polar_keepalive"),
            max_body_bytes=opts.polar_max_body_mb * 1024 * 1024,
            max_tokens_cap=opts.polar_max_tokens,
            tito=_tito(),
            sampling_defaults=_sampling_defaults(),
            sampling_fixed=opts.polar_sampling == "fixed",
        )

    async def running(self) -> None:
        # Eager upstream connects would fail (or leak) for hosts we answer ourselves.
        ctx.options.connection_strategy = "lazy"
        if not ctx.options.listen_host:
            log.warning(
                "polar: mitmdump listens on all interfaces; pass --listen-host 127.0.0.1 unless others must reach it"
            )
        await self.relay.start()
        await self.websockets.start()
        if self.gateway is not None:
            # At warning level: shown even with termlog_verbosity=warn, as polar's tests and `polar proxy` run it.
            log.warning(
                "polar: %s",
                start_banner(
                    ctx.options.polar_engine,
                    self.gateway.store,
                    list(ctx.options.mode),
                    ctx.options.listen_host,
                    ctx.options.listen_port,
                ),
            )

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if ctx.options.polar_block_other and not self._is_model_host(flow.request.host, flow.request.port):
            flow.response = http.Response.make(
                403, b"polar: non-model traffic is blocked (polar_block_other)", {"content-type": "text/plain"}
            )
            return
        auth = flow.request.headers.get("proxy-authorization")
        if auth:
            self._proxy_auth[flow.client_conn.id] = auth

    def client_disconnected(self, client: Client) -> None:
        self._proxy_auth.pop(client.id, None)
        self.heap.freed(self.budget.release_connection(client.id))

    def response(self, flow: http.HTTPFlow) -> None:
        self.heap.freed(self.budget.release(flow.id))

    def error(self, flow: http.HTTPFlow) -> None:
        self._body_arrived(flow)
        self.heap.freed(self.budget.release(flow.id))

    @staticmethod
    def _is_model_host(host: str, port: int) -> bool:
        host = _host(host)
        if host in PROVIDER_HOSTS or host == CONTROL_HOST:
            return True
        extra = {_host(h) for h in ctx.options.polar_hosts}
        return host in extra or f"{host}:{port}" in extra

    def _is_ours(self, flow: http.HTTPFlow) -> bool:
        if isinstance(flow.client_conn.proxy_mode, ReverseMode):
            return True
        return self._is_model_host(flow.request.pretty_host, flow.request.port)

    async def _answer_control(self, flow: http.HTTPFlow) -> None:
        """Control paths and everything else on polar.local: answered here, never forwarded."""
        assert self.control is not None
        if is_control_path(flow.request.path):
            status, payload = await self.control.handle(
                flow.request.method,
                flow.request.path,
                flow.request.headers.get("authorization"),
                flow.request.raw_content or b"",
            )
        else:
            status, payload = 404, {"error": {"type": "not_found", "message": "polar control: no such path"}}
        flow.response = http.Response.make(status, orjson.dumps(payload), {"content-type": "application/json"})

    async def request(self, flow: http.HTTPFlow) -> None:
        self._body_arrived(flow)
        if self.gateway is None or flow.response is not None:
            return
        streamed = self._restore_counted(flow)
        counted: CountedBody | None = flow.metadata.get("polar_counted")
        if counted is not None and counted.refused and counted.cap:  # cap 0: a blocked flow, `_request`'s 403
            flow.response = self._refused_body(flow, counted)
        else:
            await self._request(flow)
        if streamed:
            self._park_answer(flow)

    def _refused_body(self, flow: http.HTTPFlow, counted: CountedBody) -> http.Response:
        """A body over polar_max_body_mb (413) or over its client's in-flight budget (429: retryable, once the
        client's other calls are answered), in the protocol of the route it was sent to."""
        assert self.gateway is not None
        if counted.refused == OVER_BUDGET:
            err = PolarError(
                429,
                "overloaded",
                f"polar: this client already has {self.budget.limit} bytes of request "
                "bodies in flight (polar_client_inflight_mb): retry once its other calls are answered",
            )
        else:
            err = PolarError(
                413,
                "request_too_large",
                f"request body of {counted.seen} bytes exceeds the proxy limit of {counted.cap}",
            )
        reply = self.gateway.error_reply(flow.request.method, flow.request.path, err)
        return http.Response.make(reply.status, reply.body, {"content-type": reply.content_type})

    async def _request(self, flow: http.HTTPFlow) -> None:
        assert self.gateway is not None
        reverse = isinstance(flow.client_conn.proxy_mode, ReverseMode)
        if _host(flow.request.pretty_host) == CONTROL_HOST or (reverse and is_control_path(flow.request.path)):
            await self._answer_control(flow)
            return
        if self._is_ours(flow) and is_control_path(flow.request.path):
            # A provider host is the agent's own route: control posts there are refused, not forwarded.
            flow.response = http.Response.make(
                404,
                orjson.dumps(
                    {
                        "error": {
                            "type": "not_found",
                            "message": f"polar control paths are served only on {CONTROL_HOST}",
                        }
                    }
                ),
                {"content-type": "application/json"},
            )
            return
        upgrade = is_responses_upgrade(flow.request.method, flow.request.path, flow.request.headers)
        ours = self._is_ours(flow) and (upgrade or self.gateway.owns(flow.request.method, flow.request.path))
        if not ours:
            if ctx.options.polar_block_other:
                flow.response = http.Response.make(
                    403, b"polar: non-model traffic is blocked (polar_block_other)", {"content-type": "text/plain"}
                )
                return
            # The session, task and group in the proxy credentials are nobody else's business.
            flow.request.headers.pop("proxy-authorization", None)
            return
        try:
            await self._answer(flow, upgrade)
        except Exception as exc:
            # A flow on a model route must never continue upstream (real API key, unrecorded): answer here.
            log.exception("polar: unexpected error on %s %s", flow.request.method, flow.request.pretty_host)
            err = PolarError(500, "api_error", f"polar internal error ({type(exc).__name__})")
            try:
                reply = self.gateway.error_reply(flow.request.method, flow.request.path, err)
                flow.response = http.Response.make(reply.status, reply.body, {"content-type": reply.content_type})
            except Exception:
                flow.response = http.Response.make(
                    500,
                    b'{"error":{"type":"api_error","message":"polar internal error"}}',
                    {"content-type": "application/json"},
                )

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # mitmproxy's own body_size_limit would answer a plain-text 413 before any hook of ours runs, so it
        # is left unset: a body polar answers itself is counted here on its way in and never buffered past
        # polar's limit; other traffic streams through unbuffered.
        if self.gateway is None or flow.response is not None:
            return
        if _host(flow.request.pretty_host) == CONTROL_HOST:
            self._count_body(flow, MAX_CONTROL_BODY_BYTES)
            return
        if self._is_ours(flow) and (
            self.gateway.owns(flow.request.method, flow.request.path) or is_control_path(flow.request.path)
        ):
            self._count_body(flow, self.gateway.config.max_body_bytes)
            return
        if ctx.options.polar_block_other:
            self._count_body(flow, 0)  # answered 403 in `request`, the body dropped unread
            return
        flow.request.headers.pop("proxy-authorization", None)  # streamed: headers leave before `request`
        flow.request.stream = True

    def _count_body(self, flow: http.HTTPFlow, cap: int) -> None:
        """A body polar reads is charged to its client's budget (``self.budget``) until its flow ends, and its
        connection is closed if the body is not complete within polar_body_timeout. One declared within ``cap``
        and the budget is read by mitmproxy (exactly that length); any other (chunked, undeclared, over ``cap`` or
        over budget) through a counter that keeps it only while it stays within both (CountedBody), the flow
        pointed at the loopback relay, where `request` parks its answer."""
        request = flow.request
        headers = request.headers
        length = headers.get("content-length")
        if length is None and "transfer-encoding" not in headers and not (request.is_http2 or request.is_http3):
            return  # no body
        self._start_body_deadline(flow)
        client = flow.client_conn.peername[0] if flow.client_conn.peername else ""
        take = functools.partial(self.budget.take, flow.id, client, flow.client_conn.id)
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared <= cap and take(declared):
            return
        counted = CountedBody(
            cap=cap,
            token=self.relay.new_token(),
            scheme=request.scheme,
            host=request.host,
            port=request.port,
            path=request.path,
            host_header=request.host_header,
            take=take,
            drop=functools.partial(self.budget.release, flow.id),
        )
        if declared is not None:
            counted.refuse(TOO_LARGE if declared > cap else OVER_BUDGET)  # not one byte of it is kept
        flow.metadata["polar_counted"] = counted
        request.stream = counted.count
        # Chunked to the relay: its read ends only with mitmproxy's end of message, sent after `request` ran.
        headers.pop("content-length", None)
        headers["transfer-encoding"] = "chunked"
        request.scheme, request.host, request.port = "http", "127.0.0.1", self.relay.port
        request.path = STREAM_PREFIX + counted.token

    @staticmethod
    def _restore_counted(flow: http.HTTPFlow) -> bool:
        """Put a counted flow back as the client sent it; True when its body came through the counter (the
        answer must then be parked at the relay), False when mitmproxy read it (none) or it was not counted."""
        counted: CountedBody | None = flow.metadata.get("polar_counted")
        if counted is None:
            return False
        request = flow.request
        streamed = request.raw_content is None
        request.scheme, request.host, request.port, request.path = (
            counted.scheme,
            counted.host,
            counted.port,
            counted.path,
        )
        request.host_header = counted.host_header
        # The framing headers stay chunked: mitmproxy ends the relay's body by them after this hook.
        if streamed:
            request.data.content = bytes(counted.kept)
            counted.kept = bytearray()  # one copy of the body is enough
        return streamed

    def _start_body_deadline(self, flow: http.HTTPFlow) -> None:
        loop = asyncio.get_running_loop()
        flow.metadata["polar_body_deadline"] = loop.call_later(_seconds("polar_body_timeout"), _cut_connection, flow)

    @staticmethod
    def _body_arrived(flow: http.HTTPFlow) -> None:
        deadline: asyncio.TimerHandle | None = flow.metadata.pop("polar_body_deadline", None)
        if deadline is not None:
            deadline.cancel()

    def _park_answer(self, flow: http.HTTPFlow) -> None:
        """A counted flow already went to the relay: its answer waits there under the flow's token."""
        counted: CountedBody = flow.metadata["polar_counted"]
        if flow.metadata.get("polar_stream"):
            return  # `_answer` parked the stream under this token
        response = flow.response
        if response is None:
            response = http.Response.make(
                500,
                b'{"error":{"type":"api_error","message":"polar internal error"}}',
                {"content-type": "application/json"},
            )
        flow.response = None  # the relay's answer is the one the client gets
        self.relay.park(
            response.status_code,
            response.headers.get("content-type", "application/json"),
            one_chunk(response.raw_content or b""),
            token=counted.token,
        )

    def _still_live(self, ident: identity.Identity) -> None:
        """Refuses (PolarError) a registered session that has ended since its WebSocket opened."""
        if ident.source == "registered" and self.control is not None and self.control.sessions.ended(ident.session_id):
            raise PolarError(
                403,
                "authentication",
                "polar identity: this session has ended (its final status was posted): its credential is refused",
            )

    async def _answer(self, flow: http.HTTPFlow, upgrade: bool) -> None:
        assert self.gateway is not None
        headers = {k.lower(): v for k, v in flow.request.headers.items()}
        proxy_auth = headers.get("proxy-authorization") or self._proxy_auth.get(flow.client_conn.id)
        try:
            ident = identity.resolve(
                proxy_auth,
                headers,
                flow.client_conn.id,
                self.control.sessions if self.control else None,
                ctx.options.polar_sessions,
            )
        except PolarError as err:
            reply = self.gateway.error_reply(flow.request.method, flow.request.path, err)
            flow.response = http.Response.make(reply.status, reply.body, {"content-type": reply.content_type})
            return
        for name in SECRET_HEADERS:
            headers.pop(name, None)
        if upgrade:
            # Codex's Responses WebSocket: the loopback WebSocket server answers it (responses_websocket.py).
            path = self.websockets.park(ident, headers, flow.request.pretty_host)
            flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.websockets.port
            flow.request.path = path
            return
        call = IncomingCall(
            method=flow.request.method,
            path=flow.request.path,
            headers=headers,
            body=flow.request.raw_content or b"",
            identity=ident,
            host=flow.request.pretty_host,
            started_at=flow.request.timestamp_start,
        )
        reply = await self.gateway.handle(call)
        if isinstance(reply, FullReply):
            flow.response = http.Response.make(reply.status, reply.body, {"content-type": reply.content_type})
            return
        counted: CountedBody | None = flow.metadata.get("polar_counted")
        token = self.relay.park(reply.status, reply.content_type, reply.chunks, token=counted and counted.token)
        flow.metadata["polar_stream"] = True
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = self.relay.port
        flow.request.method = "GET"
        flow.request.path = STREAM_PREFIX + token
        flow.request.content = b""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("polar_stream") or "polar_counted" in flow.metadata:
            flow.response.stream = True

    async def done(self) -> None:
        await self.relay.stop()
        await self.websockets.stop()
        if self.gateway is not None:
            await self.gateway.close()


addons = [Polar()]
