"""One import, end to end: resolve the sources, stage and verify the bytes, convert, record, and move the finished
folder into place, so ``out`` is either the complete model or what it was before (never half-written)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from polar_cli.gguf_import import convert, parts, provenance

MODELS_DIR_ENV = "POLAR_MODELS_DIR"


def models_dir() -> Path:
    """Where real models are cached: ``$POLAR_MODELS_DIR``, else ``~/.cache/polar/models`` (outside any checkout)."""
    return Path(os.environ.get(MODELS_DIR_ENV) or Path.home() / ".cache" / "polar" / "models")


@dataclass
class ImportRequest:
    """What to import and how; the CLI's settings become one of these."""

    sources: list[Path]
    out: Path
    name: str
    sha256: str | None = None
    size: int | None = None
    dtype: str = "bfloat16"
    generation: dict[str, object] = field(default_factory=dict)
    licence: str | None = None
    upstream: str | None = None
    notes: list[str] = field(default_factory=list)
    force: bool = False


@dataclass(frozen=True)
class ImportResult:
    out: Path
    skipped: bool  # already imported: nothing read, nothing written
    record: dict[str, object] | None


def import_gguf(request: ImportRequest) -> ImportResult:
    """Import ``request.sources`` into ``request.out``; a finished import of the same checkpoint is left as is."""
    if request.sha256 is not None and not parts.is_sha256(request.sha256):
        raise parts.ImportRefused(f"--sha256 {request.sha256!r} is not 64 hex digits")
    if request.dtype not in convert.DTYPES:
        raise parts.ImportRefused(f"dtype {request.dtype!r}: use one of {', '.join(convert.DTYPES)}")
    names = [p.name for p in request.sources]
    out = request.out
    if not request.force and provenance.already_imported(out, request.sha256, names):
        return ImportResult(out, True, provenance.read(out))
    if out.exists() and not _replaceable(out):
        raise parts.ImportRefused(f"{out} exists and holds no polar import: give an empty or new --out")
    sources = parts.resolve_sources(request.sources)
    work = out.parent / f".{out.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    try:
        gguf, digest = parts.stage(sources, work)
        parts.verify(digest, size=request.size, sha256=request.sha256)
        parts.check_magic(gguf)
        metadata = convert.gguf_metadata(gguf)
        hf = work / "hf"
        done = convert.convert(gguf, hf, dtype=request.dtype, generation=request.generation, metadata=metadata)
        record = provenance.Provenance(
            name=request.name,
            sources=provenance.sources_of(digest),
            gguf_size=digest.size,
            gguf_sha256=digest.sha256,
            expected_sha256=request.sha256.lower() if request.sha256 else None,
            gguf_metadata=metadata,
            dtype=request.dtype,
            generation_defaults=done.generation_defaults,
            generation_defaults_from=done.generation_defaults_from,
            versions=convert.versions(),
            parameters=done.parameters,
            licence=request.licence,
            upstream=request.upstream,
            notes=list(request.notes),
        )
        provenance.write(record, hf)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        hf.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ImportResult(out, False, provenance.read(out))


def _replaceable(out: Path) -> bool:
    """An existing ``out`` may be replaced only when it is an empty directory or an earlier polar import."""
    return out.is_dir() and (not any(out.iterdir()) or (out / provenance.PROVENANCE).is_file())
