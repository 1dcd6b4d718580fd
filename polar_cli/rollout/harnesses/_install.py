"""Where the harness CLIs live: ``make harnesses`` installs them under the repository's ``.harness``
(``POLAR_HARNESS_DIR`` overrides it); otherwise they are looked up on PATH."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from polar_cli.rollout.harnesses.base import HarnessPreset

REPO = Path(__file__).resolve().parents[3]


def harness_dir() -> Path:
    return Path(os.environ.get("POLAR_HARNESS_DIR") or REPO / ".harness").absolute()


def executable(name: str) -> str:
    """The CLI's path as the sandbox sees it: the install is mounted read-only at its own path, so the
    ``.bin`` link is kept unresolved (its relative target resolves inside too)."""
    path = harness_dir() / "node_modules" / ".bin" / name
    if path.exists():
        return str(path)
    return shutil.which(name) or name


class InstalledHarness(HarnessPreset):
    """A preset whose CLI comes from the ``.harness`` install, which sandboxes then need to see."""

    @property
    def read_only(self) -> tuple[Path, ...]:
        return (harness_dir(),) if harness_dir().exists() else ()
