"""`--set KEY=VALUE`: extra mitmdump options, as `polar proxy`, `polar rollout` and `polar loop` take them."""

from __future__ import annotations

import json
from collections.abc import Iterable

import typer


def set_options(items: Iterable[str]) -> dict[str, str]:
    """``["polar_max_tokens=512", ...]`` -> ``{"polar_max_tokens": "512"}``; a ValueError for an item without ``=``."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        options[key] = value
    return options


def runtime_options(items: Iterable[str]) -> dict[str, object]:
    """``--runtime-option KEY=VALUE`` items -> the runtime's keyword options: a value that reads as JSON (a number,
    true/false) is that, any other is text, as the runtimes' options are typed (``disk_mb=8192``, ``trust_root=true``).
    """
    parsed: dict[str, object] = {}
    for key, value in set_options(items).items():
        try:
            parsed[key] = json.loads(value)
        except ValueError:
            parsed[key] = value
    return parsed


def parse_set_options(items: Iterable[str]) -> dict[str, str]:
    """:func:`set_options`, a BadParameter on ``--set`` for a bad item."""
    try:
        return set_options(items)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--set") from exc
