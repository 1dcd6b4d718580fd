"""A real Ray cluster on this machine's loopback for the tests: a head node and worker nodes, each ``ray start`` in
its own session with its own ports and one temp dir of the test's, so the whole cluster (or one node) is killed by
session id. Never ``ray stop``: it kills every Ray process on the machine, other people's included."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from polar_cli.mitm import free_port

RAY = Path(sys.executable).parent / "ray"
REPO = Path(__file__).resolve().parents[2]
# Node death noticed in ~5 s (a refused health check counts at once; the default period is 3 s), timeouts left as
# they are: a short one fails nodes that start on a loaded machine.
HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}


def _env() -> dict[str, str]:
    # No usage reporting; the nodes import this checkout.
    return {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        **HEALTH,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }


def _ports() -> list[str]:
    flags = (
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    )
    out: list[str] = []
    for flag in flags:
        out += [flag, str(free_port())]
    return out + ["--min-worker-port", "0", "--max-worker-port", "0"]  # 0: any free port per worker


def _session_pids(sid: int) -> list[int]:
    """Every process of session ``sid`` and all their descendants (a node's proxy runs in a session of its own)."""
    parents: dict[int, int] = {}
    sessions: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        sessions[int(entry.name)] = int(fields[3])
    chosen = {pid for pid, s in sessions.items() if s == sid}
    grew = True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in chosen and pid not in chosen}
        chosen |= more
        grew = bool(more)
    return sorted(chosen)


@dataclass
class RayNode:
    process: subprocess.Popen
    log: Path

    def kill(self) -> int:
        """The node dies at once, as a machine would: every process of it (stopped first, so none forks away)."""
        pids = _session_pids(self.process.pid)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return len(pids)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every process of this node (its raylet, workers, proxy, harnesses)."""
        out = {}
        for pid in _session_pids(self.process.pid):
            try:
                out[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
        return out

    def node_id(self) -> str:
        """This node's Ray node id, read off its raylet's command line (no driver needed to ask the cluster)."""
        for cmdline in self.processes().values():
            for arg in cmdline.split():
                if arg.startswith("--node_id="):
                    return arg.split("=", 1)[1]
        raise RuntimeError(f"no raylet with --node_id among the node's processes:\n{self.log.read_text()[-2000:]}")


@dataclass
class RayCluster:
    root: Path
    address: str = ""
    nodes: list[RayNode] = field(default_factory=list)
    # More environment for every node (what `ray start` runs with, as a machine's own: say its cloud credentials).
    env: dict[str, str] = field(default_factory=dict)
    # Ray's Unix sockets live under its temp dir: a pytest tmp_path is too long a prefix (108-byte socket paths).
    temp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pray-", dir="/tmp")))

    def _start(self, args: list[str], name: str) -> RayNode:
        log = self.root / f"{name}.log"
        with open(log, "wb") as fh:
            process = subprocess.Popen(
                [
                    str(RAY),
                    "start",
                    "--node-ip-address",
                    "127.0.0.1",
                    "--disable-usage-stats",
                    "--object-store-memory",
                    "80000000",
                    *_ports(),
                    *args,
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**_env(), **self.env},
                start_new_session=True,
            )
        node = RayNode(process, log)
        self.nodes.append(node)
        return node

    def start(self, workers: list[dict[str, float]]) -> None:
        """A head node without CPUs (no sessions there) and one worker node per entry (its custom resources)."""
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        head = self._start(
            [
                "--head",
                "--port",
                str(port),
                "--num-cpus",
                "0",
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(self.temp / "h"),
            ],
            "head",
        )
        self._wait(head)

        # Each node its own temp dir: nodes on one machine sharing the head's would share socket names.
        def worker(i: int, attempt: int) -> RayNode:
            return self._start(
                [
                    "--address",
                    self.address,
                    "--num-cpus",
                    "2",
                    "--resources",
                    json.dumps(workers[i]),
                    "--temp-dir",
                    str(self.temp / f"w{i}-{attempt}"),
                ],
                f"worker{i}-{attempt}",
            )

        started = [worker(i, 0) for i in range(len(workers))]
        for i, node in enumerate(started):
            for attempt in range(1, 4):
                try:
                    self._wait(node)
                    break
                except RuntimeError:
                    # `ray start` gives a node 30 s (not configurable) to register with the head; on a loaded
                    # machine it can miss that. Its leftovers die, and a fresh node takes its place in the list.
                    if attempt == 3:
                        raise
                    node.kill()
                    retry = worker(i, attempt)
                    self.nodes.remove(retry)
                    self.nodes[self.nodes.index(node)] = retry
                    node = retry

    @staticmethod
    def _wait(node: RayNode, timeout_s: float = 180) -> None:
        try:
            code = node.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"ray start did not finish in {timeout_s} s:\n{node.log.read_text()[-3000:]}") from None
        if code != 0:
            raise RuntimeError(f"ray start exited {code}:\n{node.log.read_text()[-3000:]}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in _session_pids(node.process.pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                time.sleep(0.5)
        shutil.rmtree(self.temp, ignore_errors=True)
