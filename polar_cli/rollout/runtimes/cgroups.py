"""Resource limits for daemonless sandboxes (bwrap): a cgroup per sandbox with its cpu, memory and pids limits,
nested under this process's own cgroup (so whatever limits polar runs under still apply), cgroup v1 or v2.

A cgroup needs write access to the cgroup filesystem (root, or a delegated subtree): where there is none,
:func:`create` returns None with the reason and the sandbox runs without limits (the runtime logs it once).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _own_paths() -> dict[str, str]:
    """controller name ("" for v2) -> this process's cgroup path."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


@dataclass
class Cgroup:
    dirs: list[Path]  # one per controller (v1) or the one unified directory (v2)

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started inside the cgroup (a shell joins it, then execs ``argv``; everything it starts stays
        in). Cheaper than a ``preexec_fn``, which makes Python fork the whole runner instead of spawning."""
        return ["/bin/sh", "-c", _JOIN, "cgroup-join", *(str(d / "cgroup.procs") for d in self.dirs), "--", *argv]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return found

    def oom_kills(self) -> int:
        """How many processes the memory limit's OOM killer has killed in this cgroup so far (0 without one)."""
        return sum(oom_kills(d) for d in self.dirs)

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until it is empty."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def oom_kills(directory: Path) -> int:
    """The ``oom_kill`` count of a cgroup directory: v2's ``memory.events``, v1's ``memory.oom_control``; 0 where
    the directory has neither (not a memory cgroup, gone)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (directory / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


def memory_dir_of(pid: int) -> Path | None:
    """The host directory of the memory cgroup process ``pid`` is in (v2: its one cgroup), None when unknown."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    if "memory" in paths:
        return ROOT / "memory" / paths["memory"].lstrip("/")
    if "" in paths and (ROOT / "cgroup.controllers").exists():
        return ROOT / paths[""].lstrip("/")
    return None


def _no_swap(limit: Path, value: str) -> None:
    """Memory and swap together within the memory limit: a sandbox swapping past it would still hold the host's
    memory hostage (and run on, slowly, instead of being OOM-killed). Kernels without swap accounting have no such
    file, and no swap to limit per cgroup."""
    if limit.exists():
        limit.write_text(value)


def create(name: str, cpus: float | None, memory_mb: int | None, pids: int | None) -> tuple[Cgroup | None, str]:
    """A cgroup limiting what is given (None: no limit); (None, reason) when cgroups are not writable here."""
    if not (cpus or memory_mb or pids):
        return None, "no limits asked"
    own = _own_paths()
    unified = (ROOT / "cgroup.controllers").exists()
    wanted = {"cpu": cpus, "memory": memory_mb, "pids": pids}
    dirs: list[Path] = []
    try:
        if unified:
            parent = ROOT / own.get("", "/").lstrip("/")
            enable = " ".join(f"+{c}" for c, v in wanted.items() if v)
            (parent / "cgroup.subtree_control").write_text(enable)
            d = parent / f"polar-{name}"
            d.mkdir(exist_ok=True)
            dirs.append(d)
            if cpus:
                (d / "cpu.max").write_text(f"{int(cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
            if memory_mb:
                (d / "memory.max").write_text(str(memory_mb * 2**20))
                _no_swap(d / "memory.swap.max", "0")
            if pids:
                (d / "pids.max").write_text(str(pids))
        else:
            for controller, value in wanted.items():
                if not value:
                    continue
                d = ROOT / controller / own.get(controller, "/").lstrip("/") / f"polar-{name}"
                d.mkdir(exist_ok=True)
                dirs.append(d)
                if controller == "cpu":
                    (d / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (d / "cpu.cfs_quota_us").write_text(str(int(cpus * CPU_PERIOD_US)))
                elif controller == "memory":
                    (d / "memory.limit_in_bytes").write_text(str(memory_mb * 2**20))
                    _no_swap(d / "memory.memsw.limit_in_bytes", str(memory_mb * 2**20))
                else:
                    (d / "pids.max").write_text(str(pids))
    except OSError as exc:
        for d in dirs:
            try:
                d.rmdir()
            except OSError:
                pass
        return None, f"cgroups not writable here ({exc})"
    return Cgroup(dirs), ""
