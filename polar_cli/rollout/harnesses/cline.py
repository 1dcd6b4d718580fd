"""Cline CLI (npm ``cline``, its binary from the optional ``@cline/cli-linux-x64``): the ``openai-compatible``
provider (OpenAI Chat Completions) at polar's reverse proxy, the session on the API key, in
``~/.cline/data/settings/providers.json`` (what ``cline auth -p openai -b URL`` writes); ``cline --json`` on the
prompt (act mode, every tool auto-approved), the local session backend (no hub daemon), telemetry opted out and
auto-update off in ``global-settings.json``.

Window: none the preset can set (Cline takes it from its own model catalogue); at its limit it compacts (its
default ``--compaction agentic``: a model call that summarises the history).
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

PROVIDER = "openai-compatible"
UPDATED_AT = "2026-01-01T00:00:00.000Z"


class Cline(InstalledHarness):
    name = "cline"
    binaries = ("cline",)

    def configure(self, home: Path, ctx: SessionContext) -> None:
        settings = home / ".cline" / "data" / "settings"
        provider = {
            "provider": PROVIDER,
            "apiKey": ctx.api_key(),
            "model": ctx.model,
            "baseUrl": ctx.reverse_url + "/v1",
        }
        write_json(
            settings / "providers.json",
            {
                "version": 1,
                "lastUsedProvider": PROVIDER,
                "modes": {},
                # Without updatedAt Cline drops the entry and falls back to its default base URL (api.openai.com).
                "providers": {PROVIDER: {"settings": provider, "updatedAt": UPDATED_AT, "tokenSource": "manual"}},
            },
        )
        write_json(settings / "global-settings.json", {"telemetryOptOut": True, "autoUpdateEnabled": False})

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "CLINE_SESSION_BACKEND_MODE": "local",  # else it starts a background hub daemon
            "CLINE_NO_AUTO_UPDATE": "1",
            "NODE_EXTRA_CA_CERTS": ctx.ca_path,
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [
            executable("cline"),
            "--json",
            "--auto-approve",
            "true",
            "-c",
            ctx.workspace,
            "-P",
            PROVIDER,
            "-m",
            ctx.model,
            instruction,
        ]


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(Cline.name, arg)
    return Cline()
