"""Issue 29: the proxy-only network's host side. The sandbox reaches polar's proxy, and nothing else, through Unix
sockets: one host socat per proxy listener, whose socket only the sandbox's uid may open (mode 0600, its owner),
at most MAX_CONNECTIONS forks at a time, inside the sandbox's cgroup, and killed with their process groups."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes import bridge
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable
from polar_cli.rollout.runtimes.cgroups import Cgroup

CA = Path("/nonexistent/ca.pem")


def test_each_distinct_listener_is_bridged_once() -> None:
    assert bridge.proxy_ports(ProxyEndpoints(8080, 8081, CA)) == [("forward", 8080), ("reverse", 8081)]
    assert bridge.proxy_ports(ProxyEndpoints(8080, 8080, CA)) == [("forward", 8080)]
    assert bridge.proxy_ports(ProxyEndpoints(8080, 0, CA)) == [("forward", 8080)]


def test_bridge_env_names_each_ports_socket_inside() -> None:
    assert bridge.bridge_env(ProxyEndpoints(8080, 8081, CA), "/run/polar/sockets") == (
        "8080=/run/polar/sockets/forward.sock 8081=/run/polar/sockets/reverse.sock"
    )
    assert bridge.bridge_env(ProxyEndpoints(9, 9, CA), "/s") == "9=/s/forward.sock"


class _Spawner:
    """asyncio.create_subprocess_exec that records the argv and starts a real sleeper in its own group, making the
    socket as socat would (after ``delay``, owned by ``owner``) unless ``dies``."""

    def __init__(self, delay: float = 0.0, owner: int | None = None, dies: bool = False) -> None:
        self.argvs: list[list[str]] = []
        self.kwargs: list[dict] = []
        self.procs: list[asyncio.subprocess.Process] = []
        self.delay, self.owner, self.dies = delay, owner, dies

    async def __call__(self, *argv: str, **kwargs: object) -> asyncio.subprocess.Process:
        self.argvs.append(list(argv))
        self.kwargs.append(kwargs)
        listen = next(a for a in argv if a.startswith("UNIX-LISTEN:"))
        path = Path(listen.removeprefix("UNIX-LISTEN:").split(",")[0])
        script = "exit 1" if self.dies else f"sleep {self.delay}; : > {path}; sleep 30"
        proc = await real_exec("/bin/sh", "-c", script, start_new_session=True)
        self.procs.append(proc)
        if self.owner is not None and not self.dies:
            asyncio.get_running_loop().call_later(self.delay + 0.3, lambda: _chown_when_there(path, self.owner))
        return proc


real_exec = asyncio.create_subprocess_exec


def _chown_when_there(path: Path, owner: int) -> None:
    if path.exists():
        os.chown(path, owner, owner)


@pytest.fixture
def ties(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(bridge.lifeline, "tie", lambda pid: seen.append(f"+{pid}"))
    monkeypatch.setattr(bridge.lifeline, "untie", lambda pid: seen.append(f"-{pid}"))
    return seen


def test_one_socat_per_listener_with_a_private_socket_in_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ties: list[str]
) -> None:
    spawner = _Spawner()
    monkeypatch.setattr(bridge.asyncio, "create_subprocess_exec", spawner)
    cgroup = Cgroup([tmp_path / "cg"])
    sockets = tmp_path / "a" / "sockets"

    async def scenario() -> list:
        procs = await bridge.start_host_bridges(ProxyEndpoints(8080, 8081, CA), sockets, cgroup=cgroup)
        await bridge.stop_processes(procs)
        return procs

    procs = asyncio.run(scenario())
    assert spawner.argvs == [
        cgroup.wrap(
            [
                "socat",
                f"UNIX-LISTEN:{sockets}/forward.sock,fork,max-children=32,mode=600",
                "TCP:127.0.0.1:8080",
            ]
        ),
        cgroup.wrap(
            [
                "socat",
                f"UNIX-LISTEN:{sockets}/reverse.sock,fork,max-children=32,mode=600",
                "TCP:127.0.0.1:8081",
            ]
        ),
    ]
    devnull = bridge.subprocess.DEVNULL
    assert spawner.kwargs == [{"stdin": devnull, "stdout": devnull, "stderr": devnull, "start_new_session": True}] * 2
    assert [p.returncode for p in procs] == [-9, -9]
    pids = [p.pid for p in procs]
    assert ties == [f"+{pids[0]}", f"+{pids[1]}", f"-{pids[0]}", f"-{pids[1]}"]


def test_an_owned_socket_is_ready_only_once_the_sandboxs_uid_owns_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ties: list[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    spawner = _Spawner(owner=4242)
    monkeypatch.setattr(bridge.asyncio, "create_subprocess_exec", spawner)
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr(bridge.asyncio, "sleep", sleep)

    async def scenario() -> float:
        began = time.monotonic()
        procs = await bridge.start_host_bridges(ProxyEndpoints(7, 7, CA), tmp_path / "s", owner=4242)
        took = time.monotonic() - began
        assert (tmp_path / "s" / "forward.sock").stat().st_uid == 4242
        await bridge.stop_processes(procs)
        return took

    # Ready once the owner is right, not before; polled every few milliseconds, so not much later either.
    assert asyncio.run(scenario()) >= 0.25
    assert waits and max(waits) <= 0.01
    assert (
        spawner.argvs[0][1]
        == f"UNIX-LISTEN:{tmp_path}/s/forward.sock,fork,max-children=32,mode=600,user=4242,group=4242"
    )
    assert spawner.argvs[0][0] == "socat"  # no cgroup: socat itself


def test_a_socat_that_dies_or_never_listens_fails_the_start_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ties: list[str]
) -> None:
    # A socat that died fails the start at once, not at the deadline.
    for spawner, timeout in ((_Spawner(dies=True), 3.0), (_Spawner(delay=30), 0.3)):
        monkeypatch.setattr(bridge.asyncio, "create_subprocess_exec", spawner)
        began = time.monotonic()
        with pytest.raises(RuntimeUnavailable, match=f"^the proxy bridge \\(socat\\) did not start in {tmp_path}$"):
            asyncio.run(bridge.start_host_bridges(ProxyEndpoints(1, 2, CA), tmp_path, timeout=timeout))
        assert time.monotonic() - began < 2.5
        assert all(p.returncode is not None for p in spawner.procs) and len(spawner.procs) == 2


def test_the_real_socket_is_private_and_leads_to_the_proxy_port(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a socket owned by another uid needs root")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got: list[bytes] = []

    def answer() -> None:
        conn, _ = server.accept()
        got.append(conn.recv(100))
        conn.sendall(b"proxy")
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()

    async def scenario() -> bytes:
        procs = await bridge.start_host_bridges(ProxyEndpoints(port, port, CA), tmp_path, owner=54321)
        try:
            path = tmp_path / "forward.sock"
            mode = path.stat()
            assert (stat.S_IMODE(mode.st_mode), mode.st_uid, mode.st_gid) == (0o600, 54321, 54321)
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(b"hello")
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            await bridge.stop_processes(procs)

    assert asyncio.run(scenario()) == b"proxy"
    assert got == [b"hello"]
    server.close()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for an init that may be slow to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_group_kills_the_whole_group_once_and_never_a_reaped_one() -> None:
    async def scenario() -> tuple:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", "sleep 30 & echo $!; wait", stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        assert proc.stdout is not None
        grandchild = int(await proc.stdout.readline())
        bridge.kill_group(proc)
        await proc.wait()
        for _ in range(200):
            if not _alive(grandchild):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the group's other process survived")
        bridge.kill_group(proc)  # reaped: its pid may be another process's by now
        return proc.returncode

    assert asyncio.run(scenario()) == -9


def test_kill_group_of_a_group_gone_unnoticed_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[int] = []

    def killpg(pgid: int, sig: int) -> None:
        killed.append(pgid)
        raise ProcessLookupError

    monkeypatch.setattr(bridge.os, "killpg", killpg)
    proc = type("P", (), {"returncode": None, "pid": 99999})()
    bridge.kill_group(proc)  # type: ignore[arg-type]
    assert killed == [99999]
