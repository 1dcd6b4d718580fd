"""Presets that run one of polar's bundled agent scripts (``agent_scripts/``) on an agent SDK installed in its own
venv: the script is copied into the session's HOME (the sandbox needs nothing of the checkout) and takes the task,
``--model`` and ``--max-tokens``; the SDK's OpenAI client reaches polar's reverse proxy through ``OPENAI_BASE_URL``,
the session on ``OPENAI_API_KEY``. No compaction: a prompt over the window is refused and the run ends (non-zero
exit)."""

from __future__ import annotations

import shutil
from pathlib import Path

from polar_cli.rollout.harnesses._venv import VenvHarness
from polar_cli.rollout.harnesses.base import SessionContext

SCRIPTS = Path(__file__).with_name("agent_scripts")


class BundledAgent(VenvHarness):
    script: str  # its file in agent_scripts/
    extra_env: dict[str, str] = {}

    @property
    def in_home(self) -> str:
        return f".polar/{self.script}"

    def configure(self, home: Path, ctx: SessionContext) -> None:
        (home / self.in_home).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SCRIPTS / self.script, home / self.in_home)

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": ctx.api_key(),
            "OPENAI_BASE_URL": ctx.reverse_url + "/v1",
            **self.extra_env,
            **self.forward_only_env(ctx),
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        cap = ["--max-tokens", str(ctx.max_output_tokens)] if ctx.max_output_tokens else []
        # -P: the workspace (the cwd) is not put on sys.path, so its modules cannot shadow the SDK's.
        return [self.python(), "-P", f"{ctx.home}/{self.in_home}", "--model", ctx.model, *cap, instruction]
