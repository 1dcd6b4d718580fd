"""Pi (npm ``@mariozechner/pi-coding-agent``): a ``polar`` provider in ``~/.pi/agent/models.json`` whose base URL
is polar's reverse proxy and whose API key carries the session; ``pi -p --no-session`` (Pi asks no approvals).
``pi:API`` picks the API Pi speaks: ``openai-completions`` (default), ``openai-responses``,
``anthropic-messages`` or ``google-generative-ai``.

Window: the model entry's ``contextWindow`` and ``maxTokens`` (Pi compacts by them).
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

# api -> the path after the reverse proxy's URL that its SDK expects
API_PATHS = {
    "openai-completions": "/v1",
    "openai-responses": "/v1",
    "anthropic-messages": "",
    "google-generative-ai": "/v1beta",
}


class Pi(InstalledHarness):
    name = "pi"
    binaries = ("pi",)

    def __init__(self, api: str = "openai-completions") -> None:
        self.api = api

    def configure(self, home: Path, ctx: SessionContext) -> None:
        model: dict[str, object] = {"id": ctx.model}
        if ctx.context_window:
            model["contextWindow"] = ctx.context_window
        if ctx.max_output_tokens:
            model["maxTokens"] = ctx.max_output_tokens
        provider: dict[str, object] = {
            "baseUrl": ctx.reverse_url + API_PATHS[self.api],
            "api": self.api,
            "apiKey": ctx.api_key(),
            "models": [model],
        }
        if self.api.startswith("openai"):
            # Served models are not OpenAI's: no developer role, no reasoning_effort.
            provider["compat"] = {"supportsDeveloperRole": False, "supportsReasoningEffort": False}
        write_json(home / ".pi" / "agent" / "models.json", {"providers": {"polar": provider}})

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {"PI_OFFLINE": "1", "NODE_EXTRA_CA_CERTS": ctx.ca_path}

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [executable("pi"), "-p", "--provider", "polar", "--model", ctx.model, "--no-session", instruction]


def make(arg: str | None = None) -> HarnessPreset:
    api = arg or "openai-completions"
    if api not in API_PATHS:
        raise ValueError(f"harness 'pi': unknown API {api!r}; use one of {', '.join(API_PATHS)}")
    return Pi(api)
