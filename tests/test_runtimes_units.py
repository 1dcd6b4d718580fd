"""Issue 29: the sandbox runtimes' pure helpers, as the agent would push on them: the disk bound (what is counted,
when the watchdog fires and how often it looks), the cap on a harness's output, and the bwrap confinement's
arguments, accounts, ownership and setid stripping (no sandbox is started here)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_cli.rollout.runtimes import confine, disk
from polar_cli.rollout.runtimes.output import (
    HEAD_BYTES,
    TAIL_BYTES,
    BoundedOutput,
    communicate,
    drain,
    feed_stdin,
)

MIB = 2**20


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")


# --- disk: what is counted --------------------------------------------------------------------------------------


def test_usage_counts_allocated_bytes_not_a_sparse_files_length(tmp_path: Path) -> None:
    (tmp_path / "dense").write_bytes(b"\1" * 8 * MIB)
    with open(tmp_path / "sparse", "wb") as sparse:
        sparse.truncate(1024 * MIB)  # a 1 GiB hole takes no disk
    used, entries = disk.usage([tmp_path])
    assert entries == 2
    assert 8 * MIB <= used < 8 * MIB + 16 * 1024  # 512-byte blocks: counted in 513s it would be 16 KiB more


def test_a_file_deleted_during_the_walk_hides_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox deletes a file between the listing and its stat: the rest of that directory is still counted."""
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"\1" * MIB)
    real_scandir = os.scandir

    class Vanishing:
        def __init__(self, entry: os.DirEntry) -> None:
            self.entry, self.path = entry, entry.path

        def stat(self, follow_symlinks: bool = True) -> os.stat_result:
            raise FileNotFoundError(self.path)

    @contextlib.contextmanager
    def scandir(path: str):  # noqa: ANN202
        with real_scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
            yield [Vanishing(entries[0]), *entries[1:]]

    monkeypatch.setattr(os, "scandir", scandir)
    used, entries = disk.usage([tmp_path])
    assert entries == 3 and 2 * MIB <= used < 3 * MIB


def test_usage_follows_no_link_and_sums_every_root(tmp_path: Path) -> None:
    outside, a, b = tmp_path / "outside", tmp_path / "a", tmp_path / "b"
    for directory in (outside, a, b):
        directory.mkdir()
    (outside / "big").write_bytes(b"\1" * 4 * MIB)
    (a / "to-big").symlink_to(outside / "big")
    (a / "to-dir").symlink_to(outside)
    (a / "sub").mkdir()
    (a / "sub" / "f").write_bytes(b"\1" * MIB)
    (b / "g").write_bytes(b"\1" * MIB)
    used, entries = disk.usage([a, b, tmp_path / "missing"])
    assert entries == 5  # to-big, to-dir, sub, sub/f, g: nothing of outside/
    assert 2 * MIB <= used < 3 * MIB


def test_usage_stops_walking_past_max_entries(tmp_path: Path) -> None:
    for name in ("d1", "d2"):
        (tmp_path / name).mkdir()
        for i in range(5):
            (tmp_path / name / str(i)).write_text("")
    assert disk.usage([tmp_path])[1] == 12
    assert disk.usage([tmp_path], max_entries=7)[1] == 12  # 7 after the first directory: not past, so on
    assert disk.usage([tmp_path], max_entries=6)[1] == 7  # past after the first directory: the second is left
    assert disk.usage([tmp_path], max_entries=1)[1] == 2  # the top directory itself is listed whole


def test_fsize_flags_and_the_exceeded_line() -> None:
    assert disk.fsize_flags("/usr/bin/prlimit", 3) == ["/usr/bin/prlimit", f"--fsize={3 * MIB}", "--"]
    assert disk.fsize_flags(None, 3) == []
    assert disk.fsize_flags("", 3) == []
    assert disk.exceeded(4096) == "polar: disk limit 4096 MiB exceeded"


# --- disk: when the watchdog fires -------------------------------------------------------------------------------


def _scripted_usage(monkeypatch: pytest.MonkeyPatch, samples: list[tuple[int, int]]) -> list[tuple]:
    """``disk.usage`` answering ``samples`` in turn (the last one forever); returns its calls."""
    calls: list[tuple] = []

    def usage(roots: list[Path], max_entries: int) -> tuple[int, int]:
        calls.append((roots, max_entries))
        return samples[min(len(calls), len(samples)) - 1]

    monkeypatch.setattr(disk, "usage", usage)
    return calls


