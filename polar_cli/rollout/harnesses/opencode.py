"""opencode (npm ``opencode-ai``, whose Linux binary comes in the optional ``opencode-linux-x64`` package): a
``polar`` provider (the bundled ``@ai-sdk/openai-compatible``: OpenAI Chat Completions) at polar's reverse proxy
whose API key carries the session, in ``~/.config/opencode/opencode.json``; ``opencode run`` with every tool
allowed and the session titled by polar (no title call). The models.dev catalogue fetch, the auto-update,
sharing, LSP downloads and the default plugins (which npm-install at start) are off, so it reaches nothing but the
model API.

Window: the model's ``limit.context``/``limit.output`` (it compacts near the context limit).
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

# opencode's switches (after its OPENCODE_ prefix; its kilocode fork spells them KILO_) that would otherwise reach
# the internet (models.dev, npm, GitHub releases, its share server) or read the user's Claude Code / skills setup.
OFFLINE_SWITCHES = (
    "DISABLE_MODELS_FETCH",
    "DISABLE_AUTOUPDATE",
    "DISABLE_DEFAULT_PLUGINS",
    "DISABLE_LSP_DOWNLOAD",
    "DISABLE_SHARE",
    "DISABLE_CLAUDE_CODE",
    "DISABLE_EXTERNAL_SKILLS",
)


def provider_config(ctx: SessionContext) -> dict[str, object]:
    """The ``opencode.json`` that points opencode (and its kilocode fork) at the session's endpoint."""
    model: dict[str, object] = {"name": ctx.model, "tool_call": True}
    if ctx.context_window:
        # opencode reads both; an output of 0 would mean "unknown", so the window alone gets a fallback cap.
        model["limit"] = {"context": ctx.context_window, "output": ctx.max_output_tokens or ctx.context_window // 8}
    elif ctx.max_output_tokens:
        model["limit"] = {"context": 0, "output": ctx.max_output_tokens}
    return {
        "provider": {
            "polar": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "polar",
                "options": {"baseURL": ctx.reverse_url + "/v1", "apiKey": ctx.api_key()},
                "models": {ctx.model: model},
            }
        },
        "model": f"polar/{ctx.model}",
        # Titles and summaries go to the same served model, not to a hosted small model.
        "small_model": f"polar/{ctx.model}",
        "enabled_providers": ["polar"],
        "autoupdate": False,
        "share": "disabled",
        "lsp": False,
        "formatter": False,
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"},
    }


class OpenCode(InstalledHarness):
    name = "opencode"
    binaries = ("opencode",)
    env_prefix = "OPENCODE_"
    config_file = Path(".config") / "opencode" / "opencode.json"

    def configure(self, home: Path, ctx: SessionContext) -> None:
        write_json(home / self.config_file, provider_config(ctx))

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {**{self.env_prefix + s: "1" for s in OFFLINE_SWITCHES}, "NODE_EXTRA_CA_CERTS": ctx.ca_path}

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        # A title given: no extra model call to title the session. --pure: no external plugins.
        return [
            executable(self.binaries[0]),
            "run",
            "--pure",
            "--model",
            f"polar/{ctx.model}",
            "--title",
            ctx.session_id,
            instruction,
        ]


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(OpenCode.name, arg)
    return OpenCode()
