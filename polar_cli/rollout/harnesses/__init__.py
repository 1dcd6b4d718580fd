"""Harness presets: one module each (``claude_code``, ``codex``, ``qwen_code``, ``pi``, ``gemini_cli``, ``opencode``,
``kilocode``, ``continue_cli``, ``cline``, ``mini_swe_agent``, ``aider``, ``gptme``, ``kimi_cli``, ``openai_agents``,
``smolagents``, ``openhands``, ``command``), all behind :class:`base.HarnessPreset`.

The convention: ``--harness NAME[:ARG]`` imports ``polar_cli.rollout.harnesses.<NAME with - as _>`` and calls its
module-level ``make(arg: str | None = None) -> HarnessPreset``; ``cmd:ANY COMMAND {instruction}`` is the
``command`` module with the command as its argument. A new preset is one module with a ``make``.
"""

from __future__ import annotations

from polar_cli.rollout.harnesses.base import HarnessPreset
from polar_cli.rollout.registry import find_make, modules_with_make

_NOT_PRESETS = {"base"}


def preset_names() -> list[str]:
    """The preset modules' names (``_`` spelled ``-``) without importing them: for help texts."""
    import pkgutil

    skip = _NOT_PRESETS | {"command"}
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(__path__) if m.name not in skip
                  and not m.name.startswith("_"))  # fmt: skip


def available_presets() -> list[str]:
    """The preset names ``get_preset`` accepts (module names, ``_`` spelled ``-``)."""
    # command is spelled cmd:
    return sorted(n.replace("_", "-") for n in modules_with_make(__name__, __path__, _NOT_PRESETS | {"command"}))


def get_preset(spec: str) -> HarnessPreset:
    """The preset ``spec`` names: ``cmd:COMMAND`` (a shell command with ``{instruction}``), ``NAME`` or ``NAME:ARG``
    (the preset's own argument, e.g. a model or a flavour). ValueError with the available names when unknown."""
    spec = spec.strip()
    if spec.startswith("cmd:"):
        name, arg = "command", spec[len("cmd:") :]
    else:
        name, _, rest = spec.partition(":")
        arg = rest or None
    module, make = find_make(
        __name__,
        name.replace("-", "_"),
        _NOT_PRESETS,
        lambda: (
            f"unknown harness {name!r}; available: {', '.join(available_presets())}, or cmd:'COMMAND {{instruction}}'"
        ),
        "has no make(arg) function: not a harness preset",
    )
    preset = make(arg)
    if not isinstance(preset, HarnessPreset):
        raise TypeError(f"{module}.make returned {type(preset).__name__}, not a HarnessPreset")
    return preset
