"""Bringing files out of a sandbox: a tar stream made inside, unpacked on the host without trusting it."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _contained_filter() -> Callable[[tarfile.TarInfo, str], tarfile.TarInfo | None]:
    """tarfile's "data" filter (no absolute paths, no links leading out, no devices), skipping what it refuses
    rather than failing: a link out of the download is dropped, the rest of a workspace still comes back.

    The data filter checks each member's path with ``os.path.realpath``, which a chain of symlinks deeper than
    PATH_MAX leaves unresolved (CVE-2025-4517, Python < 3.11.13): a tar of such links then wrote host files outside
    the download. So, besides it, no member is written through a symlink of the archive or over an earlier member
    (a file "through" a link, or over it, follows the link), has a ``..`` in its path, or is a hard link to anything
    but a regular file the archive already wrote (``os.link`` follows a symlink to its target)."""
    symlinks: set[str] = set()
    files: set[str] = set()
    seen: set[str] = set()

    def contained(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        try:
            member = tarfile.data_filter(member, dest)
        except tarfile.FilterError:
            return None
        parts = _parts(member.name)
        name = "/".join(parts)
        if ".." in parts or name in seen or any("/".join(parts[:i]) in symlinks for i in range(1, len(parts))):
            return None
        if member.islnk() and "/".join(_parts(member.linkname)) not in files:
            return None
        seen.add(name)
        if member.issym():
            symlinks.add(name)
        elif member.isreg() or member.islnk():
            files.add(name)
        return member

    return contained


def _stays_inside(top: Path, link: Path) -> bool:
    """Whether the symlink ``link`` under ``top`` resolves within ``top`` wherever ``top`` is moved: a relative
    target whose ``..`` never leave ``top`` and that goes through no other symlink on the way (a link it ends at is
    itself checked)."""
    target = os.readlink(link)
    if target.startswith("/"):
        return False
    here = list(link.parent.relative_to(top).parts)
    steps = _parts(target)
    for i, step in enumerate(steps):
        if step == "..":
            if not here:
                return False
            here.pop()
            continue
        here.append(step)
        if i < len(steps) - 1 and top.joinpath(*here).is_symlink():
            return False
    return True


def _drop_links_out(top: Path) -> None:
    """Remove every symlink under ``top`` that could lead out of it once moved (``top`` itself when it is one: its
    target would be read next to the download, among the host's files)."""
    if top.is_symlink():
        top.unlink()
        return
    for directory, dirs, files in os.walk(top):
        for entry in (*dirs, *files):
            path = Path(directory) / entry
            if path.is_symlink() and not _stays_inside(top, path):
                path.unlink()


def extract_contained(stream: bytes, name: str, local: Path) -> None:
    """Unpack the tar ``stream`` whose top entry is ``name`` to ``local`` (replacing it). A hostile sandbox controls
    the stream: nothing in it can write outside ``local`` nor plant a link to a host file there."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(stream), mode="r") as tar:
            tar.extractall(tmp, filter=_contained_filter())
        unpacked = Path(tmp) / name
        _drop_links_out(unpacked)
        if not unpacked.exists():
            raise FileNotFoundError(f"{name} was not in the sandbox's archive")
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        shutil.move(str(unpacked), str(local))
