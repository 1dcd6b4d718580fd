"""Issue 23, attacks 8 and 9 and "no host root in the sandbox" / "bounded everything", on the bwrap runtime: the agent
is the attacker (a ``cmd:sh attack.sh`` harness in a real `polar rollout`, proxy-only, through a real mitmdump with
the scripted engine), or a command in a BwrapRuntime sandbox where a rollout would only add time.

- The sandbox is no host root: a root-only file mounted inside is unreadable, /etc shows only its allowlist (no
  /etc/default/cacerts, no shadow), what it writes is owned by an unprivileged uid, a setuid bit it sets is gone when
  the session ends, and session directories are 0700.
- Its /tmp is a size-capped tmpfs: filling it fails with ENOSPC inside, nothing lands on the store's disk.
- 300 connections from the sandbox get at most bridge.MAX_CONNECTIONS host socats per listener, inside the
  sandbox's cgroup, gone with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from polar_cli.rollout.proxy import StartedProxy
from polar_cli.rollout.runtimes import bridge, confine
from polar_cli.rollout.runtimes.base import ProxyEndpoints, SandboxSpec
from polar_cli.rollout.runtimes.bwrap import BwrapRuntime, find_bwrap
from tests.support.attacks import host_pids, write_task
from tests.support.prereq import missing
from tests.support.proxy import REPO

PYTHON = "/usr/bin/python3"  # the host's: /usr is inside every sandbox
ALLOWED_ETC = {name.split("/")[0] for name in confine.ETC_ALLOWLIST} | {"passwd", "group"}


def _rollout_command(
    proxy: StartedProxy, root: Path, harness: str, *extra: str, seed: int, verify: str = "false"
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "polar_cli.app",
        "rollout",
        str(write_task(root, verify=verify)),
        "--harness",
        harness,
        "--runtime",
        "bwrap",
        "--proxy",
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        "--reverse-url",
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
        "--confdir",
        str(Path(proxy.endpoints.ca).parent),
        "--report-dir",
        str(root / "report"),
        "--seed",
        str(seed),
        "--no-progress",
        *extra,
    ]


def _env(proxy: StartedProxy, **extra: str) -> dict[str, str]:
    return {**os.environ, "POLAR_CONTROL_TOKEN": proxy.control_token, **extra}


def _only_session(root: Path) -> dict:
    (session,) = json.loads((root / "report" / "rollout-summary.json").read_text())["session_results"]
    return session


def _harness_log(root: Path, session_id: str) -> str:
    return (root / "report" / "logs" / "sessions" / session_id / "harness.log").read_text()


def _host_socats(marker: str) -> list[int]:
    """Host pids of the bridge's host-side socats (UNIX-LISTEN) whose sockets are under ``marker``."""
    return host_pids(
        lambda words: (
            words[0].endswith(b"socat") and any(w.startswith(b"UNIX-LISTEN:") and marker.encode() in w for w in words)
        )
    )


# --- the pure parts --------------------------------------------------------------------------------------------


def test_every_parent_of_a_mount_point_is_made_0755_just_before_it() -> None:
    mounts = [
        "--ro-bind",
        "/usr",
        "/usr",
        "--ro-bind",
        "/h/hosts",
        "/etc/hosts",
        "--ro-bind",
        "/h/c",
        "/etc/ssl/certs",
        "--bind",
        "/s/tmp",
        "/tmp",
        "--perms",
        "0700",
        "--dir",
        "/var/tmp",
        "--ro-bind",
        "/x/a.sh",
        "/tmp/pytest-of-root/t/a.sh",
    ]
    assert confine.with_parent_dirs(mounts) == [
        "--ro-bind",
        "/usr",
        "/usr",
        "--dir",
        "/etc",
        "--ro-bind",
        "/h/hosts",
        "/etc/hosts",
        "--dir",
        "/etc/ssl",
        "--ro-bind",
        "/h/c",
        "/etc/ssl/certs",
        "--bind",
        "/s/tmp",
        "/tmp",
        "--dir",
        "/var",
        "--perms",
        "0700",
        "--dir",
        "/var/tmp",
        # made after /tmp is mounted, so inside it: the sandbox's uid reaches the script
        "--dir",
        "/tmp/pytest-of-root",
        "--dir",
        "/tmp/pytest-of-root/t",
        "--ro-bind",
        "/x/a.sh",
        "/tmp/pytest-of-root/t/a.sh",
    ]


