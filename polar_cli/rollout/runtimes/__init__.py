"""Sandbox runtimes: one module each (``local``, ``bwrap``, ``oci``), all behind :class:`base.Runtime`.

The convention: ``--runtime NAME`` imports ``polar_cli.rollout.runtimes.<NAME>`` and calls its module-level
``make(**options) -> Runtime``. A remote sandbox (Modal, E2B, Daytona) is one more module with a ``make``.
"""

from __future__ import annotations

from typing import Any

from polar_cli.rollout.registry import find_make, modules_with_make
from polar_cli.rollout.runtimes.base import Runtime

_NOT_RUNTIMES = {"base"}


def available_runtimes() -> list[str]:
    """The runtime modules (those with a ``make``; helper modules of the package are not runtimes)."""
    return modules_with_make(__name__, __path__, _NOT_RUNTIMES)


def get_runtime(name: str, **options: Any) -> Runtime:
    """The runtime ``name`` with ``options`` passed to its ``make``; ValueError listing the available ones."""
    module, make = find_make(
        __name__,
        name.strip().replace("-", "_"),
        _NOT_RUNTIMES,
        lambda: f"unknown runtime {name!r}; available: {', '.join(available_runtimes())}",
        "has no make(**options) function: not a runtime",
    )
    runtime = make(**options)
    if not isinstance(runtime, Runtime):
        raise TypeError(f"{module}.make returned {type(runtime).__name__}, not a Runtime")
    return runtime
