"""The STORE argument of every read command: a path that holds no trace store is an error, not an empty read."""

from __future__ import annotations

import typer


def existing_store(store: str) -> str:
    """Typer callback: ``store`` unchanged, or a usage error (exit 2) saying why it is no store."""
    from polar_addon.store.reader import StoreNotFound, require_store

    try:
        require_store(store)
    except StoreNotFound as exc:
        raise typer.BadParameter(str(exc)) from exc
    return store
