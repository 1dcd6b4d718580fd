"""The journal's segment format on its own: checksums, torn tails, and a segment of another format version."""

from __future__ import annotations

import fcntl
import os
import stat

import pytest

from polar_addon.store import journal


def _segment(payloads: list[bytes]) -> bytes:
    return journal.MAGIC + b"".join(journal.frame(p) for p in payloads)


def test_whole_segment_reads_back() -> None:
    payloads = [b"first", b"", b"third entry" * 40]
    assert journal.parse_segment(_segment(payloads)) == payloads


def test_a_checksum_failure_ends_the_valid_prefix() -> None:
    payloads = [b"alpha", b"bravo", b"charlie"]
    data = bytearray(_segment(payloads))
    # Flip one byte inside "bravo": same length, so only the xxh3 check can notice it.
    at = data.index(b"bravo") + 2
    data[at] ^= 0x01
    assert journal.parse_segment(bytes(data)) == [b"alpha"]


def test_a_corrupt_digest_ends_the_valid_prefix() -> None:
    data = bytearray(_segment([b"alpha", b"bravo"]))
    second = len(journal.MAGIC) + len(journal.frame(b"alpha"))
    data[second + 4] ^= 0xFF  # first byte of the second entry's digest
    assert journal.parse_segment(bytes(data)) == [b"alpha"]


def test_a_torn_last_entry_is_dropped() -> None:
    data = _segment([b"alpha", b"bravo"])
    for cut in range(1, len(journal.frame(b"bravo"))):
        assert journal.parse_segment(data[:-cut]) == [b"alpha"]


@pytest.mark.parametrize("magic", [b"PLRJ1\n", b"PLRJ3\n"])
def test_a_foreign_journal_version_is_refused_not_dropped(magic: bytes) -> None:
    data = magic + b"".join(journal.frame(p) for p in [b"alpha"])
    with pytest.raises(ValueError, match="format"):
        journal.parse_segment(data)


def test_bytes_that_are_no_journal_read_as_empty() -> None:
    assert journal.parse_segment(b"") == []
    assert journal.parse_segment(b"PLR") == []  # a segment whose header write never completed
    assert journal.parse_segment(b"not a journal at all") == []


def test_segment_append_writes_magic_once_and_tracks_size_and_count(tmp_path) -> None:
    segment = journal.Segment(str(tmp_path), "0001")
    segment.append([b"a", b"bb"])
    segment.append([b"ccc"])
    segment.close()
    assert segment.fd == -1  # so a second close() closes nothing (not whatever fd reused the number)
    data = (tmp_path / f"0001{journal.SEGMENT_SUFFIX}").read_bytes()
    assert data.startswith(journal.MAGIC) and data.count(journal.MAGIC) == 1
    assert (segment.count, segment.size) == (3, len(data))
    assert journal.read_segment(segment.path) == [b"a", b"bb", b"ccc"]
    assert journal.segment_name(segment.path) == "0001"
    segment.close()  # closing twice is harmless
    with pytest.raises(FileExistsError):  # a segment is never reopened for appending
        journal.Segment(str(tmp_path), "0001")


def test_a_failed_append_leaves_the_file_as_it_was(tmp_path) -> None:
    segment = journal.Segment(str(tmp_path), "0001")
    segment.append([b"kept"])
    before = (tmp_path / f"0001{journal.SEGMENT_SUFFIX}").read_bytes()
    os.close(segment.fd)  # every later write fails
    with pytest.raises(OSError):
        segment.append([b"lost"])
    segment.fd = -1
    assert (segment.count, segment.size) == (1, len(before))
    assert (tmp_path / f"0001{journal.SEGMENT_SUFFIX}").read_bytes() == before


