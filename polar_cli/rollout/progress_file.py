"""``rollout-progress.json``: a rollout's live counters, written beside its summary while it runs.

`polar dashboard` reads it from another process, so every write is whole (a temporary file, then ``os.replace``)
and redacted like the summary: the error reasons quote the harness's output, which is the agent's to choose.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from polar_cli.rollout.redact import write_json
from polar_cli.rollout.session import RolloutProgress

PROGRESS_FILE = "rollout-progress.json"
INTERVAL_S = 0.5


def progress_document(progress: RolloutProgress, *, final: bool) -> dict[str, Any]:
    """What the file holds: the counters as JSON, when they were read and whether the rollout has ended."""
    return {
        "total": progress.total,
        "stages": dict(progress.stages),
        "statuses": {str(k): v for k, v in progress.statuses.items()},
        "group_rewards": {g: list(r) for g, r in progress.group_rewards.items()},
        "errors": [list(e) for e in progress.errors],
        "started_at": progress.started_at,
        "ran": progress.ran,
        "nodes": dict(progress.nodes),
        "sessions_per_minute": progress.sessions_per_minute(),
        "updated_at": time.time(),
        "final": final,
    }


def write_progress(report_dir: Path, progress: RolloutProgress, known: Iterable[str | None], *, final: bool) -> None:
    """One atomic write of ``report_dir/rollout-progress.json``."""
    path = report_dir / PROGRESS_FILE
    tmp = path.with_name(f".{PROGRESS_FILE}.{os.getpid()}.tmp")
    write_json(tmp, progress_document(progress, final=final), known)
    os.replace(tmp, path)


@contextmanager
def progress_file(
    report_dir: Path, progress: RolloutProgress, known: Callable[[], Iterable[str | None]] = tuple
) -> Iterator[None]:
    """Keep ``report_dir/rollout-progress.json`` current while the block runs, and write it a last time at its end.
    ``known`` gives the secrets to redact, asked at every write: the proxy a rollout starts writes its control
    token file after the block has begun.

    A thread, not a task: the rollout's event loop is ``asyncio.run`` inside the block, and a display that lags a
    busy loop is still right. The counters are read without a lock; a write that races the runner's mutation of a
    counter can fail, and the next one, half a second later, catches up.
    """
    report_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()

    def keep_writing() -> None:
        while not stop.wait(INTERVAL_S):
            try:
                write_progress(report_dir, progress, known(), final=False)
            except (OSError, RuntimeError, ValueError):  # a counter resized mid-read, a full disk: try again
                continue

    thread = threading.Thread(target=keep_writing, name="rollout-progress", daemon=True)
    write_progress(report_dir, progress, known(), final=False)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        write_progress(report_dir, progress, known(), final=True)


@contextmanager
def progress_config(report_dir: Path, config: Any, known: Callable[[], Iterable[str | None]] = tuple) -> Iterator[Any]:
    """``config`` (a RolloutConfig) with fresh counters, and the progress file kept for them while the block runs."""
    progress = RolloutProgress()
    with progress_file(report_dir, progress, known):
        yield replace(config, progress=progress)
