"""`polar loop`: resumable after an interruption, a training with nothing to learn keeps the policy, per-iteration
stats in loop.json (the real runner, mitmdump and the local engine on the tiny model; `polar train` for real)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "toy_task" / "agent.py"


def _polar_loop(tasks: Path, model: Path, out: Path, iterations: int) -> subprocess.CompletedProcess:
    harness = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}}"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", harness, "--model", str(model),
           "--iterations", str(iterations), "--out", str(out), "--samples", "2", "--no-progress",
           "--lr", "1e-3", "--eot-token-id", "2"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_loop_resumes_and_keeps_the_policy_when_there_is_nothing_to_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    # verify fails every answer: reward 0.0 everywhere, so polar train finds nothing to learn (exit 3). Not 1.0
    # everywhere: the random model sometimes prints tool-call markup, and the build scores that turn 0.0.
    tasks.write_text(json.dumps({"id": "same", "instruction": "say hi", "verify": "false"}) + "\n")
    out = tmp_path / "loop"

    first = _polar_loop(tasks, tiny_model_dir, out, 1)  # "interrupted" after iteration 0's rollout
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    assert [r["iteration"] for r in state["iterations"]] == [0]
    (it0,) = state["iterations"]
    assert it0["train"] is None and it0["statuses"]["completed"] == 2
    assert it0["reward_mean"] == 0.0 and it0["reward_se"] == 0.0 and it0["rewarded"] == 2
    shards0 = sorted(p.name for p in (out / "iter-000" / "shards").rglob("*.parquet"))
    assert shards0

    # A half-done iteration 1 from the interrupted run: the rerun must throw it away, not mix it in.
    stale = out / "iter-001" / "shards" / "stale.parquet"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from an interrupted attempt")

    second = _polar_loop(tasks, tiny_model_dir, out, 2)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    it0, it1 = state["iterations"]
    assert it0["train"]["status"] == "nothing_to_train"
    assert not (out / "iter-000" / "checkpoint").exists()
    assert it1["policy"] == str(tiny_model_dir)  # the policy was kept
    assert it1["iteration"] == 1 and it1["statuses"]["completed"] == 2 and it1["train"] is None
    assert it0["rollout_s"] > 0 and it1["rollout_s"] > 0 and it0["train"]["seconds"] > 0
    assert not stale.exists()
    # iteration 0's shards untouched; iteration 1's sessions are its own (ids it001-...)
    assert sorted(p.name for p in (out / "iter-000" / "shards").rglob("*.parquet")) == shards0
    summary = json.loads((out / "iter-001" / "rollout-summary.json").read_text())
    assert {s["session_id"].split("-")[0] for s in summary["session_results"]} == {"it001"}

    third = _polar_loop(tasks, tiny_model_dir, out, 2)  # already done: nothing re-run
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads((out / "loop.json").read_text())["iterations"] == state["iterations"]


def test_loop_refuses_unknown_train_options_and_another_run_in_the_same_directory(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "x", "verify": "true"}) + "\n")
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", "cmd:true", "--model",
           str(tiny_model_dir), "--iterations", "2", "--out", str(tmp_path / "o"), "--lr-typo", "1"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--lr-typo" in done.stderr
    assert not (tmp_path / "o" / "loop.json").exists()  # refused before any rollout
    from typer.testing import CliRunner

    from polar_cli.app import app

    base = ["loop", str(tasks), "--harness", "cmd:true", "--model", str(tiny_model_dir), "--iterations", "2",
            "--out", str(tmp_path / "o"), "--ray", "127.0.0.1:1"]  # fmt: skip
    for extra, said in ((["--async"], "--async runs locally"), (["--engine", "vllm"], "--ray needs --engine local")):
        refused = CliRunner().invoke(app, [*base, *extra])
        assert refused.exit_code == 2 and said in " ".join(refused.output.replace("│", " ").split()), refused.output
    assert not (tmp_path / "o" / "loop.json").exists()

    import pytest

    from polar_cli.rollout.loop import _check_same_run

    with pytest.raises(ValueError, match="harness"):
        _check_same_run({"identity": {"harness": "a", "tasks": "h"}}, {"harness": "b", "tasks": "h"})
    _check_same_run({"identity": {"harness": "a"}}, {"harness": "a"})
