"""Sandbox runtimes: one module each (``local``, ``bwrap``, ``oci``), all behind :class:`base.Runtime`.

The convention: ``--runtime NAME`` imports ``polar_cli.rollout.runtimes.<NAME>`` and calls its module-level
``make(**options) -> Runtime``. A remote sandbox (Modal, E2B, Daytona) is one more module with a ``make``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from polar_cli.rollout.runtimes.base import Runtime

_NOT_RUNTIMES = {"base"}


def available_runtimes() -> list[str]:
    """The runtime modules (those with a ``make``; helper modules of the package are not runtimes)."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_RUNTIMES and not m.name.startswith("_")]
    return sorted(n for n in names if hasattr(importlib.import_module(f"{__name__}.{n}"), "make"))


def get_runtime(name: str, **options: Any) -> Runtime:
    """The runtime ``name`` with ``options`` passed to its ``make``; ValueError listing the available ones."""
    module_name = name.strip().replace("-", "_")
    if not module_name.isidentifier() or module_name in _NOT_RUNTIMES:
        raise ValueError(f"unknown runtime {name!r}; available: {', '.join(available_runtimes())}")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{module_name}":
            raise
        raise ValueError(f"unknown runtime {name!r}; available: {', '.join(available_runtimes())}") from None
    make = getattr(module, "make", None)
    if make is None:
        raise ValueError(f"{module.__name__} has no make(**options) function: not a runtime")
    runtime = make(**options)
    if not isinstance(runtime, Runtime):
        raise TypeError(f"{module.__name__}.make returned {type(runtime).__name__}, not a Runtime")
    return runtime
