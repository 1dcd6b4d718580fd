"""Qwen Code (npm ``@qwen-code/qwen-code``): OpenAI Chat Completions at polar's reverse proxy, the session on
the API key, ``qwen -p`` in YOLO mode (every tool call approved).

Window: ``model.generationConfig.contextWindowSize`` in ``~/.qwen/settings.json`` (its compression triggers at
``model.chatCompression.contextPercentageThreshold`` of it); output cap: ``QWEN_CODE_MAX_OUTPUT_TOKENS``.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext


class QwenCode(InstalledHarness):
    name = "qwen-code"
    binaries = ("qwen",)

    def configure(self, home: Path, ctx: SessionContext) -> None:
        model: dict[str, object] = {"name": ctx.model}
        if ctx.context_window:
            model["generationConfig"] = {"contextWindowSize": ctx.context_window}
        write_json(
            home / ".qwen" / "settings.json",
            {
                "security": {"auth": {"selectedType": "openai"}},
                "model": model,
                "tools": {"approvalMode": "yolo"},
                "general": {"enableAutoUpdate": False},
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False},
            },
        )

    def env(self, ctx: SessionContext) -> dict[str, str]:
        env = {
            "OPENAI_BASE_URL": ctx.reverse_url + "/v1",
            "OPENAI_API_KEY": ctx.api_key(),
            "OPENAI_MODEL": ctx.model,
            "NODE_EXTRA_CA_CERTS": ctx.ca_path,
        }
        if ctx.max_output_tokens:
            env["QWEN_CODE_MAX_OUTPUT_TOKENS"] = str(ctx.max_output_tokens)
        return env

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [executable("qwen"), "--auth-type", "openai", "--yolo", "-p", instruction]


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(QwenCode.name, arg)
    return QwenCode()
