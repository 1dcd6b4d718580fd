"""Codex (npm ``@openai/codex``), ``codex exec`` with approvals and its own sandbox off (polar's runtime is the
sandbox; Codex's Linux sandbox cannot nest inside an unprivileged user namespace).

- ``codex`` (default): the default provider, unchanged, through polar's forward proxy: ``HTTPS_PROXY`` carries
  the session's secret as its credentials, mitmproxy's CA is trusted; Codex speaks Responses over its WebSocket.
- ``codex:http``: a custom provider whose base URL is polar's reverse proxy (Responses over HTTP POSTs, the
  session on the API key).

Window: ``model_context_window`` and ``model_auto_compact_token_limit`` in ``config.toml``; Codex has no
setting for the output cap.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import toml_value
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

# Compact at this share of the window, leaving room for the summary turn and the next answer.
AUTO_COMPACT_SHARE = 0.8


class Codex(InstalledHarness):
    name = "codex"
    binaries = ("codex",)

    def __init__(self, custom_provider: bool = False) -> None:
        self.custom_provider = custom_provider

    def configure(self, home: Path, ctx: SessionContext) -> None:
        settings: dict[str, object] = {
            "model": ctx.model,
            "approval_policy": "never",
            "sandbox_mode": "danger-full-access",
            "check_for_update_on_startup": False,
        }
        if ctx.context_window:
            settings["model_context_window"] = ctx.context_window
            settings["model_auto_compact_token_limit"] = int(ctx.context_window * AUTO_COMPACT_SHARE)
        lines = [f"{key} = {toml_value(value)}" for key, value in settings.items()]
        if self.custom_provider:
            lines.insert(1, 'model_provider = "polar"')
        lines += ["", "[analytics]", "enabled = false", "", "[feedback]", "enabled = false"]
        # Plugins off: on every start Codex syncs its curated plugin catalogue from github.com, api.github.com and
        # chatgpt.com (refused by a proxy-only sandbox, but a network attempt all the same).
        lines += ["", "[features]", "plugins = false", "remote_plugin = false"]
        if self.custom_provider:
            lines += [
                "",
                "[model_providers.polar]",
                'name = "polar"',
                f"base_url = {toml_value(ctx.reverse_url + '/v1')}",
                'env_key = "POLAR_API_KEY"',
                'wire_api = "responses"',
                "supports_websockets = false",
                "request_max_retries = 0",
                "stream_max_retries = 0",
            ]
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")  # TOML is UTF-8

    def env(self, ctx: SessionContext) -> dict[str, str]:
        env = {"CODEX_HOME": str(Path(ctx.home) / ".codex"), "RUST_LOG": "warn"}
        if self.custom_provider:
            env["POLAR_API_KEY"] = ctx.api_key()
        else:
            env.update(
                {
                    "HTTPS_PROXY": ctx.forward_proxy_url(),
                    "CODEX_CA_CERTIFICATE": ctx.ca_path,
                    "SSL_CERT_FILE": ctx.ca_path,
                    "OPENAI_API_KEY": "sk-polar-forward-proxy",
                }
            )
        return env

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [
            executable("codex"),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--color",
            "never",
            instruction,
        ]


def make(arg: str | None = None) -> HarnessPreset:
    if arg not in (None, "", "http"):
        raise ValueError(
            f"harness 'codex' takes no argument or 'http' (a custom provider at the reverse proxy), got {arg!r}"
        )
    return Codex(custom_provider=arg == "http")
