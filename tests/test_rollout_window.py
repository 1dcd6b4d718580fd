"""The context window an engine spec serves (polar_cli.rollout.window), read the way the engines serve it."""

from __future__ import annotations

import json
from pathlib import Path

from polar_cli.rollout.window import engine_window, model_window
from tests.conftest import free_port


def test_the_window_of_each_engine_spec(tiny_model_dir: Path, tmp_path: Path) -> None:
    native = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    assert model_window(tiny_model_dir) == native
    assert engine_window(f"local:{tiny_model_dir}") == native
    assert engine_window(f"local:{tiny_model_dir}?max_len=3000") == 3000  # as LocalEngine serves it
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": "x"}], "max_len": 2048}))
    assert engine_window(f"scripted:{script}") == 2048
    # A pool: a session may land on either engine, so the smaller window holds.
    assert engine_window(f"local:{tiny_model_dir}?max_len=5000,local:{tiny_model_dir}?max_len=4000") == 4000
    # Unknown: a model without the field, a server that does not answer; the harness keeps its own default.
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    assert engine_window(f"local:{tmp_path / 'bare'}") is None
    assert engine_window(f"vllm:http://127.0.0.1:{free_port()}") is None
