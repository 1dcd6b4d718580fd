"""Bringing files out of a sandbox: a tar stream made inside, unpacked on the host without trusting it."""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path


def _contained(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "data" filter (no absolute paths, no links leading out, no devices), skipping what it refuses
    rather than failing: a link out of the download is dropped, the rest of a workspace still comes back."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


def extract_contained(stream: bytes, name: str, local: Path) -> None:
    """Unpack the tar ``stream`` whose top entry is ``name`` to ``local`` (replacing it). A hostile sandbox controls
    the stream: nothing in it can write outside ``local`` nor plant a link to a host file there."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(stream), mode="r") as tar:
            tar.extractall(tmp, filter=_contained)
        unpacked = Path(tmp) / name
        if not unpacked.exists() and not unpacked.is_symlink():
            raise FileNotFoundError(f"{name} was not in the sandbox's archive")
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        shutil.move(str(unpacked), str(local))
