"""polar-untrusted's Landlock shim, function by function, in this process (the subprocess tests in test_verifier.py run
it for real but under a python that mutation testing cannot see into). The code it confines is the agent's, which
would write its own reward through any right the shim forgets to handle, any path it grants by mistake, or any
failure it does not turn into a refusal. The kernel calls are recorded by a fake here: confining this very process
would confine the test run; the real kernel's answer to the same calls is test_verifier.py's."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes.untrusted import polar_untrusted as shim

EVERY = (1 << 16) - 1  # every filesystem right of ABI 5 and later


class FakeLibc:
    """``syscall`` answers from ``answers`` (a value, or ``(-1, errno)``); ``prctl`` likewise; both record."""

    def __init__(self, syscall: list[object], prctl: object = 0) -> None:
        self.answers, self.prctl_answer = list(syscall), prctl
        self.calls: list[tuple] = []

    def _answer(self, answer: object) -> int:
        if isinstance(answer, tuple):
            ctypes.set_errno(answer[1])
            return answer[0]
        return answer  # type: ignore[return-value]

    def syscall(self, *args: object) -> int:
        self.calls.append(("syscall", *args))
        return self._answer(self.answers.pop(0))

    def prctl(self, *args: object) -> int:
        self.calls.append(("prctl", *args))
        return self._answer(self.prctl_answer)


def test_syscall_returns_the_result_and_raises_errno_on_a_negative_one(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc([0, 7, (-1, errno.EPERM), (-2, errno.EINVAL)])
    monkeypatch.setattr(shim, "_libc", libc)
    assert shim._syscall(444, "a", "b") == 0  # a ruleset fd or ABI of 0 is a result, not a failure
    assert shim._syscall(445) == 7
    with pytest.raises(OSError) as raised:
        shim._syscall(446)
    assert (raised.value.errno, raised.value.strerror) == (errno.EPERM, "Operation not permitted")
    with pytest.raises(OSError) as raised:
        shim._syscall(1)
    assert (raised.value.errno, raised.value.strerror) == (errno.EINVAL, "Invalid argument")
    numbers = [call[1] for call in libc.calls]
    assert [type(n) for n in numbers] == [ctypes.c_long] * 4 and [n.value for n in numbers] == [444, 445, 446, 1]
    assert libc.calls[0][2:] == ("a", "b")


def test_the_real_kernel_syscall_raises_enosys_for_no_such_call() -> None:
    with pytest.raises(OSError) as raised:
        shim._syscall(100000)
    assert raised.value.errno == errno.ENOSYS


def test_abi_version_asks_the_kernel_with_the_version_flag_and_names_each_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libc = FakeLibc([5])
    monkeypatch.setattr(shim, "_libc", libc)
    assert shim.abi_version() == 5
    ((_, number, attr, size, flags),) = libc.calls
    assert (number.value, attr, type(size), size.value, type(flags), flags.value) == (
        444,
        None,
        ctypes.c_size_t,
        0,
        ctypes.c_uint32,
        1,
    )
    cases = {
        errno.ENOSYS: "the kernel has no Landlock",
        errno.EOPNOTSUPP: "Landlock is disabled at boot",
        errno.EPERM: "Landlock refused: Operation not permitted",
    }
    for code, why in cases.items():
        monkeypatch.setattr(shim, "_libc", FakeLibc([(-1, code)]))
        with pytest.raises(shim.Unavailable) as raised:
            shim.abi_version()
        assert (raised.value.errno, raised.value.strerror) == (code, why)
        assert raised.value.__suppress_context__


def test_every_right_of_each_abi_is_handled() -> None:
    # ABI 1: execute .. make_sym; 2 adds refer, 3 truncate, 5 the device ioctls; 4, 6 and 7 add no filesystem right.
    expected = {1: 0x1FFF, 2: 0x3FFF, 3: 0x7FFF, 4: 0x7FFF, 5: 0xFFFF, 6: 0xFFFF, 7: 0xFFFF}
    assert {abi: shim.handled_rights(abi) for abi in expected} == expected


def test_under_is_the_directory_itself_or_beneath_it_never_a_name_sharing_its_prefix() -> None:
    assert shim._under("/logs", "/logs") and shim._under("/logs/verifier/reward.txt", "/logs")
    assert shim._under("/logs/x", "/logs/")  # a trailing slash on the directory changes nothing
    assert shim._under("/tmpX/a", "/tmpX") and not shim._under("/logs/x", "/logsX")  # only slashes are stripped
    assert not shim._under("/logsx", "/logs") and not shim._under("/log", "/logs")
    assert not shim._under("/", "/logs") and not shim._under("/logs", "/logs/x")
    assert shim._under("/anything", "/")


def _tree(root: Path) -> None:
    (root / "a" / "b" / "deep").mkdir(parents=True)
    (root / "a" / "c").mkdir()
    (root / "a" / "f").write_text("")
    (root / "a" / "l").symlink_to(root / "a" / "b")
    (root / "z" / "y").mkdir(parents=True)
    (root / "z" / "file").write_text("")
    (root / "top").write_text("")


def _mine(rules: list[tuple[str, int]], root: Path) -> list[tuple[str, int]]:
    return [(path, rights) for path, rights in rules if path.startswith(f"{root}/")]


def test_grants_allow_everything_but_beneath_the_denied_directory_entry_by_entry(tmp_path: Path) -> None:
    _tree(tmp_path)
    rules = shim.grants([str(tmp_path / "a" / "b")], EVERY)
    assert rules[0] == ("/", shim.READ)  # the root itself: read only (an ancestor)
    file_rights = EVERY & shim.FILE_RIGHTS
    # Sorted within a directory; the ancestors (tmp_path, a) get no rule and are descended, the link gets none.
    assert _mine(rules, tmp_path) == [
        (f"{tmp_path}/top", file_rights),
        (f"{tmp_path}/z", EVERY),
        (f"{tmp_path}/a/c", EVERY),
        (f"{tmp_path}/a/f", file_rights),
    ]
    paths = [path for path, _ in rules]
    assert len(paths) == len(set(paths))
    ancestors = {"/", *map(str, tmp_path.parents), str(tmp_path), str(tmp_path / "a")}
    assert not ancestors & set(paths[1:])  # no rule on an ancestor: it would allow creating beneath it
    assert ("/usr", EVERY) in rules  # elsewhere as before


def test_grants_with_two_denied_directories_and_an_older_abi(tmp_path: Path) -> None:
    _tree(tmp_path)
    handled = shim.handled_rights(1)
    rules = shim.grants([str(tmp_path / "a" / "b"), str(tmp_path / "z") + "/"], handled)
    assert rules[0] == ("/", shim.READ & handled)
    assert _mine(rules, tmp_path) == [
        (f"{tmp_path}/top", shim.EXECUTE | shim.WRITE_FILE | shim.READ_FILE),  # ABI 1 has no truncate nor ioctl
        (f"{tmp_path}/a/c", handled),
        (f"{tmp_path}/a/f", shim.EXECUTE | shim.WRITE_FILE | shim.READ_FILE),
    ]


def test_grants_deny_a_file_and_give_a_socket_only_file_rights(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "reward.txt").write_text("")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tmp_path / "d" / "sock"))
        os.mkfifo(tmp_path / "d" / "fifo")
        rules = shim.grants([str(tmp_path / "reward.txt")], EVERY)
    finally:
        server.close()
    assert _mine(rules, tmp_path) == [(f"{tmp_path}/d", EVERY)]
    rules = shim.grants([str(tmp_path / "d" / "x")], EVERY)
    assert _mine(rules, tmp_path) == [
        (f"{tmp_path}/reward.txt", EVERY & shim.FILE_RIGHTS),
        (f"{tmp_path}/d/fifo", EVERY & shim.FILE_RIGHTS),
        (f"{tmp_path}/d/sock", EVERY & shim.FILE_RIGHTS),
    ]


def test_grants_skip_what_cannot_be_listed_or_stated_and_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    listdir, lstat = os.listdir, os.lstat

    def unlistable(path: str) -> list[str]:
        if path == str(tmp_path / "z"):
            raise PermissionError(errno.EACCES, "no")
        return listdir(path)

    def unstatable(path: str) -> os.stat_result:
        if path == str(tmp_path / "a" / "c"):
            raise FileNotFoundError(errno.ENOENT, "gone")
        return lstat(path)

    monkeypatch.setattr(os, "listdir", unlistable)
    monkeypatch.setattr(os, "lstat", unstatable)
    # z is an ancestor of a denied directory but cannot be listed: the other branch is still walked in full.
    rules = shim.grants([str(tmp_path / "a" / "b"), str(tmp_path / "z" / "y")], EVERY)
    assert _mine(rules, tmp_path) == [
        (f"{tmp_path}/top", EVERY & shim.FILE_RIGHTS),
        (f"{tmp_path}/a/f", EVERY & shim.FILE_RIGHTS),
    ]


class Kernel:
    """Records what ``confine`` asks of Landlock: the ruleset's attributes, every rule (with the path its fd names),
    no_new_privs and the restriction; ``fail`` makes one step fail with an errno."""

    def __init__(self, abi: int, fail: dict[str, int] | None = None) -> None:
        self.abi, self.fail = abi, fail or {}
        self.ruleset_fd = -1
        self.log: list[tuple] = []

    def syscall(self, number: ctypes.c_long, *args: object) -> int:
        if number.value == 444 and args[0] is None:
            self.log.append(("abi", args[1].value, args[2].value))  # type: ignore[attr-defined]
            return self.abi
        if number.value == 444:
            attr = args[0]._obj  # type: ignore[attr-defined]
            self.log.append(
                ("ruleset", attr.handled_access_fs, attr.handled_access_net, attr.scoped, args[1].value, args[2].value)  # type: ignore[attr-defined]
            )
            self.ruleset_fd = os.open(os.devnull, os.O_RDONLY)
            return self.ruleset_fd
        if number.value == 445:
            ruleset, kind, rule, flags = args
            self.log.append(
                (
                    "rule",
                    ruleset.value == self.ruleset_fd,  # type: ignore[attr-defined]
                    kind.value,  # type: ignore[attr-defined]
                    os.readlink(f"/proc/self/fd/{rule._obj.parent_fd}"),  # type: ignore[attr-defined]
                    rule._obj.allowed_access,  # type: ignore[attr-defined]
                    flags.value,  # type: ignore[attr-defined]
                )
            )
            return self._maybe_fail("rule")
        if number.value == 446:
            ruleset, flags = args
            self.log.append(("restrict", ruleset.value == self.ruleset_fd, flags.value))  # type: ignore[attr-defined]
            return self._maybe_fail("restrict")
        raise AssertionError(f"unexpected syscall {number.value}")

    def prctl(self, *args: int) -> int:
        self.log.append(("prctl", *args))
        return self._maybe_fail("prctl")

    def _maybe_fail(self, step: str) -> int:
        if step in self.fail:
            ctypes.set_errno(self.fail[step])
            return -1
        return 0


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _confine(monkeypatch: pytest.MonkeyPatch, kernel: Kernel, rules: list[tuple[str, int]]) -> object:
    monkeypatch.setattr(shim, "_libc", kernel)
    seen: list[tuple[list[str], int]] = []

    def grants(denied: list[str], handled: int) -> list[tuple[str, int]]:
        seen.append((denied, handled))
        return rules

    monkeypatch.setattr(shim, "grants", grants)
    before = _open_fds()
    try:
        return shim.confine(["/denied"])
    finally:
        assert _open_fds() == before  # the ruleset's fd and every rule's fd closed, whatever happened
        assert seen == [(["/denied"], shim.handled_rights(kernel.abi))]


@pytest.mark.parametrize(
    ("abi", "size", "scoped"),
    [(1, 8, 0), (3, 8, 0), (4, 16, 0), (5, 16, 0), (6, 24, 3), (7, 24, 3)],
)
def test_confine_makes_the_ruleset_this_abi_knows_and_restricts_itself(
    abi: int, size: int, scoped: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The struct size each ABI reads (a larger one is refused by older kernels, a smaller one drops the scopes),
    signals and abstract sockets scoped from ABI 6, no_new_privs before the restriction."""
    (tmp_path / "file").write_text("")
    kernel = Kernel(abi)
    assert _confine(monkeypatch, kernel, [("/", 5), (str(tmp_path / "file"), 7)]) == abi
    handled = shim.handled_rights(abi)
    assert kernel.log == [
        ("abi", 0, 1),
        ("ruleset", handled, 0, scoped, size, 0),
        ("rule", True, 1, "/", 5, 0),
        ("rule", True, 1, str(tmp_path / "file"), 7, 0),
        ("prctl", 38, 1, 0, 0, 0),
        ("restrict", True, 0),
    ]


