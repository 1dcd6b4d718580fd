"""The toy loop learns on CPU: rollouts -> polar train -> reload -> rollouts (examples/toy_task)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_toy_loop_reward_rises_far_outside_the_noise(tiny_model_dir: Path, tmp_path: Path) -> None:
    loop = [sys.executable, str(REPO / "examples" / "toy_task" / "loop.py"), "--model", str(tiny_model_dir),
            "--out", str(tmp_path / "run"), "--iterations", "4"]  # fmt: skip
    done = subprocess.run(loop, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    means = [float(m) for m in re.findall(r"^iteration \d+: reward ([0-9.]+)", done.stdout, re.M)]
    assert len(means) == 4 and means[-1] > means[0] + 0.05
    z = float(re.search(r"([0-9.]+) standard errors", done.stdout).group(1))
    assert z >= 5.0
    assert (tmp_path / "run" / "iter-0" / "checkpoint" / "training_curves.png").is_file()
