"""`--report-to`: `polar train` hands the trackers to TRL, `polar loop` logs one point per iteration to them; each
test reads the written files back (TensorBoard event files, a wandb offline run, trackio's local database)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from polar_cli.trackers import (
    LoopTracker,
    TrackerError,
    check_installed,
    loop_points,
    parse_report_to,
    pooled,
    tracker_env,
)
from tests.support.tracker_files import tensorboard_scalars, trackio_logs, wandb_history

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "toy_task" / "agent.py"
# Rewards depend on the sample index only (as tests/test_loop_eval.py): the group always has something to learn.
HARNESS = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}} && echo {{sample}} > sample.txt"


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    return {**env, "TRL_EXPERIMENTAL_SILENCE": "1", "WANDB_MODE": "offline", "HOME": str(tmp / "home")}


def test_report_to_is_parsed_as_trl_takes_it() -> None:
    assert parse_report_to([]) == [] and parse_report_to(["none"]) == []
    assert parse_report_to(["tensorboard,wandb", "trackio", "wandb"]) == ["tensorboard", "wandb", "trackio"]
    with pytest.raises(TrackerError, match="unknown tracker comet"):
        parse_report_to(["comet"])
    with pytest.raises(TrackerError, match="cannot be combined"):
        parse_report_to(["none,wandb"])
    check_installed(["wandb"], {"WANDB_MODE": "offline"})
    check_installed(["wandb"], {"WANDB_API_KEY": "k", "HOME": "/nonexistent"})
    with pytest.raises(TrackerError, match="WANDB_MODE=offline"):
        check_installed(["wandb"], {"HOME": "/nonexistent"})
    env = tracker_env(["tensorboard", "trackio"], Path("/d"), "r", "p")
    assert env["TENSORBOARD_LOGGING_DIR"] == "/d/r" and "WANDB_DIR" not in env


def test_a_missing_tracker_package_is_refused_with_its_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import polar_cli.trackers as trackers

    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", ("polar_no_such_module", "tensorboard==2.21.0"))
    with pytest.raises(TrackerError, match=r"pip install -c constraints.txt tensorboard==2\.21\.0"):
        check_installed(["trackio", "tensorboard"])
    check_installed(["trackio"])


def test_loop_points_of_both_loops() -> None:
    state = {
        "iterations": [
            {"iteration": 0, "reward_mean": 0.25, "reward_se": 0.1, "rewarded": 4, "rollout_s": 3.0,
             "train": {"status": "trained", "seconds": 1.0}, "push_s": None},
            {"iteration": 1, "reward_mean": 0.5, "reward_se": 0.2, "rewarded": 4, "rollout_s": 2.0, "push_s": 1.0},
        ],
        "evals": [{"iteration": 1, "pass@1": 0.75, "pass@1_se": 0.05, "seconds": 1.0}],
    }  # fmt: skip
    p0, p1 = loop_points(state, 3)
    assert p0.complete and not p1.complete  # iteration 1 of 3 still trains
    assert p0.metrics["loop/rollout_busy"] == 0.75 and p0.metrics["loop/trainer_busy"] == 0.25
    assert p1.metrics["loop/heldout_pass@1"] == 0.75 and p1.metrics["loop/push_s"] == 1.0
    assert p1.metrics["loop/rollout_busy"] == 0.5 and "loop/train_s" not in p1.metrics

    class Memory:
        def __init__(self) -> None:
            self.points: list[tuple[int, dict]] = []

        def log(self, metrics, step):
            self.points.append((step, dict(metrics)))

        def close(self) -> None:
            self.points.append((-1, {}))

    memory = Memory()
    tracker = LoopTracker([memory], {"iterations": []}, 3)
    tracker.update(state)
    tracker.update(state)
    assert [s for s, _ in memory.points] == [0]  # once each, and only when complete
    tracker.close(state)
    assert [s for s, _ in memory.points] == [0, 1, -1]
    resumed = Memory()
    LoopTracker([resumed], state, 3).update(state)  # a resume: what the earlier run logged is not logged again
    assert resumed.points == []

    asynchronous = {
        "mode": "async",
        "batches": [
            {"index": 0, "version": 0, "reward_mean": 0.0, "reward_se": 0.0, "rewarded": 2},
            {"index": 1, "version": 0, "reward_mean": 1.0, "reward_se": 0.0, "rewarded": 2},
            {"index": 2, "version": 1, "reward_mean": 0.5, "reward_se": 0.1, "rewarded": 2, "final": True},
        ],
        "steps": [{"step": 0, "version": 0, "batches": [0], "groups_dropped": 0, "started_at": 1.0, "ended_at": 3.0,
                   "status": "trained", "rollout_util": 0.9, "trainer_util": 0.4}],
        "pushes": [{"version": 1, "drain_s": 2.5, "reload_s": 1.5}],
    }  # fmt: skip
    step, last = loop_points(asynchronous, 2)
    assert step.complete and step.metrics["loop/push_s"] == 2.5 and step.metrics["loop/staleness"] == 0.0
    assert step.metrics["loop/train_s"] == 2.0 and step.metrics["loop/rollout_busy"] == 0.9
    assert (last.step, last.metrics["loop/reward_mean"]) == (1, 0.5)
    assert pooled([(0.0, 0.0, 2), (1.0, 0.2, 2)]) == (0.5, pytest.approx(0.1), 4)


def test_train_refuses_an_unknown_tracker_before_training(tiny_model_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "polar_cli.app", "train", str(tmp_path), "--model", str(tiny_model_dir), "--output",
           str(tmp_path / "o"), "--report-to", "tensorboard,comet"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown tracker comet" in " ".join(done.stderr.split()), done.stderr


def test_loop_and_its_trainings_log_to_tensorboard_wandb_and_trackio(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One real loop (2 iterations: a rollout, a `polar train`, a rollout; --eval on the base and the trained policy)
    logging to all three trackers: its points, one per iteration, and the training's own TRL metrics."""
    tasks = tmp_path / "train.jsonl"
    heldout = tmp_path / "heldout.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "say hi", "verify": 'test "$(cat sample.txt)" = 0'}) + "\n")
    heldout.write_text(json.dumps({"id": "h", "instruction": "say yes", "verify": "true"}) + "\n")
    out = tmp_path / "loop"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", HARNESS, "--model",
           str(tiny_model_dir), "--iterations", "2", "--out", str(out), "--samples", "2", "--no-progress",
           "--eval", str(heldout), "--eval-samples", "1", "--report-to", "tensorboard,trackio", "--report-to", "wandb",
           "--run-name", "toy", "--lr", "1e-3", "--eot-token-id", "2", "--max-steps", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    rewards = {i: r["reward_mean"] for i, r in enumerate(state["iterations"])}
    trained = state["iterations"][0]["train"]
    assert trained["status"] == "trained"
    logged = [r for r in map(orjson.loads, (Path(trained["checkpoint"]) / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]  # fmt: skip
    losses = [r["loss"] for r in logged]
    assert len(losses) == 2
    runs = out / "runs"

    scalars = tensorboard_scalars(runs / "toy")
    assert scalars["loop/reward_mean"] == pytest.approx(rewards)
    assert scalars["loop/heldout_pass@1"] == {0: 1.0, 1: 1.0}
    assert set(scalars["loop/rollout_busy"]) == {0, 1} and 0 < scalars["loop/trainer_busy"][0] < 1
    assert scalars["loop/train_s"] == {0: pytest.approx(trained["seconds"])}
    train = tensorboard_scalars(runs / "toy-iter-000")  # the training's own run, through TRL
    assert train["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in logged}, rel=1e-6)
    assert train["train/reward"] == pytest.approx({r["step"]: r["reward"] for r in logged}, rel=1e-6)

    histories = [wandb_history(d) for d in sorted((runs / "wandb").glob("offline-run-*"))]
    (loop_run,) = [h for h in histories if "loop/reward_mean" in h]
    (train_run,) = [h for h in histories if "train/loss" in h]
    assert loop_run["loop/reward_mean"] == pytest.approx(rewards)
    assert loop_run["loop/heldout_pass@1"] == {0: 1.0, 1: 1.0}
    assert [train_run["train/loss"][k] for k in sorted(train_run["train/loss"])] == pytest.approx(losses)

    points = [r for r in trackio_logs(runs / "trackio", "polar", "toy") if "loop/reward_mean" in r]
    assert {r["step"]: r["loop/reward_mean"] for r in points} == pytest.approx(rewards) and len(points) == 2
    rows = [r for r in trackio_logs(runs / "trackio", "polar", "toy-iter-000") if "train/loss" in r]
    assert [r["train/loss"] for r in rows] == pytest.approx(losses)


def test_async_loop_logs_one_point_per_step_and_the_measuring_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "train.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "say hi", "verify": 'test "$(cat sample.txt)" = 0'}) + "\n")
    out = tmp_path / "loop"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", HARNESS, "--model",
           str(tiny_model_dir), "--iterations", "2", "--out", str(out), "--samples", "2", "--no-progress", "--async",
           "--report-to", "tensorboard", "--run-name", "toy", "--lr", "1e-3", "--eot-token-id", "2",
           "--max-steps", "1"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    (step,), (push,) = state["steps"], state["pushes"]
    assert step["status"] == "trained" and push["version"] == 1
    final = next(b for b in state["batches"] if b["final"])
    trained = next(b for b in state["batches"] if b["index"] == step["batches"][0])
    scalars = tensorboard_scalars(out / "runs" / "toy")
    assert scalars["loop/reward_mean"] == pytest.approx({0: trained["reward_mean"], 1: final["reward_mean"]})
    assert scalars["loop/staleness"] == {0: 0.0}
    assert scalars["loop/push_s"] == {0: pytest.approx(push["drain_s"])}
    assert scalars["loop/rollout_busy"] == {0: pytest.approx(step["rollout_util"])}
    assert scalars["loop/trainer_busy"] == {0: pytest.approx(step["trainer_util"])}
    assert "train/loss" in tensorboard_scalars(out / "runs" / "toy-train-000")
