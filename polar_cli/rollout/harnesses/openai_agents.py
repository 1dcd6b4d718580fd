"""The OpenAI Agents SDK (PyPI ``openai-agents``), in its own venv, running polar's bundled agent
(``agent_scripts/openai_agents_coder.py``: one ``bash`` function tool, the task as the prompt; copy it to start your
own; how it is run: ``_bundled.py``).

It speaks the Responses API (not streamed); the SDK names itself in its User-Agent (``Agents/Python 0.24.0``).
Tracing is off (``OPENAI_AGENTS_DISABLE_TRACING``: the SDK would upload every run's spans to OpenAI).
"""

from __future__ import annotations

from polar_cli.rollout.harnesses._bundled import BundledAgent
from polar_cli.rollout.harnesses._files import no_arg
from polar_cli.rollout.harnesses.base import HarnessPreset


class OpenAIAgents(BundledAgent):
    name = "openai-agents"
    venv = "openai-agents"
    distribution = "openai-agents"
    script = "openai_agents_coder.py"
    extra_env = {"OPENAI_AGENTS_DISABLE_TRACING": "1"}


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(OpenAIAgents.name, arg)
    return OpenAIAgents()
