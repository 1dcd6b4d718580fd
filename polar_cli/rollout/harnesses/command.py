"""``--harness cmd:'ANY COMMAND {instruction}'``: any program that talks to a model API, run once per session.

The command is a shell line; ``{instruction}`` becomes the task's instruction as one shell-quoted word (the runner
also puts it in ``$POLAR_INSTRUCTION``), and ``{model}``, ``{session}``, ``{task}``, ``{sample}``, ``{workspace}`` are filled in the
same way. The environment points every common client at polar: the openai, anthropic and google-genai SDKs by base
URL and a ``polar:`` API key that carries the session's identity, anything else by ``HTTPS_PROXY`` (with the identity
as proxy credentials) and mitmproxy's CA in the usual CA variables.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

PLACEHOLDERS = ("instruction", "model", "session", "task", "sample", "workspace")


class CommandPreset(HarnessPreset):
    name = "cmd"

    def __init__(self, template: str) -> None:
        if not template.strip():
            raise ValueError("cmd: needs a command, e.g. cmd:'python agent.py {instruction}'")
        self.template = template

    def configure(self, home: Path, ctx: SessionContext) -> None:
        """A plain command has no config files of its own."""

    def env(self, ctx: SessionContext) -> dict[str, str]:
        key = ctx.api_key()
        return {
            "OPENAI_API_KEY": key, "ANTHROPIC_API_KEY": key, "GEMINI_API_KEY": key, "GOOGLE_API_KEY": key,
            "OPENAI_BASE_URL": f"{ctx.reverse_url}/v1", "ANTHROPIC_BASE_URL": ctx.reverse_url,
            "GOOGLE_GEMINI_BASE_URL": ctx.reverse_url,
            "OPENAI_MODEL": ctx.model, "ANTHROPIC_MODEL": ctx.model,
            "HTTPS_PROXY": ctx.forward_proxy_url(), "https_proxy": ctx.forward_proxy_url(),
            # The reverse listener is plain http on loopback: reached directly, never through the forward proxy.
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "SSL_CERT_FILE": ctx.ca_path, "NODE_EXTRA_CA_CERTS": ctx.ca_path, "REQUESTS_CA_BUNDLE": ctx.ca_path,
            "CURL_CA_BUNDLE": ctx.ca_path,
            "POLAR_SESSION": ctx.session_id, "POLAR_TASK": ctx.task_id, "POLAR_GROUP": ctx.group_id,
            "POLAR_SAMPLE": str(ctx.sample), "POLAR_MODEL": ctx.model,
        }  # fmt: skip

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        values = {"instruction": instruction, "model": ctx.model, "session": ctx.session_id, "task": ctx.task_id,
                  "sample": str(ctx.sample), "workspace": ctx.workspace}
        line = self.template
        for name in PLACEHOLDERS:
            line = line.replace("{" + name + "}", shlex.quote(values[name]))
        return ["sh", "-c", line]


def make(arg: str | None = None) -> HarnessPreset:
    return CommandPreset(arg or "")
