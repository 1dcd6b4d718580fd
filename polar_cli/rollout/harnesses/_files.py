"""Writing a harness's config files into a session's HOME."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def toml_value(value: object) -> str:
    """A TOML value of a string, number or boolean: JSON's spelling, which TOML shares, except that ASCII JSON writes a
    character past U+FFFF as a surrogate pair (\\ud83d\\ude00), which TOML refuses: strings are written as UTF-8, and
    DEL, which JSON then leaves bare, escaped as TOML wants (the file must be written as UTF-8)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return json.dumps(value)


def no_arg(name: str, arg: str | None) -> None:
    """Presets that take no variant refuse one rather than ignore it."""
    if arg:
        raise ValueError(f"harness {name!r} takes no argument (got {arg!r})")
