"""Running the real harness CLIs (installed by ``make harnesses`` into ``.harness``) in tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.proxy import REPO, register_session
from tests.support.shards import session_records

BIN = REPO / ".harness" / "node_modules" / ".bin"


def harness(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{path} missing: run `make harnesses`")
    return path


def run(cmd: list[str], env: dict[str, str], home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a harness with its own HOME and no proxy settings inherited from the test's environment."""
    home.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    full = {**base, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **env}
    return subprocess.run(
        cmd, env=full, cwd=home, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def calls(out: Path, session: str, include_failed: bool = False) -> list:
    return session_records(out, session, include_failed=include_failed)


def configured_session(preset, proxy, home: Path, session: str, window: int, settings: tuple[str, dict] | None = None):
    """The SessionContext a rollout would give ``preset`` behind ``proxy``, with its harness config written into
    HOME; ``settings`` = (a file under HOME, keys merged into what the preset wrote there), e.g. to trim a prompt."""
    import orjson

    from polar_cli.rollout.harnesses.base import SessionContext

    ctx = SessionContext(
        session_id=session,
        task_id="t",
        group_id="g",
        sample=0,
        model="tiny",
        proxy_url=proxy.url,
        reverse_url=proxy.url,
        ca_path=str(proxy.ca),
        home=str(home),
        workspace=str(home),
        secret=register_session(proxy.port, proxy.control_token, session),
        context_window=window,
    )
    preset.configure(home, ctx)
    if settings is not None:
        file = home / settings[0]
        merged = orjson.loads(file.read_bytes()) if file.exists() else {}
        file.parent.mkdir(parents=True, exist_ok=True)
        for key, value in settings[1].items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
        file.write_bytes(orjson.dumps(merged))
    return ctx
