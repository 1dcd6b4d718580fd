"""Claude Code (npm ``@anthropic-ai/claude-code``): ``ANTHROPIC_BASE_URL`` at polar's reverse proxy, the session
on the API key (its API client cannot use a proxy URL that carries credentials), every model alias the served
model, ``claude -p`` with permissions bypassed.

Window: ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` is Claude Code's context window for a model whose name does not start
with ``claude-``; ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` caps each answer. Read from Claude Code 2.1's binary: it
compacts *proactively* only when its auto-compact window comes from somewhere other than its own default (with
that default it relies on reactive compaction after a "prompt is too long"), so the preset also sets
``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` (Claude Code takes ``min(context window, max(it, 100000))``: the served window
below 100k). It then compacts once a call's usage passes ``window - min(output cap, 20000) - 13000``
(``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` only lowers that). Its own output cap for an unknown model (32,000) leaves
no room below a window under ~33k, so when the user gives no cap the preset sets one at :data:`OUTPUT_SHARE` of
the window; below ~15k no cap leaves a positive threshold.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

MODEL_VARS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)


# Claude Code's default output cap for a model it does not know is 32,000 (it reserves up to 20,000 of it).
OUTPUT_SHARE = 0.125


class ClaudeCode(InstalledHarness):
    name = "claude-code"
    binaries = ("claude",)

    def configure(self, home: Path, ctx: SessionContext) -> None:
        write_json(
            home / ".claude" / "settings.json",
            {"permissions": {"defaultMode": "bypassPermissions"}, "includeCoAuthoredBy": False},
        )
        # Onboarding already done: a headless run never stops at a first-run screen.
        write_json(home / ".claude.json", {"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})

    def env(self, ctx: SessionContext) -> dict[str, str]:
        env = {var: ctx.model for var in MODEL_VARS}
        env.update(
            {
                "ANTHROPIC_BASE_URL": ctx.reverse_url,
                "ANTHROPIC_API_KEY": ctx.api_key(),
                "NODE_EXTRA_CA_CERTS": ctx.ca_path,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, error reports, update checks
                "DISABLE_AUTOUPDATER": "1",
                "DISABLE_TELEMETRY": "1",
                # Root may bypass permissions only when it says it is sandboxed; it is (polar's runtime).
                "IS_SANDBOX": "1",
            }
        )
        if ctx.context_window:
            env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(ctx.context_window)
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(ctx.context_window)
        if ctx.max_output_tokens:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(ctx.max_output_tokens)
        elif ctx.context_window:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max(1, int(ctx.context_window * OUTPUT_SHARE)))
        return env

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return [
            executable("claude"),
            "-p",
            instruction,
            "--permission-mode",
            "bypassPermissions",
            "--output-format",
            "json",
        ]


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(ClaudeCode.name, arg)
    return ClaudeCode()
