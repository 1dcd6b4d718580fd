"""Name -> module lookup shared by the harness and runtime registries: each kind is a package of modules, one per
harness or runtime, whose module-level ``make`` builds it (a new one is one module)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any


def modules_with_make(package: str, path: Iterable[str], skip: set[str]) -> list[str]:
    """The modules of ``package`` that define ``make`` (helper modules and ``skip`` are not entries)."""
    names = [m.name for m in pkgutil.iter_modules(path) if m.name not in skip and not m.name.startswith("_")]
    return sorted(n for n in names if hasattr(importlib.import_module(f"{package}.{n}"), "make"))


def find_make(
    package: str, module_name: str, skip: set[str], unknown: Callable[[], str], not_an_entry: str
) -> tuple[str, Callable[..., Any]]:
    """``(module's full name, its make)``; ValueError ``unknown()`` when no such module, ``not_an_entry`` (with the
    module name in front) when it has no ``make``. Import errors inside an existing module propagate as they are."""
    if not module_name.isidentifier() or module_name in skip:
        raise ValueError(unknown())
    full = f"{package}.{module_name}"
    try:
        module = importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise
        raise ValueError(unknown()) from None
    make = getattr(module, "make", None)
    if make is None:
        raise ValueError(f"{full} {not_an_entry}")
    return full, make
