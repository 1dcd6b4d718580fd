"""smolagents (PyPI ``smolagents``), in its own venv, running polar's bundled ``CodeAgent``
(``agent_scripts/smolagents_coder.py``: it acts by writing Python, with one ``bash`` tool; copy it to start your own;
how it is run: ``_bundled.py``).

Chat Completions (not streamed) through ``OpenAIServerModel``, with no tools declared: the actions are code blocks
in the text (``<code>...</code>``, the stop sequence ``</code>``), run by smolagents' local Python interpreter; the
script names the agent in its User-Agent (``smolagents/1.26.0``). smolagents sends no telemetry.
"""

from __future__ import annotations

from polar_cli.rollout.harnesses._bundled import BundledAgent
from polar_cli.rollout.harnesses._files import no_arg
from polar_cli.rollout.harnesses.base import HarnessPreset


class Smolagents(BundledAgent):
    name = "smolagents"
    venv = "smolagents"
    distribution = "smolagents"
    script = "smolagents_coder.py"


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(Smolagents.name, arg)
    return Smolagents()