def _watch(limit_mb: int, max_entries: int = 100, timeout: float = 1.0) -> tuple[str | None, int]:
    kills: list[None] = []

    async def main() -> str | None:
        try:
            return await asyncio.wait_for(
                disk.watch(lambda: [Path("/w")], limit_mb, lambda: kills.append(None), max_entries), timeout
            )
        except TimeoutError:
            return None

    return asyncio.run(main()), len(kills)


def test_the_watchdog_fires_one_byte_past_the_limit_not_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted_usage(monkeypatch, [(2 * MIB, 100)])
    assert _watch(2, timeout=0.3) == (None, 0)
    calls = _scripted_usage(monkeypatch, [(2 * MIB, 10), (2 * MIB + 1, 10)])
    line, kills = _watch(2)
    assert kills == 1 and calls[0] == ([Path("/w")], 100)
    assert line == (
        "\npolar: disk limit 2 MiB exceeded (the workspace, HOME and the sandbox's other directories held 2 MiB)\n"
    )


def test_the_watchdog_fires_one_entry_past_max_entries_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted_usage(monkeypatch, [(0, 100)])
    assert _watch(2, max_entries=100, timeout=0.3) == (None, 0)
    _scripted_usage(monkeypatch, [(0, 100), (0, 101)])
    line, kills = _watch(2, max_entries=100)
    assert kills == 1
    assert line == (
        "\npolar: disk limit 2 MiB exceeded (the workspace, HOME and the sandbox's other directories held more "
        "than 100 files)\n"
    )
    # both over: the file count is what is named; over in bytes with exactly max_entries, the bytes
    _scripted_usage(monkeypatch, [(5 * MIB, 101)])
    assert _watch(2, max_entries=100)[0].endswith("held more than 100 files)\n")
    _scripted_usage(monkeypatch, [(5 * MIB, 100)])
    assert _watch(2, max_entries=100)[0].endswith("held 5 MiB)\n")


def test_the_watchdog_reports_the_usage_in_whole_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted_usage(monkeypatch, [(int(5.6 * MIB), 0)])
    assert _watch(1)[0].endswith("held 6 MiB)\n")


def test_the_watchdog_samples_by_the_rate_since_its_last_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted_usage(monkeypatch, [(0, 0), (MIB, 0), (3 * MIB, 0), (9 * MIB, 0)])
    seen: list[tuple] = []

    def next_sample(used: int, limit: int, last: tuple[float, int] | None, now: float, walk_s: float) -> float:
        seen.append((used, limit, last, now, walk_s))
        return 0.0

    monkeypatch.setattr(disk, "next_sample", next_sample)
    line, kills = _watch(8)
    assert kills == 1 and "held 9 MiB" in line
    assert [(used, limit) for used, limit, *_ in seen] == [(0, 8 * MIB), (MIB, 8 * MIB), (3 * MIB, 8 * MIB)]
    assert seen[0][2] is None
    assert seen[1][2] == (seen[0][3], 0) and seen[2][2] == (seen[1][3], MIB)  # (time, bytes) of the sample before
    assert all(0 <= walk_s < 0.5 and now > 0 for *_, now, walk_s in seen)


def test_a_real_tree_filled_past_the_limit_is_caught(tmp_path: Path) -> None:
    (tmp_path / "fill").write_bytes(b"\1" * 2 * MIB)
    kills: list[None] = []
    # the first walk fires at once: bounded, so a watchdog that never fires fails here instead of hanging
    line = asyncio.run(asyncio.wait_for(disk.watch(lambda: [tmp_path], 1, lambda: kills.append(None)), 3))
    assert kills == [None] and line.endswith("held 2 MiB)\n")


# --- disk: how often it looks -----------------------------------------------------------------------------------


def test_next_sample_first_and_calm_intervals_never_under_five_walks() -> None:
    assert disk.next_sample(0, 100 * MIB, None, 5.0, 0.001) == 0.1
    assert disk.next_sample(0, 100 * MIB, None, 5.0, 0.1) == 0.5  # five slow walks, not the early 0.1
    assert disk.next_sample(0, 100 * MIB, None, 5.0, 0.03) == pytest.approx(0.15)
    assert disk.next_sample(10 * MIB, 100 * MIB, (4.0, 10 * MIB), 5.0, 0.2) == pytest.approx(1.0)