def test_confine_opens_each_path_itself_never_through_a_link_and_skips_one_gone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "after").write_text("")
    kernel = Kernel(7)
    rules = [(str(tmp_path / "gone"), 1), (str(tmp_path / "link"), 2), (str(tmp_path / "after"), 3)]
    _confine(monkeypatch, kernel, rules)
    # The link's own fd (O_NOFOLLOW): following it would grant the target, which may be the denied directory.
    assert [entry[3:5] for entry in kernel.log if entry[0] == "rule"] == [
        (str(tmp_path / "link"), 2),
        (str(tmp_path / "after"), 3),
    ]


def test_confine_refuses_when_a_rule_no_new_privs_or_the_restriction_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    rules = [("/", 5), ("/usr", 7)]
    kernel = Kernel(7, {"rule": errno.EBADF})
    with pytest.raises(OSError) as raised:
        _confine(monkeypatch, kernel, rules)
    assert raised.value.errno == errno.EBADF and [e[0] for e in kernel.log] == ["abi", "ruleset", "rule"]

    kernel = Kernel(7, {"prctl": errno.EPERM})
    with pytest.raises(shim.Unavailable) as raised:
        _confine(monkeypatch, kernel, rules)
    assert (raised.value.errno, raised.value.strerror) == (errno.EPERM, "no_new_privs refused: Operation not permitted")
    assert kernel.log[-1][0] == "prctl"  # never restricted without no_new_privs

    kernel = Kernel(7, {"restrict": errno.E2BIG})
    with pytest.raises(shim.Unavailable) as raised:
        _confine(monkeypatch, kernel, rules)
    assert (raised.value.errno, raised.value.strerror) == (
        errno.E2BIG,
        "Landlock refused to restrict: Argument list too long",
    )
    assert raised.value.__suppress_context__