def test_etc_shows_only_its_allowlist_and_keeps_links_into_usr(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "ssl" / "certs").mkdir(parents=True)
    (etc / "ssl" / "private").mkdir()
    for name in ("hosts", "shadow", "sudoers", "ssl/openssl.cnf", "elsewhere"):
        (etc / name).write_text(name)
    (etc / "localtime").symlink_to("/usr/share/zoneinfo/Etc/UTC")
    (etc / "mtab").symlink_to("../proc/self/mounts")
    (etc / "resolv.conf").symlink_to(etc / "elsewhere")
    args = confine.etc_args(str(etc))
    destinations = [args[i + 2] for i in range(0, len(args), 3)]
    assert sorted(destinations) == [
        "/etc/hosts",
        "/etc/localtime",
        "/etc/mtab",
        "/etc/resolv.conf",
        "/etc/ssl/certs",
        "/etc/ssl/openssl.cnf",
    ]
    assert ["--symlink", "/usr/share/zoneinfo/Etc/UTC", "/etc/localtime"] == args[
        args.index("/etc/localtime") - 2 : args.index("/etc/localtime") + 1
    ]
    # a link out of /usr is bound as its target: the sandbox never follows a host path of its own choosing
    assert args[args.index("/etc/resolv.conf") - 2 : args.index("/etc/resolv.conf")] == [
        "--ro-bind",
        str(etc / "elsewhere"),
    ]


