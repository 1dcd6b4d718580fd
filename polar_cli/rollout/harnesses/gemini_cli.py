"""Gemini CLI (npm ``@google/gemini-cli``): ``GOOGLE_GEMINI_BASE_URL`` at polar's reverse proxy, the session on
the API key (``x-goog-api-key``), API-key auth chosen in ``~/.gemini/settings.json``, ``gemini -p`` with
``--yolo`` and ``--skip-trust`` (a headless run in a fresh folder).

Window: the CLI has no window setting; it takes any model it does not know for 1,048,576 tokens and compresses
the chat at ``model.compressionThreshold`` times that, so the preset sets the threshold to the same share of the
served window (:data:`COMPRESS_SHARE`). Output cap: ``maxOutputTokens`` in a ``modelConfigs.overrides`` entry
for the model.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

ASSUMED_WINDOW = 1_048_576  # tokenLimit() for a model name the CLI does not know
COMPRESS_SHARE = 0.5  # the CLI's own default threshold, applied to the served window


class GeminiCli(InstalledHarness):
    name = "gemini-cli"
    binaries = ("gemini",)

    def configure(self, home: Path, ctx: SessionContext) -> None:
        settings: dict[str, object] = {
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
        }
        if ctx.context_window:
            settings["model"] = {"compressionThreshold": COMPRESS_SHARE * ctx.context_window / ASSUMED_WINDOW}
        if ctx.max_output_tokens:
            settings["modelConfigs"] = {
                "overrides": [
                    {
                        "match": {"model": ctx.model},
                        "modelConfig": {"generateContentConfig": {"maxOutputTokens": ctx.max_output_tokens}},
                    }
                ]
            }
        write_json(home / ".gemini" / "settings.json", settings)

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "GOOGLE_GEMINI_BASE_URL": ctx.reverse_url,
            "GEMINI_API_KEY": ctx.api_key(),
            "NODE_EXTRA_CA_CERTS": ctx.ca_path,
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [executable("gemini"), "-p", instruction, "-m", ctx.model, "--yolo", "--skip-trust"]


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(GeminiCli.name, arg)
    return GeminiCli()
