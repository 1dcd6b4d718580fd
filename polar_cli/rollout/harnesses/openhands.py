"""OpenHands (PyPI ``openhands-ai``), headless, in its own venv on CPython 3.13: its ``CodeActAgent`` through LiteLLM's
``openai/`` provider at polar's reverse proxy (Chat Completions, not streamed, native tool calls), the session on
``LLM_API_KEY``; ``python -m openhands.core.main -t TASK`` runs the task and exits when the agent calls ``finish``
(an answer without a tool call is answered by its own "continue" message). Its ``cli`` runtime runs commands and edits
files in the session's workspace directly (no Docker: the sandbox is polar's).

0.62.0, the last release of the 0.x line: 1.x's ``openhands-ai`` is the web app only (its headless ``core.main`` is
gone) and the 1.x ``openhands`` CLI with a headless mode requires Python 3.12 exactly, which no registry here ships.

The config is a file the preset writes, ``~/.openhands/polar.toml`` (``--config-file``): the ``cli`` runtime on the
workspace, its file store in HOME, the model ``openai/MODEL`` at the reverse proxy's ``/v1`` with native tool calling
(OpenHands would otherwise prompt an unknown model with its text-based tool format), and the tools that need more
than a shell left out: browsing (a Playwright browser), Jupyter (an IPython kernel) and MCP (its default servers
are fetched and started by ``uvx``). LiteLLM stays on its bundled price list (``LITELLM_LOCAL_MODEL_COST_MAP``).
Tools: ``execute_bash``, ``str_replace_editor``, ``think``, ``task_tracker``, ``finish``. It sends the openai SDK's
User-Agent only, so polar names it by its system prompt (``openhands (OpenAI/Python 1.99.9)``). Its ``cli`` runtime
loses the output of a command that exits before its first 0.1 s poll (an upstream race in
``CLIRuntime._execute_shell_command``); the harness is run as it is.

Window: ``llm.max_input_tokens``; its default condenser keeps a window of the conversation (dropping older events,
no model call) when a request is refused for its length. Output cap: ``llm.max_output_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, toml_value
from polar_cli.rollout.harnesses._venv import VenvHarness
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

CONFIG = ".openhands/polar.toml"


class OpenHands(VenvHarness):
    name = "openhands"
    venv = "openhands"
    distribution = "openhands-ai"

    def settings(self, ctx: SessionContext) -> dict[str, dict[str, object]]:
        llm: dict[str, object] = {
            "model": "openai/" + ctx.model,  # LiteLLM's provider prefix; the request names ctx.model
            "base_url": ctx.reverse_url + "/v1",
            "native_tool_calling": True,
        }
        if ctx.context_window:
            llm["max_input_tokens"] = ctx.context_window
        if ctx.max_output_tokens:
            llm["max_output_tokens"] = ctx.max_output_tokens
        return {
            "core": {
                "runtime": "cli",
                "workspace_base": ctx.workspace,
                "file_store": "local",
                "file_store_path": f"{ctx.home}/.openhands/file_store",
            },
            "llm": llm,
            "agent": {"enable_browsing": False, "enable_jupyter": False, "enable_mcp": False},
        }

    def configure(self, home: Path, ctx: SessionContext) -> None:
        lines = []
        for table, values in self.settings(ctx).items():
            lines += [f"[{table}]", *(f"{key} = {toml_value(value)}" for key, value in values.items()), ""]
        path = home / CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines), encoding="utf-8")  # TOML is UTF-8

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "LLM_API_KEY": ctx.api_key(),  # the config file holds no key
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            **self.forward_only_env(ctx),
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        # -P: the workspace (the cwd) is not put on sys.path, so its modules cannot shadow the harness's.
        return [self.python(), "-P", "-m", "openhands.core.main", "--config-file", f"{ctx.home}/{CONFIG}",
                "-t", instruction]  # fmt: skip


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(OpenHands.name, arg)
    return OpenHands()
