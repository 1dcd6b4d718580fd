"""Writing a harness's config files into a session's HOME."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def no_arg(name: str, arg: str | None) -> None:
    """Presets that take no variant refuse one rather than ignore it."""
    if arg:
        raise ValueError(f"harness {name!r} takes no argument (got {arg!r})")
