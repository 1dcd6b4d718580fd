"""`polar loop`'s own decisions as plain functions (no rollout, no training): the reward figures it reports and
compares, the state file a resumed loop reads, the policy each iteration samples from, the `polar train` command
it runs, and the backfill rounds of dynamic sampling. The loops themselves run in test_loop.py and
test_loop_backfill.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from polar_addon.store.status import SessionStatus
from polar_cli.rollout.loop import (
    IterationStats,
    LoopConfig,
    _check_same_run,
    _policy,
    backfill_counts,
    backfill_short,
    backfill_tasks,
    engine_kind,
    iteration_dir,
    load_state,
    mean_se,
    rise,
    save_state,
    stats_of,
    tracked_train_args,
    train_command,
)
from polar_cli.rollout.runner import RolloutResult
from polar_cli.rollout.session import SessionResult
from polar_cli.rollout.tasks import Task

S = SessionStatus


def _stats(mean: float | None, se: float | None) -> IterationStats:
    return IterationStats(0, "p", 4, 4, 4, {}, mean, se, 1.0)


def test_mean_se() -> None:
    assert mean_se([]) == (None, None)
    assert mean_se([0.25]) == (0.25, 0.0)
    mean, se = mean_se([0.0, 1.0, 1.0, 1.0])
    assert mean == 0.75
    assert se == pytest.approx(0.5 / 2)  # stdev 0.5 (ddof 1) over sqrt(4)


def test_rise_in_standard_errors_of_the_difference() -> None:
    assert rise(_stats(0.2, 0.03), _stats(0.6, 0.04)) == (pytest.approx(0.4), pytest.approx(0.4 / 0.05))
    assert rise(_stats(0.6, 0.04), _stats(0.2, 0.03)) == (pytest.approx(-0.4), pytest.approx(-8.0))
    assert rise(_stats(0.5, None), _stats(0.75, 0.0)) == (0.25, math.inf)  # no spread: any rise is certain
    assert rise(_stats(0.5, 0.0), _stats(0.25, 0.0)) == (-0.25, 0.0)
    assert rise(_stats(0.5, 0.0), _stats(0.5, 0.0)) == (0.0, 0.0)
    assert rise(_stats(None, None), _stats(0.5, 0.1)) is None
    assert rise(_stats(0.5, 0.1), _stats(None, None)) is None


def test_iteration_dirs_sort_as_numbers(tmp_path: Path) -> None:
    assert iteration_dir(tmp_path, 7) == tmp_path / "iter-007"
    assert iteration_dir(tmp_path, 1234).name == "iter-1234"


def test_the_state_file_round_trips_and_starts_empty(tmp_path: Path) -> None:
    assert load_state(tmp_path) == {"iterations": []}
    state = {"iterations": [{"iteration": 0}], "identity": {"harness": "h"}}
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    # Read by people too (the docs point at it): indented, one key a line.
    assert (tmp_path / "loop.json").read_text() == json.dumps(state, indent=2) + "\n"
    assert not (tmp_path / "loop.json.tmp").exists()  # written aside, then renamed over


def test_a_resumed_loop_must_be_the_same_experiment() -> None:
    _check_same_run({"iterations": []}, {"harness": "a"})  # a first run: nothing to compare
    _check_same_run({"identity": {"harness": "a", "model": "m"}}, {"harness": "a", "model": "m"})
    with pytest.raises(ValueError) as refused:
        _check_same_run({"identity": {"harness": "a", "model": "m"}}, {"harness": "b", "model": "n", "tasks": "t"})
    assert str(refused.value) == (
        "harness, model, tasks differ from the loop already in this directory "
        "(harness='a', model='m', tasks=None): use another --out"
    )


def test_stats_of_a_rollout() -> None:
    sessions = [
        SessionResult("1", "t", "g", 0, S.COMPLETED, reward=1.0),
        SessionResult("2", "t", "g", 1, S.FAILED, reward=0.0),
        SessionResult("3", "t", "g", 2, S.TIMEOUT),
        SessionResult("4", "t", "g", 3, S.ERROR, reward=1.0),
        SessionResult("5", "t", "g", 4, S.COMPLETED, reward=None),
    ]
    stats = stats_of(3, Path("/ckpt"), RolloutResult("r", sessions, 10.0, 25.5, store=None))
    assert (stats.iteration, stats.policy, stats.sessions, stats.usable, stats.rewarded) == (3, "/ckpt", 5, 4, 2)
    assert (stats.reward_mean, stats.reward_se, stats.rollout_s) == (0.5, pytest.approx(0.5), 15.5)
    assert stats.statuses["completed"] == 2 and stats.statuses["error"] == 1


def test_the_train_command(tmp_path: Path) -> None:
    command = train_command([tmp_path / "a", tmp_path / "b"], tmp_path / "p", tmp_path / "o", ["--lr", "1e-6"])
    assert command == [
        sys.executable, "-m", "polar_cli.app", "train", str(tmp_path / "a"), str(tmp_path / "b"), "--model",
        str(tmp_path / "p"), "--output", str(tmp_path / "o"), "--no-progress", "--lr", "1e-6",
    ]  # fmt: skip


def _config(tmp_path: Path, **kw: object) -> LoopConfig:
    tasks = [Task(id="a", instruction="x"), Task(id="b", instruction="y")]
    return LoopConfig(tasks=tasks, harness="cmd:true", model=tmp_path, iterations=2, out=tmp_path, **kw)  # type: ignore[arg-type]


def test_tracked_train_args_name_each_training(tmp_path: Path) -> None:
    assert tracked_train_args(_config(tmp_path, train_args=("--lr", "1")), tmp_path / "iter-002") == ["--lr", "1"]
    named = tracked_train_args(_config(tmp_path, train_args=("--lr", "1"), trackers_run="exp"), tmp_path / "iter-002")
    assert named == ["--lr", "1", "--run-name", "exp-iter-002"]


def test_engine_kind() -> None:
    assert engine_kind("local") == "local" and engine_kind("vllm") == "vllm"
    assert engine_kind("sglang:http://10.0.0.1:30000") == "sglang"
    assert engine_kind("sglang:https://h") == "sglang"
    for bad in ("sglang:/models/x", "vllm:http://127.0.0.1:8000", "scripted:x.json", "nonsense", ""):
        with pytest.raises(ValueError) as refused:
            engine_kind(bad)
        assert str(refused.value) == (
            f"--engine must be local, vllm or sglang:URL (a running SGLang server), not {bad!r}"
        )


def test_the_policy_is_the_newest_trained_checkpoint(tmp_path: Path) -> None:
    start = tmp_path / "start"
    records = [
        {"train": {"status": "trained", "checkpoint": "/c1"}},
        {"train": {"status": "trained", "checkpoint": "/c2"}},
        {"train": {"status": "nothing_to_train"}},
        {"train": None},
    ]
    assert _policy(records, start) == Path("/c2")
    assert _policy(records[2:], start) == start
    assert _policy([], start) == start


def _rollout(rewards: dict[str, list[float]], start: float = 0.0, end: float = 1.0) -> RolloutResult:
    sessions = [
        SessionResult(f"{g}-{k}", g, g, k, S.COMPLETED, reward=r) for g, rs in rewards.items() for k, r in enumerate(rs)
    ]
    return RolloutResult("r", sessions, start, end, store=None)


def test_backfill_goes_on_while_short_and_rounds_are_left(tmp_path: Path) -> None:
    config = _config(tmp_path, min_groups=2, max_backfill=2)
    first = _rollout({"a": [0.0, 1.0], "b": [1.0, 1.0]})  # one informative group of the two wanted
    assert backfill_short(config, first, []) == 1
    one_more = [_rollout({"a+bf1": [1.0, 1.0], "b+bf1": [0.0, 0.0]})]
    assert backfill_short(config, first, one_more) == 1
    assert backfill_short(config, first, one_more * 2) is None  # max_backfill rounds spent
    assert backfill_short(config, first, [_rollout({"b+bf1": [0.0, 1.0]})]) is None  # enough now
    assert backfill_short(_config(tmp_path, min_groups=1, max_backfill=2), first, []) is None
    assert backfill_short(_config(tmp_path, min_groups=2, max_backfill=0), first, []) is None


def test_backfill_tasks_are_new_groups_of_every_task(tmp_path: Path) -> None:
    tasks = backfill_tasks(_config(tmp_path), 3)
    assert [(t.id, t.instruction) for t in tasks] == [("a+bf3", "x"), ("b+bf3", "y")]


def test_backfill_counts() -> None:
    first = _rollout({"a": [0.0, 1.0], "b": [1.0, 1.0], "c": [0.0, 0.0]}, 0.0, 2.0)
    rounds = [_rollout({"a+bf1": [1.0, 1.0], "b+bf1": [0.0, 1.0]}, 3.0, 4.0), _rollout({"c+bf2": [0.5, 1.0]}, 5, 9)]
    result, groups = backfill_counts(4, first, rounds)
    assert groups == {"target": 4, "sampled": 6, "informative": 3, "dropped": 3, "backfilled": 2, "rounds": 2}
    assert len(result.sessions) == 12 and (result.started_at, result.ended_at) == (0.0, 9)
    same, counts = backfill_counts(1, first, [])
    assert same is first
    assert counts == {"target": 1, "sampled": 3, "informative": 1, "dropped": 2, "backfilled": 0, "rounds": 0}


def test_loop_json_is_json(tmp_path: Path) -> None:
    save_state(tmp_path, {"iterations": [], "x": [1.5, None]})
    assert json.loads((tmp_path / "loop.json").read_text()) == {"iterations": [], "x": [1.5, None]}