def test_setid_bits_are_stripped_and_ownership_handed_over_without_following_links(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        missing("changing a file's owner needs root")
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "d").mkdir(parents=True)
    outside.write_text("host file")
    (tree / "d" / "suid").write_bytes(b"#!/bin/sh\n")
    (tree / "link").symlink_to(outside)
    (tree / "d" / "sticky-dir").mkdir()
    (tree / "d" / "sticky-dir").chmod(0o3777)
    uid = confine.DEFAULT_HOST_UID
    confine.hand_over(tree, uid, uid)
    assert {p.lstat().st_uid for p in (tree, tree / "d", tree / "d" / "suid", tree / "link")} == {uid}
    assert outside.stat().st_uid == 0  # the link, not its target
    (tree / "d" / "suid").chmod(0o6755)  # what the sandbox does to its own file (a chown by root clears it)
    assert confine.strip_setid(tree) == ["d/suid"]
    assert stat.S_IMODE((tree / "d" / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((tree / "d" / "sticky-dir").stat().st_mode) == 0o3777  # directories keep theirs


# --- attacks on real rollouts ----------------------------------------------------------------------------------

ATTACK = r"""
secret="$1"
echo "uid $(id -u)"
cat /etc/default/cacerts >/dev/null 2>&1 && echo "read cacerts" || echo "no cacerts"
cat /etc/shadow >/dev/null 2>&1 && echo "read shadow" || echo "no shadow"
cat "$secret" 2>/dev/null && echo "read secret" || echo "no secret"
echo "etc $(ls -A /etc | tr '\n' ' ')"
cp /bin/sh "$HOME/x" && chmod 4755 "$HOME/x" && echo "setuid home $(stat -c %a "$HOME/x")"
cp /bin/sh ./y && chmod 6755 ./y && echo "setuid workspace $(stat -c %a ./y)"
mkdir -p "$HOME/deep" && cp /bin/sh "$HOME/deep/z" && chmod 2755 "$HOME/deep/z"
echo honest > result.txt
"""


def test_the_sandbox_is_no_host_root(proxy: StartedProxy, tmp_path: Path) -> None:
    """Attack 9: a root-only host file (0600, deliberately mounted with --read-only), /etc/default/cacerts and
    /etc/shadow are unreadable; /etc lists only the allowlist; a setuid copy of sh in HOME and the workspace leaves
    no setuid file on the host (kept sessions), none of root's; session directories are 0700. The honest part of
    the same session (result.txt) is verified and rewarded."""
    secret = tmp_path / "secret"
    secret.write_text("root-only-secret\n")
    secret.chmod(0o600)
    attack = tmp_path / "attack.sh"
    attack.write_text(ATTACK)
    work = tmp_path / "work"
    done = subprocess.run(
        _rollout_command(
            proxy,
            tmp_path,
            f"cmd:sh {attack} {secret}",
            "--read-only",
            str(secret),
            "--work-dir",
            str(work),
            "--keep-sessions",
            seed=2391,
            verify="grep -qx honest result.txt",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(proxy),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    session = _only_session(tmp_path)
    log = _harness_log(tmp_path, session["session_id"])
    assert "uid 1000" in log and "no cacerts" in log and "no shadow" in log and "no secret" in log, log
    assert "root-only-secret" not in log
    assert "setuid home 4755" in log and "setuid workspace 6755" in log, log  # the attack did run
    listed = set(next(line for line in log.splitlines() if line.startswith("etc ")).split()[1:])
    assert listed and listed <= ALLOWED_ETC, listed - ALLOWED_ETC
    assert (session["status"], session["reward"]) == ("completed", 1.0)

    session_dir = work / "sessions" / session["session_id"]
    assert stat.S_IMODE(session_dir.stat().st_mode) == 0o700
    left = [p for p in session_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert (session_dir / "home" / "x") in left and (session_dir / "home" / "deep" / "z") in left
    setid = [p for p in left if p.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)]
    assert setid == [], setid
    if os.geteuid() == 0:
        assert (session_dir / "home" / "x").stat().st_uid == confine.DEFAULT_HOST_UID


def test_filling_tmp_fails_inside_and_keeps_the_store_disk(tmp_path: Path) -> None:
    """/tmp is a tmpfs of tmp_mb MiB: 64 MiB written into a 16 MiB /tmp stop at ENOSPC with at most 16 MiB written;
    the host directory behind it is a tmpfs mount (memory, not the store's disk), /tmp still lasts across the
    sandbox's execs, and the tmpfs goes with it."""
    if os.geteuid() != 0:
        missing("the /tmp tmpfs needs root (without it /tmp is a host directory)")
    if find_bwrap() is None:
        missing("bwrap is not installed (make sandbox)")
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    spec = SandboxSpec(
        name="fill",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        network="none",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
    )

    async def main():
        box = await BwrapRuntime(tmp_mb=16, scratch_dir=tmp_path).start(spec)
        try:
            filled = await box.exec(
                "dd if=/dev/zero of=/tmp/fill bs=1M count=64; echo dd=$?; "
                "stat -c %s /tmp/fill; grep ' /tmp ' /proc/self/mounts"
            )
            host_mount = [
                line for line in Path("/proc/mounts").read_text().splitlines() if f" {box.scratch / 'tmp'} " in line
            ]
            again = await box.exec("stat -c %s /tmp/fill")
        finally:
            await box.stop()
        return box, filled, host_mount, again

    box, filled, host_mount, again = asyncio.run(main())
    assert "No space left on device" in filled.stderr and "dd=1" in filled.stdout, filled
    size = int(filled.stdout.splitlines()[1])
    assert size <= 16 * 2**20
    assert filled.stdout.splitlines()[2].split()[2] == "tmpfs"
    assert len(host_mount) == 1 and host_mount[0].split()[2] == "tmpfs" and "size=16384k" in host_mount[0]
    assert again.stdout.strip() == str(size)  # the next exec sees the same /tmp
    assert f" {box.scratch / 'tmp'} " not in Path("/proc/mounts").read_text() and not box.scratch.exists()


CONNECT_FLOOD = r"""
import glob, socket, sys, time
# Straight at the bridge's Unix sockets (the loopback's socat would only slow the flood down), never blocking: a
# connection the host side does not take fails at once instead of waiting in its queue.
paths = sorted(glob.glob("/run/polar/sockets/*.sock"))
held = []
for i in range(300):
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(paths[i % len(paths)])
        held.append(s)
    except OSError:
        s.close()
    time.sleep(0.002)
print("sockets", len(paths), "connected", len(held), flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_a_connection_flood_gets_a_bounded_number_of_host_processes(proxy: StartedProxy, tmp_path: Path) -> None:
    """Attack 8: 300 connections held open from a proxy-only sandbox. The host-side socats fork at most
    MAX_CONNECTIONS children per listener (the rest wait in the listen queue or are refused), all in the sandbox's
    cgroup, and none is left once the rollout returns. Counted on the host's /proc while the attack runs."""
    flood = tmp_path / "flood.py"
    flood.write_text(CONNECT_FLOOD)
    # The runtime's per-sandbox directories (its bridge sockets) land here: short, a socket path has 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="pb-"))
    process = subprocess.Popen(
        _rollout_command(proxy, tmp_path, f"cmd:{PYTHON} {flood} 3", seed=2392),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(proxy, TMPDIR=str(scratch)),
    )
    # pid -> its cgroups, read while it was alive: an exiting task leaves its cgroups (the kernel's cgroup_exit)
    # after its cmdline goes empty (exit_mm), so a reading followed by a non-empty cmdline is one of a live socat
    most, cgroups_seen, stop = 0, {}, threading.Event()

    def watch() -> None:
        nonlocal most
        while not stop.is_set():
            pids = _host_socats(str(scratch))
            most = max(most, len(pids))
            for pid in set(pids) - cgroups_seen.keys():
                try:
                    text = Path(f"/proc/{pid}/cgroup").read_text()
                    alive = Path(f"/proc/{pid}/cmdline").read_bytes() != b""
                except OSError:
                    continue
                if alive:
                    cgroups_seen[pid] = text
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        stop.set()
        watcher.join()
    assert process.returncode == 0, output
    log = _harness_log(tmp_path, _only_session(tmp_path)["session_id"])
    assert "sockets 2 connected" in log, log
    # the flood filled the cap of both listeners (one alone would be MAX_CONNECTIONS + 1), and got no further
    assert bridge.MAX_CONNECTIONS + 1 < most <= 2 * (bridge.MAX_CONNECTIONS + 1), most
    if os.geteuid() == 0:
        assert cgroups_seen and all("polar-bwrap-" in text for text in cgroups_seen.values()), cgroups_seen
    assert _host_socats(str(scratch)) == []
    shutil.rmtree(scratch)


def test_an_oom_kill_by_the_memory_limit_is_reported(tmp_path: Path) -> None:
    """The sandbox's cgroup OOM killer kills a 200 MB allocation under memory_mb=64: that exec says oom_killed (the
    runner keeps it ``failed``, saying why), the next exec of the same sandbox, which fits, does not."""
    if find_bwrap() is None:
        missing("bwrap is not installed (make sandbox)")
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    spec = SandboxSpec(
        name="oom",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        network="none",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
        memory_mb=64,
    )

    async def main():
        box = await BwrapRuntime(scratch_dir=tmp_path).start(spec)
        try:
            if box.cgroup is None:
                missing("cgroups are not writable here: no memory limit to kill")
            # Swap is bounded too (where the kernel accounts it): memory + swap within the same 64 MiB.
            for d in box.cgroup.dirs:
                for name, bound in (("memory.swap.max", "0"), ("memory.memsw.limit_in_bytes", str(64 * 2**20))):
                    if (d / name).exists():
                        assert (d / name).read_text().strip() == bound
            return await box.exec([PYTHON, "-c", "x = bytearray(200_000_000); print(len(x))"]), await box.exec("true")
        finally:
            await box.stop()

    killed, fine = asyncio.run(main())
    assert killed.exit_code == 137 and killed.oom_killed, killed
    assert fine.exit_code == 0 and not fine.oom_killed
