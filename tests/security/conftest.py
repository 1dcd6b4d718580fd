"""One rollout proxy per attack module (the scripted engine, answering "ok" forever), as `polar rollout` starts it;
its helpers are in tests/support/attacks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_cli.rollout.proxy import start_proxy
from polar_cli.rollout.runtimes.bwrap import find_bwrap
from tests.support.prereq import missing


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    if find_bwrap() is None:
        missing("bwrap is not installed (make sandbox)")
    root = tmp_path_factory.mktemp("attacks-proxy")
    script = root / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "ok"}]}))
    with start_proxy(
        f"scripted:{script}",
        str(root / "store"),
        confdir=root / "conf",
        log_dir=root,
        options={"polar_shard_seconds": "0.2"},
    ) as started:
        yield started
