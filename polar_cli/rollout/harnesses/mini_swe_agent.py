"""mini-swe-agent (PyPI ``mini-swe-agent``, the agent SWE-smith and SkyRL train with), in its own venv: LiteLLM's
``openai/`` provider at polar's reverse proxy (Chat Completions), the session on ``OPENAI_API_KEY``, ``mini -y
--exit-immediately`` (no confirmations, no prompt at the end) with its cost limit off.

``mini-swe-agent:toolcall`` (default, mini 2's own default ``mini.yaml``): one ``bash`` tool; the model calls it.
``mini-swe-agent:textbased`` (``mini_textbased.yaml``, the v1 / SWE-agent style): no tools; the model answers with
one ``mswea_bash_command`` fenced block per turn. Either way the agent finishes when a command prints
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``.

Headless: ``MSWEA_CONFIGURED`` skips the first-run wizard (it reads a terminal: "Input is not a terminal");
``MSWEA_COST_TRACKING=ignore_errors`` keeps an unpriced model from stopping the run; ``LITELLM_OFFLINE_MODE`` /
``LITELLM_LOCAL_MODEL_COST_MAP`` keep LiteLLM on its bundled price list and catalogs instead of fetching them at
every start. Window: mini has no setting and never compacts: a request past the window fails and mini exits
(LiteLLM's ``ContextWindowExceededError`` is one of the errors it does not retry). Output cap: ``max_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import write_json
from polar_cli.rollout.harnesses._venv import VenvHarness
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

# flavour -> (mini's bundled config, its model class)
FLAVOURS = {
    "toolcall": ("mini.yaml", "litellm"),
    "textbased": ("mini_textbased.yaml", "litellm_textbased"),
}
CONFIG = ".config/polar/mini-swe-agent.yaml"  # under HOME; JSON is YAML
TRAJECTORY = ".config/polar/mini-swe-agent.traj.json"


class MiniSweAgent(VenvHarness):
    name = "mini-swe-agent"
    venv = "mini-swe-agent"
    distribution = "mini-swe-agent"

    def __init__(self, flavour: str = "toolcall") -> None:
        self.flavour = flavour

    def configure(self, home: Path, ctx: SessionContext) -> None:
        _, model_class = FLAVOURS[self.flavour]
        model_kwargs: dict[str, object] = {
            "api_base": ctx.reverse_url + "/v1",
            "drop_params": True,
            # LiteLLM's OpenAI client sends only the SDK's User-Agent: name the harness, so records and
            # `polar stats` tell it apart from any other openai-SDK program.
            "extra_headers": {"User-Agent": f"mini-swe-agent/{self.version() or 'unknown'} ({self.flavour})"},
        }
        if ctx.max_output_tokens:
            model_kwargs["max_tokens"] = ctx.max_output_tokens
        write_json(
            home / CONFIG,
            {
                "agent": {"mode": "yolo", "confirm_exit": False, "cost_limit": 0},
                # LiteLLM needs a provider prefix; it sends the model name without it.
                "model": {
                    "model_class": model_class,
                    "model_name": "openai/" + ctx.model,
                    "cost_tracking": "ignore_errors",
                    "model_kwargs": model_kwargs,
                },
            },
        )

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": ctx.api_key(),
            "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{ctx.home}/.config/mini-swe-agent",
            "LITELLM_OFFLINE_MODE": "true",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            **self.forward_only_env(ctx),
        }

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        builtin, _ = FLAVOURS[self.flavour]
        # -P: the workspace (the cwd) is not put on sys.path, so its modules cannot shadow the harness's.
        return [self.python(), "-P", "-m", "minisweagent.run.mini", "-y", "--exit-immediately",
                "-c", builtin, "-c", f"{ctx.home}/{CONFIG}", "-t", instruction,
                "-o", f"{ctx.home}/{TRAJECTORY}"]  # fmt: skip


def make(arg: str | None = None) -> HarnessPreset:
    flavour = arg or "toolcall"
    if flavour not in FLAVOURS:
        raise ValueError(f"harness 'mini-swe-agent': unknown flavour {flavour!r}; use one of {', '.join(FLAVOURS)}")
    return MiniSweAgent(flavour)
