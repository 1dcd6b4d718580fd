"""Dynamic sampling with backfill (``polar loop --min-groups N --max-backfill R``): an iteration short of N
informative groups rolls every task again as new groups into the same shards, and the training sees them all.

The real loop (the toy agent through a real mitmdump on the tiny model, bwrap), with verifiers whose rewards are
chosen so the counts are certain: continuous random rewards (every group of 2 is informative) or a constant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_addon.store.reader import read_table
from polar_cli.rollout.loop import informative_groups, merged
from polar_cli.rollout.runner import RolloutResult
from polar_cli.rollout.session import SessionResult

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "toy_task" / "agent.py"


def _result(rewards: dict[str, list[float | None]], started: float = 0.0, ended: float = 1.0) -> RolloutResult:
    sessions = [
        SessionResult(
            session_id=f"{g}-{k}", task_id=g, group_id=g, sample=k, status="completed" if r is not None else "error",
            reward=r,
        )
        for g, rs in rewards.items()
        for k, r in enumerate(rs)
    ]  # fmt: skip
    return RolloutResult(run_id="r", sessions=sessions, started_at=started, ended_at=ended, store=None)


def test_a_group_informs_only_with_two_rewarded_sessions_that_differ() -> None:
    result = _result({"a": [0.0, 1.0], "b": [1.0, 1.0], "c": [0.5, None], "d": [0.2, 0.2, 0.3], "e": [0.7]})
    assert informative_groups(result) == ["a", "d"]
    both = merged(result, [_result({"a+bf1": [0.0, 0.5]}, 2.0, 5.0)])
    assert informative_groups(both) == ["a", "a+bf1", "d"] and (both.started_at, both.ended_at) == (0.0, 5.0)
    assert merged(result, []) is result


def _loop(tmp_path: Path, model: Path, out: Path, reward: str, *extra: str) -> dict:
    tasks = tmp_path / f"tasks-{out.name}.jsonl"
    lines = [
        {"id": f"shout-{k}", "instruction": "what is the capital of france", "reward_file": "reward.txt",
         "verify": f"python3 -c '{reward}' > reward.txt"}
        for k in range(2)
    ]  # fmt: skip
    tasks.write_text("".join(json.dumps(t) + "\n" for t in lines))
    harness = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}}"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", harness, "--model", str(model),
           "--out", str(out), "--samples", "2", "--concurrency", "8", "--no-progress", "--lr", "1e-3",
           "--eot-token-id", "2", *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "loop.json").read_text())


@pytest.mark.slow
def test_backfill_rolls_new_groups_until_enough_inform_and_the_training_sees_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "random"
    state = _loop(
        tmp_path, tiny_model_dir, out, "import random; print(random.random())", "--iterations", "2",
        "--min-groups", "3", "--max-backfill", "3",
    )  # fmt: skip
    first = state["iterations"][0]
    # 2 tasks x 2 samples of distinct random rewards: 2 informative groups, so one round of 2 more is enough
    assert first["groups"] == {"target": 3, "sampled": 4, "informative": 4, "dropped": 0, "backfilled": 2, "rounds": 1}
    assert first["sessions"] == 8 and first["rewarded"] == 8
    # every session's one call, the backfilled ones too; the toy agent is offered no tools
    assert first["calls"] == {"answered_calls": 8, "tool_call_calls": 0}
    idir = out / "iter-000"
    assert (idir / "rollout-summary.json").is_file() and (idir / "rollout-summary-bf1.json").is_file()
    groups = set(read_table(str(idir / "shards"), columns=["group_id"]).column("group_id").to_pylist())
    assert groups == {"shout-0", "shout-1", "shout-0+bf1", "shout-1+bf1"}
    assert first["train"]["status"] == "trained"
    log = (idir / "train.log").read_text()
    assert "4 groups" in log or "groups=4" in log or "'groups': 4" in log, log[-2000:]


@pytest.mark.slow
def test_backfill_stops_after_its_rounds_when_no_group_can_inform(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = _loop(
        tmp_path, tiny_model_dir, tmp_path / "constant", "print(1.0)", "--iterations", "1", "--min-groups", "1",
        "--max-backfill", "2",
    )  # fmt: skip
    (only,) = state["iterations"]
    assert only["groups"] == {"target": 1, "sampled": 6, "informative": 0, "dropped": 6, "backfilled": 0, "rounds": 2}
    assert only["sessions"] == 12 and only["reward_mean"] == 1.0
    assert only["calls"] == {"answered_calls": 12, "tool_call_calls": 0}


@pytest.mark.slow
def test_the_async_loop_backfills_each_batch_before_the_trainer_takes_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "async"
    state = _loop(
        tmp_path, tiny_model_dir, out, "print(1.0)", "--async", "--iterations", "2", "--min-groups", "1",
        "--max-backfill", "1",
    )  # fmt: skip
    batches = state["batches"]
    assert len(batches) >= 2
    for batch in batches:
        # constant rewards: no group informs, so every batch spends its one round (2 tasks x 2 samples each)
        assert batch["groups"] == {"target": 1, "sampled": 4, "informative": 0, "dropped": 4, "backfilled": 0,
                                   "rounds": 1}, batch  # fmt: skip
        assert batch["sessions"] == 8 and batch["reward_mean"] == 1.0
        bdir = Path(batch["shards"]).parent
        assert (bdir / "rollout-summary.json").is_file() and (bdir / "rollout-summary-bf1.json").is_file()
        groups = set(read_table(batch["shards"], columns=["group_id"]).column("group_id").to_pylist())
        assert groups == {"shout-0", "shout-1", "shout-0+bf1", "shout-1+bf1"}
