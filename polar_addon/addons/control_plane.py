"""The control plane addon: rewards, statuses and session registrations (polar_addon.control), answered on
polar.local (or a reverse listener's control paths) with the control token, never forwarded."""

from __future__ import annotations

import logging

import orjson
from mitmproxy import ctx, exceptions, http

from polar_addon import identity
from polar_addon.addons.scope import is_control_flow
from polar_addon.addons.shared import Shared
from polar_addon.control import ControlPlane, check_token, is_control_path, load_or_create_token, token_file

log = logging.getLogger("polar")


class ControlPlaneAddon:
    """Creates the control plane once the capture addon has its store, and answers every control flow."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def load(self, loader) -> None:
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
            "Bearer token required to post rewards and statuses (default: generated into "
            "<polar_out>/.control-token, mode 0600).",
        )

    def configure(self, updated: set[str]) -> None:
        gateway = self.shared.gateway
        if gateway is None or not any(name.startswith("polar_") for name in updated):
            return
        if self.shared.control is None:
            self.shared.control = ControlPlane(
                gateway.store,
                self._token(),
                on_session_end=gateway.pool.release,
                sessions_mode=lambda: ctx.options.polar_sessions,
                sampling_mode=lambda: ctx.options.polar_sampling,
            )
        elif "polar_control_token" in updated:
            self.shared.control.token = self._token()

    @staticmethod
    def _token() -> str:
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

    async def request(self, flow: http.HTTPFlow) -> None:
        control = self.shared.control
        if control is None or flow.response is not None or not is_control_flow(flow):
            return
        if is_control_path(flow.request.path):
            status, payload = await control.handle(
                flow.request.method,
                flow.request.path,
                flow.request.headers.get("authorization"),
                flow.request.raw_content or b"",
            )
        else:
            status, payload = 404, {"error": {"type": "not_found", "message": "polar control: no such path"}}
        flow.response = http.Response.make(status, orjson.dumps(payload), {"content-type": "application/json"})
