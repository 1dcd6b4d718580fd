"""A disk bound for the sandbox's writable host directories (workspace, HOME, binds; /tmp where it is no tmpfs of
its own), for the runtimes whose directories are plain host directories (bwrap, local; oci for what it binds).

Two parts: ``RLIMIT_FSIZE`` on every sandboxed process (:func:`fsize_flags`: no single file grows past the limit,
the write fails with EFBIG or SIGXFSZ kills the writer), and :func:`watch`, which samples the directories' total
size about twice a second (sooner while they grow fast: :func:`next_sample`) while an exec runs and kills the exec
when it is over the limit (or holds more than ``max_entries`` entries: a walk that cannot finish is not a bound).
Between two samples the sandbox can write what its disk takes in that time more.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path

DEFAULT_DISK_MB = 4096
DEFAULT_MAX_ENTRIES = 200_000
INTERVAL_S = 0.5


def usage(roots: Iterable[Path], max_entries: int = DEFAULT_MAX_ENTRIES) -> tuple[int, int]:
    """(bytes allocated, entries) under ``roots``, links not followed; stops counting entries past
    ``max_entries`` (the caller treats that as over)."""
    total = entries = 0
    pending = [str(r) for r in roots]
    while pending and entries <= max_entries:
        directory = pending.pop()
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    entries += 1
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += info.st_blocks * 512  # allocated: a sparse file takes no disk
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(entry.path)
        except OSError:
            continue
    return total, entries


def fsize_flags(prlimit: str | None, limit_mb: int) -> list[str]:
    """``prlimit --fsize`` of the limit (every process of the sandbox inherits it); nothing without prlimit."""
    return [prlimit, f"--fsize={limit_mb * 2**20}", "--"] if prlimit else []


def exceeded(limit_mb: int) -> str:
    return f"polar: disk limit {limit_mb} MiB exceeded"


async def watch(
    roots: Callable[[], list[Path]], limit_mb: int, kill: Callable[[], None], max_entries: int = DEFAULT_MAX_ENTRIES
) -> str:
    """Runs until cancelled, or until ``roots`` hold more than ``limit_mb`` MiB (or ``max_entries`` entries): then
    calls ``kill`` and returns the line to add to the exec's stderr. Samples every :data:`INTERVAL_S`, but at
    least five walks' time apart (a walk of a large tree costs CPU the sandboxes share), and sooner when the
    directories grow fast enough to reach the limit before then (:func:`next_sample`)."""
    limit = limit_mb * 2**20
    last: tuple[float, int] | None = None
    while True:
        started = time.monotonic()
        used, entries = await asyncio.to_thread(usage, roots(), max_entries)
        if used > limit or entries > max_entries:
            kill()
            held = f"more than {max_entries} files" if entries > max_entries else f"{used / 2**20:.0f} MiB"
            return f"\n{exceeded(limit_mb)} (the workspace, HOME and the sandbox's other directories held {held})\n"
        now = time.monotonic()
        await asyncio.sleep(next_sample(used, limit, last, now, now - started))
        last = (now, used)


MIN_INTERVAL_S = 0.05


def next_sample(used: int, limit: int, last: tuple[float, int] | None, now: float, walk_s: float) -> float:
    """Seconds until the next walk: :data:`INTERVAL_S` (at least five walks' time), or half the time the growth
    since the ``last`` sample (its time and bytes) needs to reach ``limit``, never under :data:`MIN_INTERVAL_S`:
    a sandbox writing a GB a second is caught within tens of MB of the limit, not a second's writes past it."""
    calm = max(INTERVAL_S, 5 * walk_s)
    if last is None:  # no rate yet: the second sample comes soon, so a fast writer is measured early
        return max(MIN_INTERVAL_S, 5 * walk_s, min(calm, 0.1))
    if used <= last[1] or now <= last[0]:
        return calm
    rate = (used - last[1]) / (now - last[0])
    return max(MIN_INTERVAL_S, 5 * walk_s, min(calm, (limit - used) / rate / 2))
