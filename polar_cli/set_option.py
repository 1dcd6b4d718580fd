"""`--set KEY=VALUE`: extra mitmdump options, as `polar proxy`, `polar rollout` and `polar loop` take them."""

from __future__ import annotations

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


def parse_set_options(items: Iterable[str]) -> dict[str, str]:
    """:func:`set_options`, a BadParameter on ``--set`` for a bad item."""
    try:
        return set_options(items)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--set") from exc
