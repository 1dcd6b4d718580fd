"""The npm harness presets beyond the first five (opencode, kilocode, cline, continue) drive their real CLIs
through a swe_mini bug fix, as ``test_rollout_presets`` does for the first five.

``polar rollout --runtime bwrap --network proxy-only`` runs each real CLI (``.harness``) on a swe_mini task
against one shared mitmdump whose scripted engine replays that harness's own fix
(``examples/swe_mini/scripts/HARNESS.json``: the tool names and argument shapes of the harness's first captured
request). The harness must exit 0, the runner's verifier must give 1.0, and every call must be stored under the
session, task, group and sample.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_cli.rollout.harnesses.base import SessionContext
from tests.support.prereq import missing
from tests.support.proxy import SharedProxy
from tests.test_rollout_presets import (
    MAX_OUTPUT,
    SWE_MINI,
    WINDOW,
    assert_scripted_calls_stored,
    jsonl_tasks,
    model_name,
    preset_proxy,
    rollout_through,
    script,
)

HARNESSES = ["opencode", "kilocode", "continue-cli", "cline"]


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedProxy]:
    """One mitmdump for all these harnesses."""
    scripts = {model_name(h): script(h) for h in HARNESSES}
    with preset_proxy(tiny_model_dir, tmp_path_factory.mktemp("npm-presets-proxy"), scripts) as started:
        yield started


def context(home: Path, window: int | None, max_output: int | None) -> SessionContext:
    return SessionContext(
        session_id="s",
        task_id="t",
        group_id="g",
        sample=0,
        model="m",
        proxy_url="http://127.0.0.1:1",
        reverse_url="http://127.0.0.1:2",
        ca_path="/ca.pem",
        home=str(home),
        workspace="/workspace",
        secret="psk-test",
        context_window=window,
        max_output_tokens=max_output,
    )


@pytest.mark.parametrize("harness", HARNESSES)
def test_preset_points_at_the_session(harness: str, tmp_path: Path) -> None:
    """Each preset's config names the reverse proxy, the session's key and the model, and puts the served window
    and output cap where its CLI reads them (none for Cline); without a window, none is written."""
    preset = importlib.import_module(f"polar_cli.rollout.harnesses.{harness.replace('-', '_')}").make(None)
    ctx = context(tmp_path, WINDOW, MAX_OUTPUT)
    preset.configure(tmp_path, ctx)
    files = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    written = " ".join(files.values())
    assert "http://127.0.0.1:2/v1" in written and "polar:psk-test" in written
    assert "polar:psk-test" not in " ".join(preset.command("fix it", ctx))  # the key stays out of argv
    if harness in ("opencode", "kilocode"):
        config = json.loads(files[str(preset.config_file)])
        (provider,) = config["provider"].values()
        assert provider["models"]["m"]["limit"] == {"context": WINDOW, "output": MAX_OUTPUT}
        assert config["model"] == config["small_model"] == "polar/m"
        assert preset.env(ctx)[preset.env_prefix + "DISABLE_MODELS_FETCH"] == "1"
    elif harness == "continue-cli":
        (model,) = json.loads(files[".continue/config.yaml"])["models"]
        assert model["defaultCompletionOptions"] == {"contextLength": WINDOW, "maxTokens": MAX_OUTPUT}
    else:
        assert str(WINDOW) not in written  # Cline reads no window for a custom model
    home = tmp_path / "bare"
    home.mkdir()
    preset.configure(home, context(home, None, None))
    bare = " ".join(p.read_text() for p in home.rglob("*") if p.is_file())
    assert str(WINDOW) not in bare and str(MAX_OUTPUT) not in bare


@pytest.mark.harness
@pytest.mark.parametrize("harness", HARNESSES)
def test_polar_rollout_in_bwrap_proxy_only(harness: str, proxy: SharedProxy, tmp_path: Path) -> None:
    """The fix end to end: `polar rollout` on the JSONL task, the harness in a proxy-only bwrap sandbox (it
    reaches the proxy and nothing else), verified by the runner in a fresh sandbox, every call stored under the
    session, group (the task) and sample."""
    if shutil.which("bwrap") is None:
        missing("bubblewrap missing (make sandbox)")
    task_id = script(harness)["task"]
    tasks = tmp_path / "tasks.jsonl"
    task = dict(jsonl_tasks()[task_id], workspace=str(SWE_MINI / jsonl_tasks()[task_id]["workspace"]))
    tasks.write_text(json.dumps(task) + "\n")
    # Seeds distinct from test_rollout_presets': session ids come from the seed and the task.
    seed = 50 + HARNESSES.index(harness)
    session, _ = rollout_through(proxy, tasks, harness, "bwrap", seed, tmp_path / "report")
    assert_scripted_calls_stored(proxy, session, task_id, script(harness)["turns"])
