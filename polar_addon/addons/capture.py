"""The capture addon: builds the gateway (engines, store, sampling) from its options and answers every model call
with it; a reply goes back finished (``Response.make``) or live through the loopback relay, and Codex's
Responses WebSocket through the loopback WebSocket server."""

from __future__ import annotations

import logging

from mitmproxy import ctx, exceptions, http
from mitmproxy.connection import Client

from polar_addon import identity
from polar_addon.addons.body_limits import client_address
from polar_addon.addons.scope import is_control_flow, is_model_call
from polar_addon.addons.shared import Shared, seconds
from polar_addon.canonical import PolarError, SamplingDefaults
from polar_addon.continuity.chains import tito_mode, token_input_engine
from polar_addon.engines import EnginePool, EngineSettings
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall
from polar_addon.relay import STREAM_PREFIX, CountedBody
from polar_addon.responses_websocket import is_responses_upgrade
from polar_addon.store import TraceStore
from polar_addon.store.trace_store import DURABILITY
from polar_addon.tool_parsers import ParserChoice

log = logging.getLogger("polar")

# Headers never forwarded into the gateway's view of a call (secrets stay out of records).
SECRET_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "proxy-authorization", "cookie")
# Options only read when the gateway is built: changing one while running needs a restart.
BUILD_OPTIONS = frozenset(
    {
        "polar_engine",
        "polar_out",
        "polar_shard_records",
        "polar_shard_seconds",
        "polar_engine_timeout",
        "polar_durability",
    }
)
# Every option the gateway is built from (its own, and the body limit it enforces on the bodies it parses).
GATEWAY_OPTIONS = BUILD_OPTIONS | {
    "polar_keepalive",
    "polar_max_tokens",
    "polar_temperature",
    "polar_top_p",
    "polar_top_k",
    "polar_sampling",
    "polar_min_p",
    "polar_tito",
    "polar_tool_parser",
    "polar_tokenizer",
    "polar_max_body_mb",
}


def start_banner(engine: str, store: TraceStore, modes: list[str], host: str, port: int | None) -> str:
    """What this proxy does, in one line: engine, output (and journal), and where each mode listens."""
    listeners = []
    for mode in modes or ["regular"]:
        spec, at, own_port = mode.rpartition("@")
        if not at or not own_port.isdigit():
            spec, own_port = mode, str(port or 8080)
        listeners.append(f"{spec} on {host or '*'}:{own_port}")
    return f"engine {engine}; output {store.uri} (journal {store.journal_root}); listening: {', '.join(listeners)}"


def sampling_defaults() -> SamplingDefaults:
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


def gateway_config() -> GatewayConfig:
    opts = ctx.options
    try:
        tito = tito_mode(opts.polar_tito)
    except ValueError as exc:
        raise exceptions.OptionsError(f"polar: {exc}") from None
    return GatewayConfig(
        keepalive_s=seconds("polar_keepalive"),
        max_body_bytes=opts.polar_max_body_mb * 1024 * 1024,
        max_tokens_cap=opts.polar_max_tokens,
        tito=tito,
        sampling_defaults=sampling_defaults(),
        sampling_fixed=opts.polar_sampling == "fixed",
    )


def engine_settings() -> EngineSettings:
    """polar_tool_parser and polar_tokenizer, for the engines that decode or render themselves."""
    try:
        parsers = ParserChoice(ctx.options.polar_tool_parser)
    except ValueError as exc:
        raise exceptions.OptionsError(f"polar: polar_tool_parser: {exc}") from None
    return EngineSettings(tool_parsers=parsers, tokenizer_dir=ctx.options.polar_tokenizer or None)