def test_writer_dirs_are_locked_and_orphans_adopted_oldest_first(tmp_path) -> None:
    root = str(tmp_path / "journal")
    _, live = journal.create_writer_dir(root)
    assert os.path.basename(live.path).startswith("w-") and not live.adopted
    with pytest.raises(BlockingIOError):  # the live writer holds its lock
        fd = os.open(os.path.join(live.path, "lock"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    dead = tmp_path / "journal" / "w-dead0001"
    dead.mkdir()
    (dead / "lock").touch()
    for name in ("0002", "0001"):
        (dead / f"{name}{journal.SEGMENT_SUFFIX}").write_bytes(journal.MAGIC)
    (dead / "notes.txt").write_text("not a segment")
    (tmp_path / "journal" / "other").mkdir()  # not a writer directory
    (tmp_path / "journal" / "w-nolock").mkdir()  # being removed: no lock file
    (tmp_path / "journal" / "w-0nolock").mkdir()  # ... sorted before the dead writer: skipped, not the end
    [orphan] = journal.adopt_orphans(root, live.path)
    assert orphan.adopted and orphan.path == str(dead)
    assert [os.path.basename(p) for p in orphan.segments] == ["0001.wal", "0002.wal"]
    assert journal.adopt_orphans(root, live.path) == []  # locked by its adopter now
    orphan.release(remove=True)
    assert dead.exists()  # its segments are still there
    for p in orphan.segments:
        os.unlink(p)
    (dead / "notes.txt").unlink()
    journal.WriterDir(str(dead), -1).release(remove=True)
    assert not dead.exists()
    live.release(remove=False)
    assert os.path.exists(live.path) and live.lock_fd == -1
    assert journal.adopt_orphans(str(tmp_path / "missing"), "") == []


def test_segment_names_sort_by_creation_time() -> None:
    first = journal.new_segment_name("abcd1234", 2)
    second = journal.new_segment_name("abcd1234", 1)
    assert first < second and first.endswith("-abcd1234-000002")
    assert len(first.split("-")[0]) == 19


def test_edges_of_the_segment_format() -> None:
    assert journal.parse_segment(_segment([b"a", b""])) == [b"a", b""]  # an empty payload may end a segment
    with pytest.raises(ValueError, match="format"):
        journal.parse_segment(b"PLRJ1\n")  # a foreign header alone is still foreign


def test_a_short_writev_is_finished_before_the_sync(tmp_path, monkeypatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real_write(fd, b"".join(bufs)[:5]))  # 5 bytes, then short
    segment = journal.Segment(str(tmp_path), "0001")
    segment.append([b"hello", b"world"])
    segment.close()
    assert journal.read_segment(segment.path) == [b"hello", b"world"]
    assert segment.size == os.path.getsize(segment.path)


def test_an_append_after_a_failed_one_continues_the_file(tmp_path, monkeypatch) -> None:
    """The failed batch is cut off and the next one follows the last good entry (O_APPEND: no hole where the cut
    batch was, which would end the valid prefix there)."""
    segment = journal.Segment(str(tmp_path), "0001")
    segment.append([b"kept"])
    real_sync = os.fdatasync

    def failing(fd: int) -> None:
        raise OSError(5, "EIO")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError):
        segment.append([b"lost"])
    monkeypatch.setattr(os, "fdatasync", real_sync)
    segment.append([b"next"])
    segment.close()
    assert journal.read_segment(segment.path) == [b"kept", b"next"]


def test_segment_and_lock_files_are_0644(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        segment = journal.Segment(str(tmp_path), "0001")
        _, wd = journal.create_writer_dir(str(tmp_path / "journal"))
    finally:
        os.umask(old)
    segment.close()
    wd.release(remove=False)
    assert stat.S_IMODE(os.stat(segment.path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(os.path.join(wd.path, "lock")).st_mode) == 0o644


def test_a_new_writer_dir_is_made_and_locked_inside_the_root_before_its_rename(tmp_path, monkeypatch) -> None:
    root = str(tmp_path / "journal")
    seen: list[list[str]] = []
    real_flock = fcntl.flock

    def watching(fd: int, op: int) -> None:
        seen.append(sorted(os.listdir(root)))
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", watching)
    wid, wd = journal.create_writer_dir(root)
    wd.release(remove=False)
    assert seen == [[f".new-{wid}"]] and os.listdir(root) == [f"w-{wid}"]


def test_adoption_skips_live_vanished_and_foreign_entries_and_goes_on(tmp_path, monkeypatch) -> None:
    """Sorted before the one dead writer: a live writer, a directory that vanishes while being read, a half-made
    `.new-` directory and a stray file. Each is skipped without ending the scan."""
    root = tmp_path / "journal"
    own = journal.create_writer_dir(str(root))[1]
    for name in ("w-0live", ".new-dead0002", "w-aaaaaaaa-gone", "w-dead0001"):
        (root / name).mkdir()
        (root / name / "lock").touch()
    (root / "stray.txt").write_text("x")
    live = os.open(root / "w-0live" / "lock", os.O_RDWR)
    fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
    real_listdir = os.listdir

    def listdir(path):
        if str(path).endswith("w-aaaaaaaa-gone"):
            raise FileNotFoundError(path)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    adopted: list[journal.WriterDir] = []
    try:
        adopted = journal.adopt_orphans(str(root), own.path)
        assert [os.path.basename(w.path) for w in adopted] == ["w-dead0001"]
    finally:
        os.close(live)
        own.release(remove=False)
        for w in adopted:
            w.release(remove=False)
