"""Kimi CLI (PyPI ``kimi-cli``, Moonshot AI's coding agent), in its own venv on CPython 3.13: its native ``kimi``
provider (Moonshot's Chat Completions dialect, streamed; User-Agent ``KimiCLI/VERSION``) at polar's reverse proxy,
the session on ``KIMI_API_KEY`` (the config file holds none); ``--print`` runs one prompt non-interactively and exits
at the first answer without a tool call, every tool call approved (``--print`` auto-approves; ``--yolo`` says so).

1.52.0, the last release (the project is archived), gates its ``kimi`` console script: with arguments it only prints a
deprecation notice, with none it downloads and runs the successor's install script. The preset runs the CLI itself,
``python -P -m kimi_cli.cli`` (the Typer app the gate no longer reaches; kimi-cli starts its own worker processes the
same way), never the gated script.

The config is a file the preset writes, ``~/.kimi/polar.json`` (``--config-file``): one provider ``polar`` of type
``kimi`` at the reverse proxy's ``/v1`` and one model ``polar`` naming the served model; telemetry off (also
``KIMI_DISABLE_TELEMETRY``), no auto-update (``KIMI_CLI_NO_AUTO_UPDATE``; only its shell UI checks). Its web tools
need Moonshot's services, which are not configured: ``SearchWeb`` is left out, ``FetchURL`` would GET the page through
``HTTPS_PROXY``, the forward listener, which refuses (and logs) it. Sessions, logs and its device id live in HOME.

Window: the model's ``max_context_size``. Kimi CLI compacts (one model call, system prompt ``You are a helpful
assistant that compacts conversation context.``) when the context reaches 85 % of it or leaves less than
``loop_control.reserved_context_size`` free (its default, 50,000, would compact at every step of a small window: the
preset sets it to the output cap, else a quarter of the window, within kimi's floor of 1,000 and its default). Each
request's ``max_completion_tokens`` is what the window leaves, capped by ``KIMI_MODEL_MAX_COMPLETION_TOKENS`` (the
output cap).
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._venv import VenvHarness
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

CONFIG = ".kimi/polar.json"
# Kimi CLI's own default for a model whose window it is not told, and its default output reserve.
DEFAULT_CONTEXT = 100_000
DEFAULT_RESERVE = 50_000
MIN_RESERVE = 1_000  # loop_control.reserved_context_size's lower bound


def reserved_context(window: int | None, max_output: int | None) -> int | None:
    """The free context below which kimi compacts: the output cap, else a quarter of the window (None: kimi's
    default), within [1,000, 50,000]."""
    wanted = max_output or (window // 4 if window else None)
    return None if wanted is None else max(MIN_RESERVE, min(DEFAULT_RESERVE, wanted))


class KimiCli(VenvHarness):
    name = "kimi-cli"
    venv = "kimi-cli"
    distribution = "kimi-cli"

    def configure(self, home: Path, ctx: SessionContext) -> None:
        config: dict[str, object] = {
            "default_model": "polar",
            "providers": {"polar": {"type": "kimi", "base_url": ctx.reverse_url + "/v1", "api_key": ""}},
            "models": {
                "polar": {
                    "provider": "polar",
                    "model": ctx.model,
                    "max_context_size": ctx.context_window or DEFAULT_CONTEXT,
                }
            },
            "telemetry": False,
        }
        reserve = reserved_context(ctx.context_window, ctx.max_output_tokens)
        if reserve is not None:
            config["loop_control"] = {"reserved_context_size": reserve}
        write_json(home / CONFIG, config)

    def env(self, ctx: SessionContext) -> dict[str, str]:
        env = {
            "KIMI_API_KEY": ctx.api_key(),  # the provider's key (the config file holds none)
            "KIMI_SHARE_DIR": f"{ctx.home}/.kimi",
            "KIMI_DISABLE_TELEMETRY": "1",
            "KIMI_CLI_NO_AUTO_UPDATE": "1",
            **self.forward_only_env(ctx),
        }
        if ctx.max_output_tokens:
            env["KIMI_MODEL_MAX_COMPLETION_TOKENS"] = str(ctx.max_output_tokens)
        return env

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        # -P: the workspace (the cwd) is not put on sys.path, so its modules cannot shadow the harness's.
        return [self.python(), "-P", "-m", "kimi_cli.cli", "--config-file", f"{ctx.home}/{CONFIG}",
                "--work-dir", ctx.workspace, "--print", "--yolo", "--prompt", instruction]  # fmt: skip


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(KimiCli.name, arg)
    return KimiCli()
