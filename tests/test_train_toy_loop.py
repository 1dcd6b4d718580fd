"""The toy loop learns on CPU through `polar loop` (the real runner, the `cmd:` preset running examples/toy_task's
openai-SDK agent, its verifier, `polar train`, the local engine reloaded on each checkpoint).

Trained as `make demo` trains: lr 5e-3 with the clip against the weights each training started from (the default
`--clip-against start`; ratio bound 2: `--epsilon-high 1.0`). Clipping only against each step's own weights let the
policy run away within one training: on this machine 2 of the last 10 such runs collapsed in a late round
(0.220 -> 0.073: entropy 3.7 -> 7.3 in one optimizer step); 5 of 5 with the start clip rose every round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_cli.rollout.loop import IterationStats, rise

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "examples" / "toy_task"


@pytest.mark.slow
def test_toy_loop_reward_rises_far_outside_the_noise(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(TOY / "tasks.jsonl"),
           "--harness", f"cmd:{sys.executable} {TOY / 'agent.py'} {{instruction}}", "--model", str(tiny_model_dir),
           "--iterations", "5", "--out", str(out), "--samples", "8", "--concurrency", "8", "--no-progress",
           "--lr", "5e-3", "--epochs", "2", "--groups-per-step", "1", "--weight-decay", "0", "--eot-token-id", "2",
           "--epsilon-high", "1.0"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stats = [IterationStats(**r) for r in json.loads((out / "loop.json").read_text())["iterations"]]
    assert len(stats) == 5 and all(s.rewarded == 32 for s in stats)
    assert all(s.train and s.train["status"] == "trained" for s in stats[:4])
    diff, z = rise(stats[0], stats[-1])
    assert diff > 0.05 and z >= 5.0, [(s.reward_mean, s.reward_se) for s in stats]
    assert (out / "iter-000" / "checkpoint" / "training_curves.png").is_file()