class Capture:
    """Owns the gateway and the loopback servers its replies go back through."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

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
            "what the client leaves out) or fixed (the defaults above for every call, the client's temperature, "
            "top_p, top_k, min_p and seed ignored: rollouts, where the agent under training must not choose how it "
            "is sampled).",
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
            "on, off. A continuing call's prompt is the previous prompt + the sampled ids + only the new messages' "
            "tokens.",
        )
        loader.add_option(
            "polar_tool_parser",
            str,
            "hermes",
            "How the proxy parses tool calls and reasoning out of text it decodes itself "
            "(local engines, and every engine given token input): hermes, qwen25, qwen3_coder, or MODEL=NAME,... "
            "per served model. NAME+fenced_json (e.g. hermes+fenced_json) opts in to also reading tool calls a small "
            'model writes as fenced JSON ({"name": ..., "arguments": ...}) when no call was parsed, from any '
            "engine (vLLM and SGLang chat endpoints too); each record's tool_call_parser says which parser found "
            "its calls.",
        )
        loader.add_option(
            "polar_tokenizer",
            str,
            "",
            "Tokenizer directory of the model a vLLM or SGLang engine serves: turns on its token "
            "input (token continuity); without it the engine renders every call in full.",
        )
        loader.add_option("polar_shard_records", int, 512, "Records per Parquet shard before it is sealed.")
        loader.add_option("polar_shard_seconds", str, "30", "Seconds before an open shard is sealed.")
        loader.add_option(
            "polar_durability",
            str,
            "fsync",
            "When a call is answered: fsync (its record fdatasync'd first: survives a power cut) or write (written "
            "to the journal first, fdatasync'd just behind: survives the proxy's death, not a power cut; takes the "
            "fsync off every answer).",
            choices=list(DURABILITY),
        )

    @property
    def gateway(self) -> Gateway | None:
        return self.shared.gateway

    def configure(self, updated: set[str]) -> None:
        if not updated & GATEWAY_OPTIONS:
            return
        opts = ctx.options
        if not opts.polar_engine:
            raise exceptions.OptionsError("polar: set --set polar_engine=sglang:URL|vllm:URL|local:MODEL_DIR")
        gateway = self.shared.gateway
        if gateway is not None:
            if updated & BUILD_OPTIONS:
                raise exceptions.OptionsError(
                    "polar: engine and output options cannot change while running; restart mitmdump"
                )
            gateway.config = gateway_config()
            gateway.pool.configure(engine_settings())
            return
        try:
            pool = EnginePool.from_spec(opts.polar_engine, timeout_s=seconds("polar_engine_timeout"))
        except ValueError as exc:
            raise exceptions.OptionsError(f"polar: {exc}") from exc
        pool.configure(engine_settings())
        try:
            pool.load()  # in-process engines load their model now: a wrong path fails here, not on the first call
        except PolarError as exc:
            raise exceptions.OptionsError(f"polar: {exc.message}") from exc
        store = TraceStore(
            opts.polar_out,
            shard_max_records=opts.polar_shard_records,
            shard_max_seconds=seconds("polar_shard_seconds"),
            durability=opts.polar_durability,
        )
        gateway = Gateway(pool, store, gateway_config())
        if gateway.config.tito == "on":
            for engine in pool.engines:
                if token_input_engine(engine, "on") is None:
                    log.warning(
                        "polar: polar_tito=on, but engine %s takes no token input: its calls are rendered in full",
                        engine.name,
                    )
        self.shared.gateway = gateway

    async def running(self) -> None:
        # Eager upstream connects would fail (or leak) for hosts we answer ourselves.
        ctx.options.connection_strategy = "lazy"
        if not ctx.options.listen_host:
            log.warning(
                "polar: mitmdump listens on all interfaces; pass --listen-host 127.0.0.1 unless others must reach it"
            )
        await self.shared.relay.start()
        await self.shared.websockets.start()
        if self.shared.gateway is not None:
            # At warning level: shown even with termlog_verbosity=warn, as polar's tests and `polar proxy` run it.
            log.warning(
                "polar: %s",
                start_banner(
                    ctx.options.polar_engine,
                    self.shared.gateway.store,
                    list(ctx.options.mode),
                    ctx.options.listen_host,
                    ctx.options.listen_port,
                ),
            )

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return  # refused (polar_block_other)
        auth = flow.request.headers.get("proxy-authorization")
        if auth:
            self.shared.proxy_auth[flow.client_conn.id] = auth

    def client_disconnected(self, client: Client) -> None:
        self.shared.proxy_auth.pop(client.id, None)

    async def request(self, flow: http.HTTPFlow) -> None:
        gateway = self.shared.gateway
        if gateway is None or flow.response is not None or is_control_flow(flow) or not is_model_call(flow, gateway):
            return
        try:
            await self._answer(flow, gateway)
        except Exception as exc:
            # A flow on a model route must never continue upstream (real API key, unrecorded): answer here.
            log.exception("polar: unexpected error on %s %s", flow.request.method, flow.request.pretty_host)
            try:
                self.shared.refuse(flow, PolarError(500, "api_error", f"polar internal error ({type(exc).__name__})"))
            except Exception:
                flow.response = http.Response.make(
                    500,
                    b'{"error":{"type":"api_error","message":"polar internal error"}}',
                    {"content-type": "application/json"},
                )

    async def _answer(self, flow: http.HTTPFlow, gateway: Gateway) -> None:
        shared = self.shared
        headers = {k.lower(): v for k, v in flow.request.headers.items()}
        proxy_auth = headers.get("proxy-authorization") or shared.proxy_auth.get(flow.client_conn.id)
        try:
            ident = identity.resolve(
                proxy_auth,
                headers,
                flow.client_conn.id,
                shared.control.sessions if shared.control else None,
                ctx.options.polar_sessions,
            )
        except PolarError as err:
            shared.refuse(flow, err)
            return
        for name in SECRET_HEADERS:
            headers.pop(name, None)
        if is_responses_upgrade(flow.request.method, flow.request.path, flow.request.headers):
            # Codex's Responses WebSocket: the loopback WebSocket server answers it (responses_websocket.py).
            client = flow.client_conn
            path = shared.websockets.park(ident, headers, flow.request.pretty_host, client_address(client), client.id)
            flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", shared.websockets.port
            flow.request.path = path
            flow.metadata["polar_websocket"] = True
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
        reply = await gateway.handle(call)
        if isinstance(reply, FullReply):
            shared.reply(flow, reply)
            return
        counted: CountedBody | None = flow.metadata.get("polar_counted")
        token = shared.relay.park(reply.status, reply.content_type, reply.chunks, token=counted and counted.token)
        flow.metadata["polar_stream"] = True
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = shared.relay.port
        flow.request.method = "GET"
        flow.request.path = STREAM_PREFIX + token
        flow.request.content = b""

    async def done(self) -> None:
        # The loopback servers first: a stream they cut short is still recorded by the gateway, then closed.
        await self.shared.relay.stop()
        await self.shared.websockets.stop()
        if self.shared.gateway is not None:
            await self.shared.gateway.close()
