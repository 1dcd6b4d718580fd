"""Harness presets: one module each (``claude_code``, ``codex``, ``qwen_code``, ``pi``, ``gemini_cli``,
``command``), all behind :class:`base.HarnessPreset`.

The convention: ``--harness NAME[:ARG]`` imports ``polar_cli.rollout.harnesses.<NAME with - as _>`` and calls its
module-level ``make(arg: str | None = None) -> HarnessPreset``; ``cmd:ANY COMMAND {instruction}`` is the
``command`` module with the command as its argument. A new preset is one module with a ``make``.
"""

from __future__ import annotations

import importlib
import pkgutil

from polar_cli.rollout.harnesses.base import HarnessPreset

_NOT_PRESETS = {"base"}


def available_presets() -> list[str]:
    """The preset names ``get_preset`` accepts (module names, ``_`` spelled ``-``)."""
    names = [m.name for m in pkgutil.iter_modules(__path__)
             if m.name not in _NOT_PRESETS and m.name != "command" and not m.name.startswith("_")]  # command: cmd:
    return sorted(n.replace("_", "-") for n in names if hasattr(importlib.import_module(f"{__name__}.{n}"), "make"))


def get_preset(spec: str) -> HarnessPreset:
    """The preset ``spec`` names: ``cmd:COMMAND`` (a shell command with ``{instruction}``), ``NAME`` or ``NAME:ARG``
    (the preset's own argument, e.g. a model or a flavour). ValueError with the available names when unknown."""
    spec = spec.strip()
    if spec.startswith("cmd:"):
        name, arg = "command", spec[len("cmd:"):]
    else:
        name, _, rest = spec.partition(":")
        arg = rest or None
    module_name = name.replace("-", "_")
    if not module_name.isidentifier() or module_name in _NOT_PRESETS:
        raise ValueError(f"unknown harness {name!r}; available: {', '.join(available_presets())}, or cmd:'COMMAND {{instruction}}'")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{module_name}":
            raise
        raise ValueError(f"unknown harness {name!r}; available: {', '.join(available_presets())}, "
                         "or cmd:'COMMAND {instruction}'") from None
    make = getattr(module, "make", None)
    if make is None:
        raise ValueError(f"{module.__name__} has no make(arg) function: not a harness preset")
    preset = make(arg)
    if not isinstance(preset, HarnessPreset):
        raise TypeError(f"{module.__name__}.make returned {type(preset).__name__}, not a HarnessPreset")
    return preset
