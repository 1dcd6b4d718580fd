"""``polar-untrusted [--deny DIR]... CMD ARGS...``: run CMD so that it and every process it starts can write
nothing under the denied directories (default ``/logs``, where a Harbor verifier's reward lives), and everywhere
else as before (the workspace, ``/tmp``, HOME). A verifier runs the code under test through it, e.g.
``polar-untrusted python -m pytest && echo 1 > /logs/verifier/reward.txt``, so the tested code cannot write the
reward itself.

Landlock (Linux >= 5.13), through ctypes, standard library only (it runs under whatever python3 the sandbox has,
with ``-I``): the rule set handles every filesystem right of the kernel's ABI; reading and executing are allowed
everywhere, the other rights (write, truncate, create, remove, rename/link in or out, device ioctls) everywhere but
beneath a denied directory (granted entry by entry on the denied directories' ancestors, since Landlock rules only
allow). The domain is inherited by every descendant and cannot be lifted; it also keeps them from ptracing (or
reading the memory of) the verifier's own processes, from changing mounts, and, from ABI 6, from signalling them.

Landlock only allows, so a denied directory's ancestors keep only the read rights themselves: no entry can be
created, removed or renamed directly in them (``/`` for the default ``/logs``, which nothing writes anyway). Deny
a directory whose parent the code under test needs not change (a top-level one, as ``/logs``), not a subdirectory
of the workspace. A write through a file descriptor opened before (e.g. ``polar-untrusted cmd > reward.txt``) is
not an access Landlock checks: hand the code under test no descriptor of the reward.

Fails closed: without Landlock (an old kernel, or a seccomp filter that refuses it) it prints why and exits 126,
running nothing, so a ``&&`` after it never writes the reward. Standalone: no import of polar.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys

REFUSED = 126
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
ABI1 = (1 << 13) - 1  # execute .. make_sym
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
READ = EXECUTE | READ_FILE | READ_DIR
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only ones a rule on a non-directory takes


class Unavailable(OSError):
    """Landlock cannot confine this process here."""


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def abi_version() -> int:
    """The kernel's Landlock ABI; :class:`Unavailable` when it has none or it is disabled."""
    try:
        return _syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    except OSError as exc:
        why = {errno.ENOSYS: "the kernel has no Landlock", errno.EOPNOTSUPP: "Landlock is disabled at boot"}
        raise Unavailable(exc.errno, why.get(exc.errno, f"Landlock refused: {exc.strerror}")) from None


def handled_rights(abi: int) -> int:
    """Every filesystem right the ABI knows (a right left unhandled would stay allowed)."""
    rights = ABI1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def grants(denied: list[str], handled: int) -> list[tuple[str, int]]:
    """(path, rights) rules: READ on ``/``, every handled right on each entry of the denied directories' ancestors
    that is neither denied nor an ancestor itself (descending only along the ancestors: bounded). Symbolic links get
    no rule: what they point to is covered by its own path."""
    rules = [("/", READ & handled)]
    pending = ["/"]
    while pending:
        directory = pending.pop()
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            if any(_under(path, d) for d in denied):
                continue
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISLNK(info.st_mode):
                continue
            if stat.S_ISDIR(info.st_mode) and any(_under(d, path) for d in denied):
                pending.append(path)
            elif stat.S_ISDIR(info.st_mode):
                rules.append((path, handled))
            else:
                rules.append((path, handled & FILE_RIGHTS))
    return rules


def confine(denied: list[str]) -> int:
    """Restrict this process (and so whatever it then execs) to writing nothing beneath ``denied`` (absolute,
    existing directories, links resolved); returns the ABI used. Raises :class:`Unavailable`."""
    abi = abi_version()
    handled = handled_rights(abi)
    attr = RulesetAttr(handled, 0, (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the struct as this ABI knows it
    ruleset = _syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for path, rights in grants(denied, handled):
            try:
                fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # gone since it was listed: nothing to allow
            try:
                rule = PathBeneathAttr(rights, fd)
                _syscall(
                    SYS_ADD_RULE,
                    ctypes.c_int(ruleset),
                    ctypes.c_int(RULE_PATH_BENEATH),
                    ctypes.byref(rule),
                    ctypes.c_uint32(0),
                )
            finally:
                os.close(fd)
        # Landlock needs no_new_privs (or CAP_SYS_ADMIN); it is also inherited, so nothing regains rights by exec.
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            code = ctypes.get_errno()
            raise Unavailable(code, f"no_new_privs refused: {os.strerror(code)}")
        try:
            _syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
        except OSError as exc:
            raise Unavailable(exc.errno, f"Landlock refused to restrict: {exc.strerror}") from None
    finally:
        os.close(ruleset)
    return abi


def parse(argv: list[str]) -> tuple[list[str], list[str]]:
    """(denied directories, command) from ``[--deny DIR]... [--] CMD ARGS...``; /logs always denied."""
    denied = ["/logs"]
    rest = list(argv)
    while rest and rest[0].startswith("--"):
        flag = rest.pop(0)
        if flag == "--":
            break
        if flag == "--deny" and rest:
            denied.append(rest.pop(0))
        elif flag.startswith("--deny="):
            denied.append(flag.removeprefix("--deny="))
        else:
            raise ValueError(f"unknown option {flag}")
    if not rest:
        raise ValueError("no command given")
    return denied, rest


def resolve(denied: list[str]) -> list[str]:
    """The denied directories as real absolute paths, each made when missing (an absent one could be created by
    the code under test, writable)."""
    real = []
    for path in denied:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or os.path.lexists(path):
                raise
            continue  # one this process cannot create, nor can the code under test (it has fewer rights)
        real.append(os.path.realpath(path))
    return real


def main(argv: list[str]) -> int:
    usage = "usage: polar-untrusted [--deny DIR]... CMD ARGS..."
    try:
        denied, command = parse(argv)
    except ValueError as exc:
        print(f"polar-untrusted: {exc}\n{usage}", file=sys.stderr)
        return 2
    try:
        confine(resolve(denied))
    except OSError as exc:
        print(
            f"polar-untrusted: refusing to run {command[0]}: cannot keep it from writing {', '.join(denied)} "
            f"({exc.strerror or exc}); the reward would be forgeable, so nothing runs (exit {REFUSED})",
            file=sys.stderr,
        )
        return REFUSED
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"polar-untrusted: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if exc.errno == errno.ENOENT else REFUSED
    return REFUSED  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
