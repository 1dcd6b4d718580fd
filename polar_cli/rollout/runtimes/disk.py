"""A disk bound for the sandbox's writable host directories (workspace, HOME, binds; /tmp where it is no tmpfs of
its own), for the runtimes whose directories are plain host directories (bwrap, local; oci for what it binds).

Two parts: ``RLIMIT_FSIZE`` on every sandboxed process (:func:`fsize_flags`: no single file grows past the limit,
the write fails with EFBIG or SIGXFSZ kills the writer), and :func:`watch`, which samples the directories' total
size about every second while an exec runs and kills the exec when it is over the limit (or holds more than
``max_entries`` entries: a walk that cannot finish is not a bound). Between two samples the sandbox can write what
its disk takes in about a second more.
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
INTERVAL_S = 1.0


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
    calls ``kill`` and returns the line to add to the exec's stderr. Waits at least five walks' time between two
    (a walk of a large tree costs CPU the sandboxes share)."""
    while True:
        started = time.monotonic()
        used, entries = await asyncio.to_thread(usage, roots(), max_entries)
        if used > limit_mb * 2**20 or entries > max_entries:
            kill()
            held = f"more than {max_entries} files" if entries > max_entries else f"{used / 2**20:.0f} MiB"
            return f"\n{exceeded(limit_mb)} (the workspace, HOME and the sandbox's other directories held {held})\n"
        await asyncio.sleep(max(INTERVAL_S, 5 * (time.monotonic() - started)))