def test_confine_asks_nothing_more_when_the_kernel_has_no_landlock(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc([(-1, errno.ENOSYS)])
    monkeypatch.setattr(shim, "_libc", libc)
    with pytest.raises(shim.Unavailable, match="the kernel has no Landlock"):
        shim.confine(["/logs"])
    assert len(libc.calls) == 1


@pytest.mark.parametrize(
    ("argv", "denied", "command"),
    [
        (["cmd"], ["/logs"], ["cmd"]),
        (["--deny", "/a", "cmd", "--deny", "x"], ["/logs", "/a"], ["cmd", "--deny", "x"]),
        (["--deny=/a", "--deny", "/b", "--", "--odd", "y"], ["/logs", "/a", "/b"], ["--odd", "y"]),
        (["--deny=", "cmd"], ["/logs", ""], ["cmd"]),
        (["--", "--"], ["/logs"], ["--"]),
        (["-v", "cmd"], ["/logs"], ["-v", "cmd"]),
    ],
)
def test_parse_takes_the_denied_directories_then_the_command_as_given(
    argv: list[str], denied: list[str], command: list[str]
) -> None:
    given = list(argv)
    assert shim.parse(argv) == (denied, command)
    assert argv == given


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no command given"),
        (["--deny", "/a"], "no command given"),
        (["--"], "no command given"),
        (["--deny"], "unknown option --deny"),
        (["--denied", "/a", "cmd"], "unknown option --denied"),
        (["--deny-x", "cmd"], "unknown option --deny-x"),
    ],
)
def test_parse_refuses_a_missing_command_and_unknown_options(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        shim.parse(argv)
    assert str(raised.value) == message


def test_resolve_makes_missing_directories_and_resolves_links(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    given = [str(tmp_path / "new" / "deeper"), str(tmp_path / "link"), str(tmp_path / "real") + "/"]
    assert shim.resolve(given) == [str(tmp_path / "new" / "deeper"), str(tmp_path / "real"), str(tmp_path / "real")]
    assert (tmp_path / "new" / "deeper").is_dir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):  # a link the code under test could point elsewhere: refused
        shim.resolve([str(tmp_path / "dangling")])


def test_resolve_skips_only_a_directory_nobody_here_may_create(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    makedirs = os.makedirs
    codes = {"acces": errno.EACCES, "perm": errno.EPERM, "rofs": errno.EROFS, "nospc": errno.ENOSPC}

    def refusing(path: str, exist_ok: bool = False) -> None:
        code = codes.get(Path(path).name)
        if code is not None:
            raise OSError(code, os.strerror(code))
        makedirs(path, exist_ok=exist_ok)

    monkeypatch.setattr(os, "makedirs", refusing)
    made = [str(tmp_path / name) for name in ("one", "acces", "perm", "rofs", "two")]
    assert shim.resolve(made) == [str(tmp_path / "one"), str(tmp_path / "two")]
    with pytest.raises(OSError) as raised:
        shim.resolve([str(tmp_path / "nospc")])
    assert raised.value.errno == errno.ENOSPC
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "acces").symlink_to(tmp_path / "nowhere")  # refused, yet something is there: not skipped
    with pytest.raises(OSError) as raised:
        shim.resolve([str(tmp_path / "sub" / "acces")])
    assert raised.value.errno == errno.EACCES


USAGE = "usage: polar-untrusted [--deny DIR]... CMD ARGS..."


def _main(monkeypatch: pytest.MonkeyPatch, argv: list[str], confine: object, execvp: object) -> tuple[int, list[tuple]]:
    steps: list[tuple] = []

    def fake_confine(denied: list[str]) -> int:
        steps.append(("confine", denied))
        return confine(denied) if callable(confine) else 7

    def fake_execvp(file: str, args: list[str]) -> None:
        steps.append(("exec", file, args))
        if execvp is not None:
            raise execvp  # type: ignore[misc]

    monkeypatch.setattr(shim, "confine", fake_confine)
    monkeypatch.setattr(os, "execvp", fake_execvp)
    return shim.main(argv), steps


def test_main_confines_then_runs_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shim, "resolve", lambda denied: [f"real:{d}" for d in denied])
    code, steps = _main(monkeypatch, ["--deny", str(tmp_path), "pytest", "-q"], None, None)
    assert steps == [("confine", ["real:/logs", f"real:{tmp_path}"]), ("exec", "pytest", ["pytest", "-q"])]
    assert code == shim.REFUSED == 126  # execvp returning at all is a failure
    assert capsys.readouterr().err == ""


