"""`--set KEY=VALUE`: extra mitmdump options, as `polar proxy`, `polar rollout` and `polar loop` take them."""

from __future__ import annotations

from collections.abc import Iterable

import typer


def parse_set_options(items: Iterable[str]) -> dict[str, str]:
    """``["polar_max_tokens=512", ...]`` -> ``{"polar_max_tokens": "512"}``; a BadParameter on ``--set`` otherwise."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--set")
        options[key] = value
    return options
