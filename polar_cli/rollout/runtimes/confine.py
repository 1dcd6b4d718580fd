"""No host root in a bwrap sandbox: the host directories it writes, which of the host's ``/etc`` it sees, its
accounts, and its ``/tmp`` (a size-capped tmpfs).

When polar runs as root, bwrap's own user namespace would map the sandbox's uid to host root, which reads every
root-only file mounted inside (its capabilities are gone, its owner rights are not) and leaves root-owned setuid
files on the host. The bwrap runtime then runs the sandbox as :data:`DEFAULT_HOST_UID` (an id of no account), so
the writable host directories are handed to that uid (:func:`hand_over`) before each exec: the runner writes files
there between execs."""

from __future__ import annotations

import asyncio
import os
import posixpath
import stat
import subprocess
from collections.abc import Iterable
from pathlib import Path

# The host uid/gid a root polar's sandboxes run as: owned by no account, above the ranges /etc/subuid and
# systemd-nspawn hand out (so no rootless container's users share it) and below 2**31 (signed-uid bugs).
DEFAULT_HOST_UID = 2_000_000_000
DEFAULT_TMP_MB = 1024
# What a harness needs of the host's /etc (name resolution, CA bundles, the dynamic linker, time zone, the
# alternatives links into /usr, Debian's perl and python configuration): everything else, the host's accounts,
# secrets, service configuration and credentials, stays out. passwd and group are the sandbox's own.
ETC_ALLOWLIST = (
    "hosts",
    "resolv.conf",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "protocols",
    "services",
    "networks",
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates",
    "ca-certificates.conf",
    "pki",
    "crypto-policies",
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "os-release",
    "debian_version",
    "lsb-release",
    "mime.types",
    "magic",
    "magic.mime",
    "mtab",
    "shells",
    "profile",
    "bash.bashrc",
    "inputrc",
    "locale.alias",
    "terminfo",
    "perl",
    "python3",
)
PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\npolar:x:{uid}:{uid}:polar:{home}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\npolar:x:{uid}:\nnogroup:x:65534:\n"


def hand_over(root: Path, uid: int, gid: int) -> None:
    """Make everything under ``root`` owned by ``uid:gid`` (what is not already), links themselves, never their
    targets. Directory fds (``os.fwalk``), so a sandbox that swaps a directory for a symlink cannot redirect it."""
    if os.lstat(root).st_uid != uid:
        os.lchown(root, uid, gid)
    for _, dirs, files, fd in os.fwalk(root):
        for name in (*dirs, *files):
            try:
                if os.stat(name, dir_fd=fd, follow_symlinks=False).st_uid != uid:
                    os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass


def strip_setid(root: Path) -> list[str]:
    """Clear the setuid and setgid bits of every regular file under ``root`` (what a sandbox leaves on the host
    must not run with its owner's rights); returns the paths (relative to ``root``) it changed."""
    changed = []
    for top, _, files, fd in os.fwalk(root):
        for name in files:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    # O_NOFOLLOW, then fchmod: the bits go from this very file, not a link's target.
                    file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                    try:
                        os.fchmod(file_fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                    finally:
                        os.close(file_fd)
                    changed.append(posixpath.relpath(posixpath.join(top, name), str(root)))
            except (FileNotFoundError, PermissionError):
                pass
    return changed


async def hand_over_all(roots: Iterable[Path], uid: int, gid: int) -> None:
    """:func:`hand_over` of every writable directory of a sandbox (before each exec: the runner writes there as
    root)."""
    for root in roots:
        await asyncio.to_thread(hand_over, root, uid, gid)


async def strip_setid_all(roots: Iterable[Path]) -> None:
    """:func:`strip_setid` of every one of ``roots`` that exists (at a sandbox's stop: nothing of it runs any more, so
    what it leaves on the host, e.g. kept sessions, runs with no one's rights)."""
    for root in roots:
        if root.is_dir():
            await asyncio.to_thread(strip_setid, root)


def etc_args(host_etc: str = "/etc") -> list[str]:
    """bwrap arguments for the allowlisted entries of the host's ``/etc``, read-only. A symlink into ``/usr`` or
    ``/proc`` (localtime, os-release, mtab) stays a symlink, resolved inside; any other is bound as its target."""
    args: list[str] = []
    for name in ETC_ALLOWLIST:
        host = posixpath.join(host_etc, name)
        inside = posixpath.join("/etc", name)
        if os.path.islink(host):
            target = os.readlink(host)
            if posixpath.normpath(posixpath.join(posixpath.dirname(inside), target)).startswith(("/usr/", "/proc/")):
                args += ["--symlink", target, inside]
                continue
        if os.path.exists(host):
            args += ["--ro-bind", os.path.realpath(host), inside]
    return args


# bwrap's mount operations and where each one's destination is among its arguments; --perms and --size apply to the
# operation after them.
_DESTINATION = {
    "--bind": 2,
    "--ro-bind": 2,
    "--dev-bind": 2,
    "--symlink": 2,
    "--tmpfs": 1,
    "--dir": 1,
    "--proc": 1,
    "--dev": 1,
}
_PREFIXES = ("--perms", "--size")


def with_parent_dirs(mounts: list[str]) -> list[str]:
    """``mounts`` (bwrap mount operations) with a ``--dir`` (0755) before each operation for every parent of its
    destination not made yet. bwrap makes missing parents 0700 and, run by root, root's: the sandbox's uid could
    not reach ``/home/polar`` or ``/etc/hosts``. Placed just before the operation, so a parent inside an earlier
    mount (a script under /tmp) is made in that mount."""
    out: list[str] = []
    made = {"/"}
    pending: list[str] = []
    i = 0
    while i < len(mounts):
        op = mounts[i]
        if op in _PREFIXES:
            pending += mounts[i : i + 2]
            i += 2
            continue
        count = _DESTINATION.get(op)
        if count is None:
            raise ValueError(f"not a bwrap mount operation: {op}")
        destination = posixpath.normpath(mounts[i + count])
        if not destination.startswith("/"):  # its parents never reach "/": the walk below would not end
            raise ValueError(f"bwrap mount destination {destination!r} is not absolute")
        missing = []
        parent = posixpath.dirname(destination)
        while parent not in made:
            missing.append(parent)
            parent = posixpath.dirname(parent)
        for directory in reversed(missing):
            out += ["--dir", directory]
            made.add(directory)
        out += [*pending, *mounts[i : i + count + 1]]
        pending = []
        made.add(destination)
        i += count + 1
    return out


def write_accounts(directory: Path, uid: int, home: str) -> tuple[Path, Path]:
    """The sandbox's passwd and group (its own user, root and nobody: the host's accounts stay out)."""
    directory.mkdir(exist_ok=True)
    passwd, group = directory / "passwd", directory / "group"
    passwd.write_text(PASSWD.format(uid=uid, home=home))
    group.write_text(GROUP.format(uid=uid))
    return passwd, group


def mount_tmpfs(path: Path, size_mb: int) -> None:
    """A tmpfs of at most ``size_mb`` MiB at ``path`` (root only): the sandbox's /tmp, kept across its execs, in
    memory (charged to the sandbox's memory cgroup) instead of the store's disk."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=1777,nosuid,nodev", "polar-tmp", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise OSError(f"mounting /tmp's tmpfs at {path} failed: {done.stderr.strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True)
