"""Kilo Code CLI (npm ``@kilocode/cli``, its Linux binary from the optional ``@kilocode/cli-linux-x64``): a fork
of opencode, configured the same way (:mod:`opencode`) in ``~/.config/kilo/kilo.json``, its switches spelled
``KILO_``; also no telemetry, no presence or session upload, no codebase indexing. ``kilo run``.

Window: the model's ``limit.context``/``limit.output``, as opencode.
"""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses._files import no_arg
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext
from polar_cli.rollout.harnesses.opencode import OpenCode


class KiloCode(OpenCode):
    name = "kilocode"
    binaries = ("kilo",)
    env_prefix = "KILO_"
    config_file = Path(".config") / "kilo" / "kilo.json"

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {
            **super().env(ctx),
            "KILO_TELEMETRY_LEVEL": "off",  # telemetry only at "all"
            "KILO_DISABLE_PRESENCE": "1",
            "KILO_DISABLE_SESSION_INGEST": "1",
            "KILO_DISABLE_CODEBASE_INDEXING": "1",
        }


def make(arg: str | None = None) -> HarnessPreset:
    no_arg(KiloCode.name, arg)
    return KiloCode()
