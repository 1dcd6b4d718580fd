"""Issue 29: hostile tars against :func:`extract_contained`, the host side of every runtime's ``download``.

The sandbox makes the tar; the runner (root, in production) unpacks it next to its reports. Each test builds the
archive a hostile sandbox would send and checks that nothing outside the download is written, that no link in it
leads to a host file, and that the honest rest of the workspace still comes back.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import tempfile
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes.archive import _stays_inside, extract_contained


class Tar:
    """A tar stream built member by member, in the order given (the order is part of the attack)."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.GNU_FORMAT)

    def dir(self, name: str, mode: int = 0o755) -> Tar:
        info = tarfile.TarInfo(name)
        info.type, info.mode = tarfile.DIRTYPE, mode
        self.tar.addfile(info)
        return self

    def file(self, name: str, content: str = "", mode: int = 0o644) -> Tar:
        data = content.encode()
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        self.tar.addfile(info, io.BytesIO(data))
        return self

    def symlink(self, name: str, target: str) -> Tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(info)
        return self

    def hardlink(self, name: str, target: str) -> Tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.LNKTYPE, target
        self.tar.addfile(info)
        return self

    def special(self, name: str, kind: bytes) -> Tar:
        info = tarfile.TarInfo(name)
        info.type, info.devmajor, info.devminor = kind, 1, 3  # 1:3 is /dev/null, 8:0 a disk
        self.tar.addfile(info)
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buffer.getvalue()


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """The runner's report directory: the download goes to ``host/out/ws``, next to host files it must not touch."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "secret").write_text("host secret")
    (tmp_path / "secret").write_text("host secret")
    return tmp_path


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's content, a link's target, "dir" for a directory."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        out[key] = f"-> {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir() else path.read_text()
    return out


def _untouched(host: Path) -> None:
    assert (host / "secret").read_text() == "host secret"
    assert (host / "out" / "secret").read_text() == "host secret"
    assert (host / "secret").stat().st_nlink == 1 and (host / "out" / "secret").stat().st_nlink == 1
    assert sorted(p.name for p in host.iterdir()) == ["out", "secret"]
    assert sorted(p.name for p in (host / "out").iterdir()) == ["secret", "ws"]


def test_an_honest_workspace_comes_back_whole_with_its_inner_links(host: Path) -> None:
    local = host / "out" / "ws"
    local.mkdir()
    (local / "stale").write_text("from an earlier download")
    stream = (
        Tar()
        .dir("ws")
        .file("ws/a.txt", "A")
        .file("ws/run.sh", "#!/bin/sh\n", mode=0o755)
        .dir("ws/sub")
        .file("ws/sub/b.txt", "B")
        .symlink("ws/sub/up", "../a.txt")
        .symlink("ws/sub/self", "b.txt")
        .symlink("ws/sub/dot", "./b.txt")
        .symlink("ws/to-sub", "sub")
        .symlink("ws/via-last-link", "to-sub")
        .hardlink("ws/sub/a-again", "ws/a.txt")
        .hardlink("ws/sub/a-dotted", "./ws/a.txt")
        .bytes()
    )
    extract_contained(stream, "ws", local)
    assert _tree(local) == {
        "a.txt": "A",
        "run.sh": "#!/bin/sh\n",
        "sub": "dir",
        "sub/a-again": "A",
        "sub/a-dotted": "A",
        "sub/b.txt": "B",
        "sub/dot": "-> ./b.txt",
        "sub/self": "-> b.txt",
        "sub/up": "-> ../a.txt",
        "to-sub": "-> sub",
        "via-last-link": "-> to-sub",
    }
    assert (local / "sub" / "up").read_text() == "A" and (local / "via-last-link" / "b.txt").read_text() == "B"
    assert (local / "run.sh").stat().st_mode & stat.S_IXUSR
    assert (local / "sub" / "a-again").stat().st_ino == (local / "a.txt").stat().st_ino
    _untouched(host)


def test_a_single_file_replaces_a_file_and_a_link_at_its_place(host: Path) -> None:
    local = host / "out" / "ws"
    local.write_text("old")
    extract_contained(Tar().file("reward.txt", "1.0").bytes(), "reward.txt", local)
    assert local.read_text() == "1.0"
    local.unlink()
    local.symlink_to(host / "secret")  # the runner's own path is replaced, never written through
    extract_contained(Tar().file("reward.txt", "0.5").bytes(), "reward.txt", local)
    assert not local.is_symlink() and local.read_text() == "0.5"
    _untouched(host)


def test_the_download_is_made_with_its_parents(tmp_path: Path) -> None:
    local = tmp_path / "a" / "b" / "ws"
    extract_contained(Tar().dir("ws").file("ws/x", "x").bytes(), "ws", local)
    assert _tree(tmp_path) == {"a": "dir", "a/b": "dir", "a/b/ws": "dir", "a/b/ws/x": "x"}


def test_dot_dot_names_write_nothing_outside_and_the_rest_comes_back(host: Path) -> None:
    stream = (
        Tar()
        .dir("ws")
        .file("../secret", "pwned")
        .file("ws/../../secret", "pwned")
        .file("ws/../../../secret", "pwned")
        .file("ws/sub/../inside", "lexically inside, still refused")
        .file("ws/ok", "ok")
        .bytes()
    )
    extract_contained(stream, "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"ok": "ok"}
    _untouched(host)


def test_absolute_names_land_inside_the_download_never_at_their_host_path(host: Path) -> None:
    absolute = host / "out" / "planted"
    stream = Tar().dir("ws").file(str(absolute), "pwned").file("/ws/from-root", "kept").bytes()
    extract_contained(stream, "ws", host / "out" / "ws")
    assert not absolute.exists()
    assert _tree(host / "out" / "ws") == {"from-root": "kept"}
    _untouched(host)


def test_symlinks_out_of_the_download_are_dropped(host: Path) -> None:
    stream = (
        Tar()
        .dir("ws")
        .dir("ws/sub")
        .file("ws/y", "Y")
        .file("other", "a sibling of the top entry")
        .symlink("ws/abs", str(host / "secret"))
        .symlink("ws/up", "../secret")
        .symlink("ws/sub/upup", "../../secret")
        .symlink("ws/etc", "/etc/shadow")
        # inside the extraction directory, so tarfile's filter keeps them: out of ws, they would point next to the
        # download once it is moved to the runner's path
        .symlink("ws/sibling", "../other")
        .symlink("ws/round-trip", "../ws/y")
        .symlink("ws/sub/round-trip", "../../ws/y")
        .symlink("ws/sub/one-up", "../y")
        .bytes()
    )
    extract_contained(stream, "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"sub": "dir", "sub/one-up": "-> ../y", "y": "Y"}
    assert (host / "out" / "ws" / "sub" / "one-up").read_text() == "Y"
    _untouched(host)


def test_a_link_through_another_link_that_climbs_out_is_dropped(host: Path) -> None:
    # ws/a/up -> .. is ws itself; ws/a/out -> up/../other is ws/a/other by its letters but ../other (next to the
    # download) by what the kernel resolves
    stream = (
        Tar()
        .dir("ws")
        .dir("ws/a")
        .symlink("ws/a/up", "..")
        .symlink("ws/a/out", "up/../other")
        .symlink("ws/a/down", "up/y")
        .file("ws/y", "Y")
        .file("other", "next to the download")
        .bytes()
    )
    extract_contained(stream, "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"a": "dir", "a/up": "-> ..", "y": "Y"}
    _untouched(host)


def test_hard_links_out_to_symlinks_or_to_what_was_refused_are_dropped(host: Path) -> None:
    stream = (
        Tar()
        .dir("ws")
        .file("ws/a", "A")
        .symlink("ws/s", "a")
        .special("ws/null", tarfile.CHRTYPE)
        .hardlink("ws/h-out", "../secret")
        .hardlink("ws/h-abs", str(host / "secret"))
        .hardlink("ws/h-link", "ws/s")  # os.link follows a symlink: a host file's inode through a link out
        .hardlink("ws/h-refused", "ws/null")  # tarfile would look it up in the archive and fail with KeyError
        .hardlink("ws/h-missing", "ws/nothing")
        .hardlink("ws/h-dir", "ws")
        .hardlink("ws/h-up", "ws/../ws/a")
        .hardlink("ws/h-ok", "ws/a")
        .bytes()
    )
    extract_contained(stream, "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"a": "A", "h-ok": "A", "s": "-> a"}
    _untouched(host)


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_device_nodes_and_fifos_are_dropped(host: Path, kind: bytes) -> None:
    stream = Tar().dir("ws").special("ws/dev", kind).file("ws/ok", "ok").bytes()
    extract_contained(stream, "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"ok": "ok"}


def test_a_file_through_a_link_or_over_it_is_dropped(host: Path) -> None:
    stream = (
        Tar()
        .dir("ws")
        .dir("ws/sub")
        .file("ws/g", "G")
        .symlink("ws/l", "sub")
        .file("ws/l/through", "would land in ws/sub")
        .file("ws//l/doubled-slash", "would land in ws/sub")
        .file("ws/./l/./dotted", "would land in ws/sub")
        .dir("ws/l/dir-through")
        .symlink("ws/f", "g")
        .file("ws/f", "would overwrite g")
        .dir("ws/d")
        .symlink("ws/d", "g")  # a directory replaced by a link, then written through
        .file("ws/d/x", "x")
        .file("ws/g", "a second copy of a member")
        .bytes()
    )
    extract_contained(stream, "ws", host / "out" / "ws")
    # the link over the directory was refused, so d/x is written in the directory itself
    assert _tree(host / "out" / "ws") == {"d": "dir", "d/x": "x", "f": "-> g", "g": "G", "l": "-> sub", "sub": "dir"}
    _untouched(host)


def test_symlink_chains_past_path_max_write_no_host_file(host: Path) -> None:
    """CVE-2025-4517: ``os.path.realpath`` leaves a chain of links deeper than PATH_MAX unresolved, so tarfile's data
    filter (before Python 3.11.13) takes ``escape`` for a path inside; writing through it replaced a host file."""
    steps = "abcdefghijklmnop"
    dest_len = len(str(host / "out" / "tmpxxxxxxxx")) + 1  # extracted in a temporary directory next to ws
    component = "d" * ((os.pathconf(str(host), "PC_PATH_MAX") - dest_len) // (len(steps) + 1))
    tar = Tar().dir("ws").file("ws/ok", "ok")
    path = ""
    for step in steps:
        tar.dir(os.path.join(path, component), mode=0o777)
        tar.symlink(os.path.join(path, step), component)
        path = os.path.join(path, component)
    linkpath = os.path.join(*steps, "l" * 254)
    tar.symlink(linkpath, os.path.join(*[".."] * len(steps)))
    tar.symlink("escape", os.path.join(linkpath, ".."))  # host/out, once realpath gives up
    tar.symlink("ws/escape", os.path.join("..", linkpath, ".."))
    tar.hardlink("flaglink", "escape/secret")
    tar.file("flaglink", "pwned")
    tar.file("escape/planted", "pwned")
    tar.file("ws/escape/planted", "pwned")
    tar.symlink("ws/to-secret", os.path.join("..", linkpath, "..", "secret"))
    tar.hardlink("ws/secret-inode", "ws/to-secret")
    tar.file("ws/secret-inode", "pwned")
    extract_contained(tar.bytes(), "ws", host / "out" / "ws")
    _untouched(host)
    # the hard link was refused: the file written at its name afterwards is a new one of the download's own
    assert _tree(host / "out" / "ws") == {"ok": "ok", "secret-inode": "pwned"}
    assert (host / "out" / "ws" / "secret-inode").stat().st_nlink == 1


def test_a_top_entry_that_is_a_link_or_missing_leaves_the_old_download(host: Path) -> None:
    local = host / "out" / "ws"
    local.mkdir()
    (local / "kept").write_text("earlier")
    for stream in (
        Tar().symlink("ws", "other").dir("other").file("other/x", "x").bytes(),
        Tar().symlink("ws", ".").bytes(),
        Tar().symlink("ws", "/etc").bytes(),
        Tar().dir("elsewhere").bytes(),
        Tar().file("../ws", "climbs").bytes(),
    ):
        with pytest.raises(FileNotFoundError) as raised:
            extract_contained(stream, "ws", local)
        assert str(raised.value) == "ws was not in the sandbox's archive"
        assert _tree(local) == {"kept": "earlier"}
    # the temporary extraction directory is gone every time
    _untouched(host)


def test_a_directory_download_replaces_a_file_and_a_link_to_a_host_directory_is_replaced_not_emptied(
    host: Path,
) -> None:
    local = host / "out" / "ws"
    local.write_text("an earlier single-file download")
    extract_contained(Tar().dir("ws").file("ws/x", "x").bytes(), "ws", local)
    assert _tree(local) == {"x": "x"}
    (host / "hostdir").mkdir()
    (host / "hostdir" / "keep").write_text("host")
    local.rename(host / "old")
    local.symlink_to(host / "hostdir")
    extract_contained(Tar().dir("ws").file("ws/y", "y").bytes(), "ws", local)
    assert not local.is_symlink() and _tree(local) == {"y": "y"}
    assert _tree(host / "hostdir") == {"keep": "host"}


def test_the_archive_is_unpacked_next_to_the_download_never_in_the_system_temp_dir(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one filesystem: the move is a rename (hard links stay links), and no other user's /tmp sees the tree
    not_a_dir = host / "out" / "not-a-dir"
    not_a_dir.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_dir))
    extract_contained(Tar().dir("ws").file("ws/x", "x").bytes(), "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"x": "x"}


def test_a_link_named_dot_which_tarfile_cannot_make_hides_nothing(host: Path) -> None:
    stream = Tar().symlink(".", "x").dir("ws").file("ws/a", "A").bytes()
    extract_contained(stream, "ws", host / "out" / "ws")
    assert _tree(host / "out" / "ws") == {"a": "A"}


def test_an_absolute_link_target_never_stays_inside(tmp_path: Path) -> None:
    # tarfile's data filter refuses these first; the check stands on its own if a Python version ever lets one by
    (tmp_path / "sub").mkdir()
    for name, target, inside in [
        ("abs", "/etc/passwd", False),
        ("abs-in", str(tmp_path / "sub"), False),
        ("rel", "sub", True),
        ("rel-slashes", "sub//.", True),
    ]:
        (tmp_path / name).symlink_to(target)
        assert _stays_inside(tmp_path, tmp_path / name) is inside, name