def test_next_sample_growth_halves_the_time_to_the_limit() -> None:
    # 10 MiB in 0.1 s: 80 MiB left is 0.8 s away, sampled in 0.4 s
    assert disk.next_sample(20 * MIB, 100 * MIB, (4.0, 10 * MIB), 4.1, 0.001) == pytest.approx(0.4)
    # the same growth over 1 s is slower than the calm interval
    assert disk.next_sample(20 * MIB, 100 * MIB, (4.0, 10 * MIB), 5.0, 0.001) == disk.INTERVAL_S
    # five walks' time still bounds it from below
    assert disk.next_sample(20 * MIB, 100 * MIB, (4.0, 10 * MIB), 4.1, 0.1) == pytest.approx(0.5)
    assert disk.next_sample(20 * MIB, 100 * MIB, (4.0, 10 * MIB), 4.1, 0.09) == pytest.approx(0.45)


def test_next_sample_with_no_time_passed_is_calm_not_a_division_by_zero() -> None:
    assert disk.next_sample(20 * MIB, 100 * MIB, (4.0, 10 * MIB), 4.0, 0.001) == disk.INTERVAL_S
    assert disk.next_sample(20 * MIB, 100 * MIB, (4.0, 10 * MIB), 3.9, 0.001) == disk.INTERVAL_S  # a clock step


# --- output: the cap on what a harness prints -------------------------------------------------------------------


def test_the_head_fills_to_the_byte_across_chunks() -> None:
    out = BoundedOutput(head=10, tail=4)
    out.feed(b"012345678")
    out.feed(b"9ABCDEF")  # one byte of room left in the head
    assert out.data() == b"0123456789\n[polar: 2 bytes of output dropped here; kept the first 10 and the last 4]\nCDEF"
    assert out.total == 16 and out.dropped == 2


def test_output_exactly_head_plus_tail_drops_nothing() -> None:
    out = BoundedOutput(head=3, tail=2)
    for byte in b"abcde":
        out.feed(bytes([byte]))
    assert out.data() == b"abcde" and out.dropped == 0
    out.feed(b"f")
    assert out.dropped == 1
    assert out.data() == b"abc\n[polar: 1 bytes of output dropped here; kept the first 3 and the last 2]\nef"


def test_what_is_held_in_memory_stays_within_twice_the_tail() -> None:
    out = BoundedOutput(head=0, tail=100)
    longest = 0
    for _ in range(50):
        out.feed(b"x" * 30)
        longest = max(longest, len(out._tail))
    assert longest <= 200
    assert out.data().endswith(b"]\n" + b"x" * 100) and out.total == 1500 and out.dropped == 1400


def test_a_tail_of_zero_keeps_only_the_head() -> None:
    out = BoundedOutput(head=3, tail=0)
    out.feed(b"abcdefgh")
    assert out.data() == b"abc\n[polar: 5 bytes of output dropped here; kept the first 3 and the last 0]\n"


def test_text_replaces_bytes_that_are_not_utf8() -> None:
    out = BoundedOutput(head=10, tail=0)
    out.feed(b"ok \xff\xfe caf\xc3\xa9")
    # the head ends inside \xc3\xa9: its first byte alone is replaced too
    assert (
        out.text()
        == "ok \ufffd\ufffd caf\ufffd\n[polar: 1 bytes of output dropped here; kept the first 10 and the last 0]\n"
    )
    whole = BoundedOutput.whole()
    whole.feed(b"\x80abc")
    assert whole.text() == "\ufffdabc"


def test_pair_is_bounded_for_an_agent_and_whole_for_an_archive() -> None:
    out, err = BoundedOutput.pair(True)
    assert out is not err and (out.head, out.tail, err.head, err.tail) == (HEAD_BYTES, TAIL_BYTES) * 2
    out, err = BoundedOutput.pair(False)
    assert out is not err and (out.head, out.tail, err.head, err.tail) == (sys.maxsize, 0) * 2
    out.feed(b"y" * (HEAD_BYTES + TAIL_BYTES + 1))
    assert out.dropped == 0 and len(out.data()) == HEAD_BYTES + TAIL_BYTES + 1


