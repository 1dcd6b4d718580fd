"""Helpers of the attack modules in tests/security (their shared proxy fixture is in tests/security/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from polar_cli.rollout.proxy import StartedProxy


def store_of(proxy: StartedProxy) -> str:
    return str(Path(proxy.log).parent / "store")


def write_task(root: Path, **task) -> Path:
    """One JSONL task ``t`` over a one-file workspace (verify ``false`` unless given)."""
    (root / "ws").mkdir(parents=True, exist_ok=True)
    (root / "ws" / "README").write_text("the task\n")
    path = root / "tasks.jsonl"
    path.write_text(
        json.dumps({"id": "t", "instruction": "do it", "workspace": "ws", "verify": "false", **task}) + "\n"
    )
    return path


def host_pids(matches: Callable[[list[bytes]], bool]) -> list[int]:
    """Host pids whose argv (NUL-split) ``matches``: the host's /proc shows every sandbox's processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if matches(words):
                found.append(int(entry.name))
    return found
