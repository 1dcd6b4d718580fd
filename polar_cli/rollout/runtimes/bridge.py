"""The proxy-only network: a sandbox with its own network namespace (only a loopback) reaches polar's proxy, and
nothing else, through Unix sockets.

Host side, one ``socat UNIX-LISTEN -> TCP 127.0.0.1:<port>`` per proxy listener (forward, reverse) in a per-sandbox
directory, forking one process per connection: at most :data:`MAX_CONNECTIONS` at a time (more wait in the listen
queue), inside the sandbox's cgroup where it has one, so a sandbox that opens connections by the hundred gets no
more host processes than that, all counted against its own pids and memory limits. Inside the sandbox's network
namespace, :data:`BRIDGE_SCRIPT` listens on 127.0.0.1:<same port> and relays to those sockets, so the proxy URLs
are the same inside as on the host. A Unix socket is reached through the filesystem, not the network: the sandbox
can use it only because its directory is mounted in, and it leads only to the proxy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from polar_cli import lifeline
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable
from polar_cli.rollout.runtimes.cgroups import Cgroup

# Concurrent connections per listener a sandbox gets through the host-side socat (a harness makes a few at a time).
MAX_CONNECTIONS = 32

# Run inside the namespace before the command (``sh -c BRIDGE_SCRIPT bridge CMD...``, with ``POLAR_BRIDGE`` set to
# "PORT=SOCKET ..."): one socat per port on the loopback; the command starts once every port listens, so its first
# call cannot race them. /proc/net/tcp lists a listener as "0100007F:<PORT HEX> 00000000:0000 0A" (read with
# shell builtins: a grep per poll cost more than the wait).
BRIDGE_SCRIPT = r"""
listening() {
  while read -r _ addr _ state _; do [ "$addr $state" = "0100007F:$1 0A" ] && return 0; done < /proc/net/tcp
  return 1
}
for pair in $POLAR_BRIDGE; do
  port=${pair%%=*}; sock=${pair#*=}
  socat TCP-LISTEN:$port,bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:$sock 2>/dev/null &
done
for pair in $POLAR_BRIDGE; do
  hex=$(printf '%04X' "${pair%%=*}"); i=0
  until listening "$hex"; do
    i=$((i+1)); [ $i -gt 2000 ] && { echo "polar: sandbox proxy bridge did not start" >&2; exit 125; }
    sleep 0.002
  done
done
unset POLAR_BRIDGE
exec "$@"
"""


def proxy_ports(proxy: ProxyEndpoints) -> list[tuple[str, int]]:
    """(name, port) of each proxy listener to bridge."""
    ports = [("forward", proxy.forward_port)]
    if proxy.reverse_port and proxy.reverse_port != proxy.forward_port:
        ports.append(("reverse", proxy.reverse_port))
    return ports


def bridge_env(proxy: ProxyEndpoints, sockets_inside: str) -> str:
    """``POLAR_BRIDGE`` for :data:`BRIDGE_SCRIPT`: where each port's socket is as seen inside."""
    return " ".join(f"{port}={sockets_inside}/{name}.sock" for name, port in proxy_ports(proxy))


async def start_host_bridges(
    proxy: ProxyEndpoints, sockets: Path, timeout: float = 5.0, cgroup: Cgroup | None = None, owner: int | None = None
) -> list[asyncio.subprocess.Process]:
    """The host-side socats, listening in ``sockets`` (mode 0600: only this user, which the sandbox maps to, or
    ``owner``, the sandbox's host uid), started in ``cgroup``."""
    sockets.mkdir(parents=True, exist_ok=True)
    owned = f",user={owner},group={owner}" if owner is not None else ""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for name, port in proxy_ports(proxy):
            argv = [
                "socat",
                f"UNIX-LISTEN:{sockets / name}.sock,fork,max-children={MAX_CONNECTIONS},mode=600{owned}",
                f"TCP:127.0.0.1:{port}",
            ]
            procs.append(
                await asyncio.create_subprocess_exec(
                    *(cgroup.wrap(argv) if cgroup else argv),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            lifeline.tie(procs[-1].pid)
        paths = [sockets / f"{name}.sock" for name, _ in proxy_ports(proxy)]
        deadline = time.monotonic() + timeout
        # socat chowns its socket after binding it: ready once the sandbox's uid owns it.
        while not all(p.exists() and (owner is None or p.stat().st_uid == owner) for p in paths):
            if any(p.returncode is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeUnavailable(f"the proxy bridge (socat) did not start in {sockets}")
            await asyncio.sleep(0.002)
    except BaseException:
        await stop_processes(procs)
        raise
    return procs


def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL a process started with ``start_new_session=True`` and its whole process group."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def stop_processes(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        kill_group(proc)
        await proc.wait()
        lifeline.untie(proc.pid)