def _run(coroutine_factory):  # noqa: ANN001, ANN202
    return asyncio.run(coroutine_factory())


def test_communicate_feeds_stdin_and_captures_both_streams_bounded() -> None:
    async def main() -> tuple[int | None, BoundedOutput, BoundedOutput]:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            "cat; printf 'err-%s' 0123456789 >&2",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = BoundedOutput(head=4, tail=3), BoundedOutput()
        await asyncio.wait_for(communicate(proc, b"hello world", out, err), 3)  # cat ends only at stdin's end
        return proc.returncode, out, err

    code, out, err = _run(main)
    assert code == 0
    assert out.total == 11 and out.data().startswith(b"hell\n[polar: 4 bytes") and out.data().endswith(b"rld")
    assert err.data() == b"err-0123456789"


def test_a_process_that_exits_without_reading_its_stdin_is_fine() -> None:
    async def main() -> int | None:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            "exec 0<&-; echo gone; exit 3",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = BoundedOutput(), BoundedOutput()
        await asyncio.sleep(0.05)
        await communicate(proc, b"x" * (4 * MIB), out, err)
        assert out.data() == b"gone\n" and err.data() == b""
        return proc.returncode

    assert _run(main) == 3


def test_no_stdin_data_leaves_stdin_open_and_no_stream_reads_nothing() -> None:
    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(
            "/bin/cat", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        await feed_stdin(proc, None)
        assert not proc.stdin.is_closing()  # the caller's to close: nothing was written
        proc.stdin.write(b"late")
        proc.stdin.close()
        out = BoundedOutput()
        await drain(proc.stdout, out)
        await proc.wait()
        assert out.data() == b"late"
        untouched = BoundedOutput()
        await drain(None, untouched)
        assert untouched.total == 0
        await feed_stdin(SimpleNamespace(stdin=None), b"data")  # no pipe: nothing to write to

    _run(main)


# --- confine: /etc, mounts, accounts ----------------------------------------------------------------------------


def test_etc_args_read_the_hosts_etc_by_default() -> None:
    args = confine.etc_args()
    assert args == confine.etc_args("/etc")
    if os.path.exists("/etc/hosts") and not os.path.islink("/etc/hosts"):
        assert ["--ro-bind", "/etc/hosts", "/etc/hosts"] in [args[i : i + 3] for i in range(0, len(args), 3)]
    destinations = set(args[2::3])
    assert not destinations & {"/etc/shadow", "/etc/passwd", "/etc/group", "/etc/sudoers"}


def test_every_prefix_before_an_operation_is_kept() -> None:
    mounts = ["--perms", "1777", "--size", "1048576", "--tmpfs", "/tmp", "--perms", "0700", "--dir", "/run/x"]
    assert confine.with_parent_dirs(mounts) == [
        "--perms",
        "1777",
        "--size",
        "1048576",
        "--tmpfs",
        "/tmp",
        "--dir",
        "/run",
        "--perms",
        "0700",
        "--dir",
        "/run/x",
    ]


def test_an_unknown_operation_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as raised:
        confine.with_parent_dirs(["--ro-bind", "/a", "/a", "--chdir", "/a"])
    assert str(raised.value) == "not a bwrap mount operation: --chdir"


@pytest.mark.timeout(10)
def test_a_relative_destination_is_refused_not_walked_forever() -> None:
    with pytest.raises(ValueError) as raised:
        confine.with_parent_dirs(["--bind", "/w", "app/src"])
    assert str(raised.value) == "bwrap mount destination 'app/src' is not absolute"


def test_the_sandbox_accounts_hold_root_its_user_and_nobody_only(tmp_path: Path) -> None:
    directory = tmp_path / "accounts"
    passwd, group = confine.write_accounts(directory, 2_000_000_000, "/home/polar")
    assert (passwd, group) == (directory / "passwd", directory / "group")
    assert passwd.read_text() == (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        "polar:x:2000000000:2000000000:polar:/home/polar:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    assert group.read_text() == "root:x:0:\npolar:x:2000000000:\nnogroup:x:65534:\n"
    confine.write_accounts(directory, 1000, "/w")  # again (a second sandbox): rewritten, not refused
    assert passwd.read_text().splitlines()[1] == "polar:x:1000:1000:polar:/w:/bin/sh"


# --- confine: ownership and setid bits, as the sandbox leaves them ----------------------------------------------


def test_hand_over_takes_dangling_links_and_leaves_a_linked_host_directory(tmp_path: Path) -> None:
    _needs_root()
    tree, host = tmp_path / "tree", tmp_path / "host"
    (tree / "d").mkdir(parents=True)
    host.mkdir()
    (host / "f").write_text("host")
    (tree / "dangling").symlink_to(tmp_path / "nowhere")
    (tree / "to-host").symlink_to(host)
    (tree / "d" / "to-host-file").symlink_to(host / "f")
    uid = confine.DEFAULT_HOST_UID
    os.chown(host / "f", uid, uid)  # a target already the sandbox's: its link is still handed over
    confine.hand_over(tree, uid, uid + 1)
    for path in (tree, tree / "d", tree / "dangling", tree / "to-host", tree / "d" / "to-host-file"):
        assert (path.lstat().st_uid, path.lstat().st_gid) == (uid, uid + 1), path
    assert (host.stat().st_uid, host.stat().st_gid) == (0, 0)


def test_hand_over_all_covers_every_root(tmp_path: Path) -> None:
    _needs_root()
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        (root / "x").mkdir(parents=True)
    asyncio.run(confine.hand_over_all(roots, 4242, 4243))
    assert {(p.lstat().st_uid, p.lstat().st_gid) for r in roots for p in (r, r / "x")} == {(4242, 4243)}


def test_strip_setid_names_only_the_setid_files_it_changed(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for name, mode in [("plain", 0o755), ("setgid", 0o2750), ("d/setuid", 0o4711), ("sticky", 0o1755)]:
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(mode)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "fifo").chmod(0o6644)  # not a regular file: left alone (and opening it must not block)
    assert sorted(confine.strip_setid(tmp_path)) == ["d/setuid", "setgid"]
    modes = {name: stat.S_IMODE((tmp_path / name).lstat().st_mode) for name in ("plain", "setgid", "d/setuid")}
    assert modes == {"plain": 0o755, "setgid": 0o750, "d/setuid": 0o711}
    assert stat.S_IMODE((tmp_path / "sticky").stat().st_mode) == 0o1755
    assert stat.S_IMODE((tmp_path / "fifo").lstat().st_mode) == 0o6644
    assert confine.strip_setid(tmp_path) == []


def test_strip_setid_leaves_a_host_setuid_binary_a_link_points_at(tmp_path: Path) -> None:
    tree, host_binary = tmp_path / "tree", tmp_path / "passwd-like"
    tree.mkdir()
    host_binary.write_text("")
    host_binary.chmod(0o4755)
    (tree / "link").symlink_to(host_binary)
    assert confine.strip_setid(tree) == []
    assert stat.S_IMODE(host_binary.stat().st_mode) == 0o4755


def test_a_file_swapped_for_a_link_after_its_stat_never_strips_the_links_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox's race: a setuid file of its own, replaced by a link to a host setuid binary between the stat
    and the open. The open refuses the link (O_NOFOLLOW): the host binary keeps its bits."""
    tree, host_binary = tmp_path / "tree", tmp_path / "host-binary"
    tree.mkdir()
    host_binary.write_text("")
    host_binary.chmod(0o4755)
    (tree / "own").write_text("")
    (tree / "own").chmod(0o4755)
    real_stat = os.stat

    def stat_then_swap(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        result = real_stat(name, *args, **kwargs)
        if name == "own":
            (tree / "own").unlink()
            (tree / "own").symlink_to(host_binary)
        return result

    monkeypatch.setattr(confine, "os", SimpleNamespace(**{**vars(os), "stat": stat_then_swap}))
    with contextlib.suppress(OSError):
        confine.strip_setid(tree)
    assert stat.S_IMODE(host_binary.stat().st_mode) == 0o4755


def test_strip_setid_all_skips_roots_that_are_gone_or_no_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "s").write_text("")
    (tmp_path / "a" / "s").chmod(0o4755)
    (tmp_path / "file").write_text("")
    asyncio.run(confine.strip_setid_all([tmp_path / "missing", tmp_path / "file", tmp_path / "a"]))
    assert stat.S_IMODE((tmp_path / "a" / "s").stat().st_mode) == 0o755