def test_main_answers_a_usage_error_with_2_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, steps = _main(monkeypatch, ["--bad", "cmd"], None, None)
    assert (code, steps) == (2, [])
    assert capsys.readouterr().err == f"polar-untrusted: unknown option --bad\n{USAGE}\n"


def test_main_refuses_with_126_when_it_cannot_confine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shim, "resolve", lambda denied: denied)

    def no_landlock(denied: list[str]) -> int:
        raise shim.Unavailable(errno.ENOSYS, "the kernel has no Landlock")

    code, steps = _main(monkeypatch, ["--deny", "/x", "touch", "r"], no_landlock, None)
    assert (code, [s[0] for s in steps]) == (126, ["confine"])  # never exec'd
    assert capsys.readouterr().err == (
        "polar-untrusted: refusing to run touch: cannot keep it from writing /logs, /x (the kernel has no Landlock);"
        " the reward would be forgeable, so nothing runs (exit 126)\n"
    )

    def bare(denied: list[str]) -> int:
        raise OSError("no strerror")

    code, steps = _main(monkeypatch, ["touch"], bare, None)
    assert (code, [s[0] for s in steps]) == (126, ["confine"])
    assert "cannot keep it from writing /logs (no strerror); the reward" in capsys.readouterr().err


def test_main_refuses_when_a_denied_directory_cannot_be_resolved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    resolve = shim.resolve
    # /logs of this machine is left alone: the default denied directory is made in tmp_path instead.
    monkeypatch.setattr(
        shim, "resolve", lambda ds: resolve([str(tmp_path / "logs") if d == "/logs" else d for d in ds])
    )
    code, steps = _main(monkeypatch, ["--deny", str(tmp_path / "dangling"), "touch"], None, None)
    assert (code, steps) == (126, [])
    assert "polar-untrusted: refusing to run touch: cannot keep it from writing" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), 127),
        (PermissionError(errno.EACCES, "Permission denied"), 126),
    ],
)
def test_main_answers_a_command_that_cannot_run_like_a_shell(
    error: OSError,
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(shim, "resolve", lambda denied: denied)
    got, steps = _main(monkeypatch, ["nosuch", "arg"], None, error)
    assert got == code and steps[-1] == ("exec", "nosuch", ["nosuch", "arg"])
    assert capsys.readouterr().err == f"polar-untrusted: nosuch: {error.strerror}\n"
