"""Continue CLI (npm ``@continuedev/cli``, ``cn``): one ``openai`` model in ``~/.continue/config.yaml`` (OpenAI Chat
Completions at polar's reverse proxy, the session on the API key), ``cn -p --auto`` (headless, every tool allowed,
no Continue Hub login: the config is a local file). Telemetry and metrics off; headless runs skip its update check.

Window: the model's ``defaultCompletionOptions.contextLength`` and ``maxTokens`` (it compacts the history near the
context length).
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

CONFIG = Path(".continue") / "config.yaml"


class ContinueCli(InstalledHarness):
    name = "continue-cli"
    binaries = ("cn",)

    def configure(self, home: Path, ctx: SessionContext) -> None:
        model: dict[str, object] = {
            "name": ctx.model,
            "provider": "openai",
            "model": ctx.model,
            "apiBase": ctx.reverse_url + "/v1",
            "apiKey": ctx.api_key(),
            "roles": ["chat", "edit", "apply"],
            "capabilities": ["tool_use"],
        }
        options = {}
        if ctx.context_window:
            options["contextLength"] = ctx.context_window
        if ctx.max_output_tokens:
            options["maxTokens"] = ctx.max_output_tokens
        if options:
            model["defaultCompletionOptions"] = options
        # JSON is YAML: the config stays a plain data file, written without a YAML dependency.
        write_json(home / CONFIG, {"name": "polar", "version": "0.0.1", "schema": "v1", "models": [model]})

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "CONTINUE_CLI_ENABLE_TELEMETRY": "0",
            "CONTINUE_METRICS_ENABLED": "0",
            "NODE_EXTRA_CA_CERTS": ctx.ca_path,
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [executable("cn"), "-p", "--auto", "--config", str(Path(ctx.home) / CONFIG), instruction]


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(ContinueCli.name, arg)
    return ContinueCli()
