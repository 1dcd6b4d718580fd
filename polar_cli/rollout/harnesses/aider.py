"""Aider (PyPI ``aider-chat``), in its own venv: LiteLLM's ``openai/`` provider at polar's reverse proxy (Chat
Completions, streamed), the session on ``OPENAI_API_KEY``; ``aider --message`` runs one instruction and exits,
``--yes-always`` (it still never runs a shell command it suggests: those need an explicit yes), edits in the
``diff`` (SEARCH/REPLACE) format, no commits, no ``.gitignore`` edit, its chat history in HOME.

Headless and offline: no update check, release notes, analytics, model warnings or URL scraping; its own copy of
LiteLLM's price list (``~/.aider/caches/model_prices_and_context_window.json``, fetched when missing or empty) is
written fresh, holding only the served model, and LiteLLM stays on its bundled copy (``LITELLM_LOCAL_MODEL_COST_MAP``).

Window: ``max_input_tokens`` in ``~/.aider.model.metadata.json``: aider summarises older chat history (with the same
model, as its weak model) past min(max(window / 16, 1024), 8192) tokens; a prompt over the window it only warns of,
and with ``--yes-always`` sends anyway (the engine refuses it, and the run ends). Output cap: the model setting's
``max_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._venv import VenvHarness
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext


class Aider(VenvHarness):
    name = "aider"
    venv = "aider"
    distribution = "aider-chat"

    def configure(self, home: Path, ctx: SessionContext) -> None:
        model = "openai/" + ctx.model  # LiteLLM's provider prefix; the request names ctx.model
        info: dict[str, object] = {"litellm_provider": "openai", "mode": "chat"}
        if ctx.context_window:
            info["max_input_tokens"] = ctx.context_window
        if ctx.max_output_tokens:
            info["max_output_tokens"] = ctx.max_output_tokens
        metadata = {model: info, ctx.model: info}
        write_json(home / ".aider.model.metadata.json", metadata)
        # Non-empty and fresh: aider downloads the price list when its cache is missing, empty or a day old.
        write_json(home / ".aider" / "caches" / "model_prices_and_context_window.json", metadata)
        extra: dict[str, object] = {
            # LiteLLM's OpenAI client sends only the SDK's User-Agent: name the harness for records and stats.
            "extra_headers": {"User-Agent": f"aider/{self.version() or 'unknown'}"},
        }
        if ctx.max_output_tokens:
            extra["max_tokens"] = ctx.max_output_tokens
        write_json(
            home / ".aider.model.settings.yml",  # JSON is YAML
            [{"name": model, "edit_format": "diff", "use_repo_map": True, "extra_params": extra}],
        )

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": ctx.api_key(),
            "OPENAI_API_BASE": ctx.reverse_url + "/v1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # this LiteLLM (1.81) has no LITELLM_OFFLINE_MODE yet
            **self.forward_only_env(ctx),
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        home = ctx.home
        # -P: the workspace (the cwd) is not put on sys.path, so its modules cannot shadow the harness's.
        return [self.python(), "-P", "-m", "aider", "--model", "openai/" + ctx.model, "--message", instruction,
                "--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-gitignore", "--no-check-update",
                "--no-show-release-notes", "--analytics-disable", "--no-show-model-warnings", "--no-detect-urls",
                "--no-pretty", "--no-fancy-input", "--encoding", "utf-8",
                "--chat-history-file", f"{home}/.aider/chat.history.md",
                "--input-history-file", f"{home}/.aider/input.history"]  # fmt: skip


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(Aider.name, arg)
    return Aider()
