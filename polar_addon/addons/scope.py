"""Interception scope: which hosts and flows are model calls (answered by polar), and what happens to the rest
(passed through untouched, or refused with ``polar_block_other``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence

import orjson
from mitmproxy import ctx, http
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from polar_addon.addons.shared import Shared
from polar_addon.control import CONTROL_HOST, is_control_path
from polar_addon.gateway import Gateway
from polar_addon.responses_websocket import is_responses_upgrade

log = logging.getLogger("polar")

PROVIDER_HOSTS = frozenset({"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com"})
BLOCKED_BODY = b"polar: non-model traffic is blocked (polar_block_other)"


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


def host_name(name: str) -> str:
    # DNS names are case-insensitive and may end in a dot: API.OpenAI.com. is still a model host.
    return name.lower().rstrip(".")


def is_model_host(host: str, port: int) -> bool:
    host = host_name(host)
    if host in PROVIDER_HOSTS or host == CONTROL_HOST:
        return True
    extra = {host_name(h) for h in ctx.options.polar_hosts}
    return host in extra or f"{host}:{port}" in extra


def is_ours(flow: http.HTTPFlow) -> bool:
    """A flow to a model host, or any flow on a reverse-mode listener (whatever its target)."""
    if isinstance(flow.client_conn.proxy_mode, ReverseMode):
        return True
    return is_model_host(flow.request.pretty_host, flow.request.port)


def is_control_flow(flow: http.HTTPFlow) -> bool:
    """A flow the control plane answers: anything on polar.local, or a control path on a reverse listener."""
    reverse = isinstance(flow.client_conn.proxy_mode, ReverseMode)
    return host_name(flow.request.pretty_host) == CONTROL_HOST or (reverse and is_control_path(flow.request.path))


def is_model_call(flow: http.HTTPFlow, gateway: Gateway) -> bool:
    """A flow the gateway answers: a route of one of its providers (or Codex's WebSocket upgrade) on a model host."""
    request = flow.request
    return is_ours(flow) and (
        is_responses_upgrade(request.method, request.path, request.headers)
        or gateway.owns(request.method, request.path)
    )


def blocked(flow: http.HTTPFlow) -> None:
    flow.response = http.Response.make(403, BLOCKED_BODY, {"content-type": "text/plain"})


class InterceptionScope:
    """Intercepts TLS only to model hosts, refuses control paths on a provider host (the agent's own route), and
    passes every other flow through with the proxy credentials removed, or refuses it (``polar_block_other``)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._allow_hosts_set: list[str] | None = None  # what we last put into allow_hosts

    def load(self, loader) -> None:
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
            "Refuse all non-model traffic (403, CONNECT to other hosts and raw TCP included) instead of passing it "
            "through (sandboxes).",
        )

    def configure(self, updated: set[str]) -> None:
        if updated & {"polar_hosts", "mode", "allow_hosts", "ignore_hosts"}:
            self._intercept_only_model_hosts()
        if "polar_block_other" in updated and ctx.options.polar_block_other:
            # Non-HTTP bytes after a CONNECT would otherwise be relayed as raw TCP to any host:port.
            ctx.options.rawtcp = False

    def _intercept_only_model_hosts(self) -> None:
        """Intercept TLS only to model hosts; an operator's own allow_hosts / ignore_hosts is left alone."""
        opts = ctx.options
        if opts.ignore_hosts or (opts.allow_hosts and list(opts.allow_hosts) != self._allow_hosts_set):
            return
        patterns = intercept_patterns(opts.polar_hosts, opts.mode)
        if patterns != list(opts.allow_hosts):
            self._allow_hosts_set = patterns
            opts.allow_hosts = patterns

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if ctx.options.polar_block_other and not is_model_host(flow.request.host, flow.request.port):
            blocked(flow)
            # mitmproxy logs no flow for a CONNECT answered here: say which harness traffic was refused.
            log.info("polar: refused CONNECT %s:%s (polar_block_other)", flow.request.host, flow.request.port)

    def request(self, flow: http.HTTPFlow) -> None:
        gateway = self.shared.gateway
        if gateway is None or flow.response is not None or is_control_flow(flow):
            return
        if is_ours(flow) and is_control_path(flow.request.path):
            # A provider host is the agent's own route: control posts there are refused, not forwarded.
            message = f"polar control paths are served only on {CONTROL_HOST}"
            flow.response = http.Response.make(
                404,
                orjson.dumps({"error": {"type": "not_found", "message": message}}),
                {"content-type": "application/json"},
            )
        elif not is_model_call(flow, gateway):
            if ctx.options.polar_block_other:
                blocked(flow)
            else:
                # The session, task and group in the proxy credentials are nobody else's business.
                flow.request.headers.pop("proxy-authorization", None)
