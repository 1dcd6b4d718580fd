"""gptme (PyPI ``gptme``), in its own venv: its ``local`` provider at polar's reverse proxy (Chat Completions,
streamed), the session on ``OPENAI_API_KEY``; ``gptme --non-interactive`` runs the task and exits at the first answer
that calls its ``complete`` tool (an answer with no tool makes it ask again), every tool call confirmed. Tools:
``shell``, ``save``, ``patch``, ``read`` and ``complete``, in gptme's markdown format (a fenced ``shell`` block in the
answer is a command to run; gptme's own default for an unknown model would be native tool calls).

Headless and offline: the conversation's id is the session's (``--name``), its logs are in HOME, and tiktoken is not
loaded (``GPTME_TIKTOKEN_TIMEOUT=0``: it would download its encodings; gptme counts characters instead). gptme still
gives the conversation a display name with one call of its own (system prompt ``Generate concise conversation
titles.``), which polar tags as its ``title`` side job (``auxiliary``).
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg
from polar_cli.rollout.harnesses._venv import VenvHarness
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

TOOLS = "shell,save,patch,read,complete"


class Gptme(VenvHarness):
    name = "gptme"
    venv = "gptme"
    distribution = "gptme"

    def configure(self, home: Path, ctx: SessionContext) -> None:
        (home / ".config" / "gptme").mkdir(parents=True, exist_ok=True)

    def env(self, ctx: SessionContext) -> dict[str, str]:
        env = {
            "OPENAI_API_KEY": ctx.api_key(),
            "OPENAI_BASE_URL": ctx.reverse_url + "/v1",
            "GPTME_TIKTOKEN_TIMEOUT": "0",
            **self.forward_only_env(ctx),
        }
        if ctx.max_output_tokens:
            env["GPTME_MAX_TOKENS"] = str(ctx.max_output_tokens)
        return env

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        # -P: the workspace (the cwd) is not put on sys.path, so its modules cannot shadow the harness's.
        return [self.python(), "-P", "-m", "gptme", "--non-interactive", "--name", f"polar-{ctx.session_id}",
                "--model", f"local/{ctx.model}", "--tools", TOOLS, "--tool-format", "markdown",
                "-w", ctx.workspace, instruction]  # fmt: skip


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(Gptme.name, arg)
    return Gptme()
