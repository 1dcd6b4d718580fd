"""The metrics `polar loop` sends to trackers (trackers.py), exactly: each loop point's figures and when it counts as
complete, the pooled reward of an async step, what is logged once and in order; the refusals of --report-to and
their messages; the places each tracker writes to; the writers, on fake tracker packages."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from polar_cli import trackers
from polar_cli.trackers import (
    LoopPoint,
    LoopTracker,
    TrackerError,
    check_installed,
    loop_points,
    open_writers,
    parse_report_to,
    pooled,
    tracker_env,
)

# -- --report-to ------------------------------------------------------------------------------------------------------


def test_report_to_refusals_name_what_was_given() -> None:
    with pytest.raises(TrackerError) as raised:
        parse_report_to(["wandb,none", "tensorboard"])
    assert str(raised.value) == "--report-to none cannot be combined with wandb, tensorboard"
    with pytest.raises(TrackerError) as raised:
        parse_report_to(["comet, WandB", "mlflow"])
    assert str(raised.value) == (
        "--report-to: unknown tracker comet, mlflow (one of none, tensorboard, wandb, trackio)"
    )  # fmt: skip
    assert parse_report_to([" NONE ", ","]) == []


def home_with_netrc(tmp_path: Path, host: str) -> Path:
    home = tmp_path / host
    home.mkdir()
    (home / ".netrc").write_text(f"machine {host} login user password secret\n")
    (home / ".netrc").chmod(0o600)
    return home


WANDB_ONLINE = (
    "--report-to wandb logs online and no wandb credentials are set: set WANDB_MODE=offline (the run is written "
    "locally; `wandb sync` uploads it later), or WANDB_API_KEY (or `wandb login`)"
)


@pytest.mark.parametrize("mode", ["offline", "disabled", "dryrun"])
def test_wandb_modes_that_log_nothing_online_need_no_credentials(mode: str) -> None:
    check_installed(["wandb"], {"WANDB_MODE": mode, "HOME": "/nonexistent"})


@pytest.mark.parametrize("mode", [None, "online", "OFFLINE"])
def test_wandb_online_without_credentials_is_refused(mode: str | None, tmp_path: Path) -> None:
    environ = {"HOME": str(home_with_netrc(tmp_path, "api.example.com"))}  # a netrc, for another host
    if mode is not None:
        environ["WANDB_MODE"] = mode
    with pytest.raises(TrackerError) as raised:
        check_installed(["wandb"], environ)
    assert str(raised.value) == WANDB_ONLINE
    check_installed(["tensorboard"], environ)  # only wandb logs online


def test_wandb_credentials_in_the_given_homes_netrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = home_with_netrc(tmp_path, "api.wandb.ai")
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    check_installed(["wandb"], {"HOME": str(home)})
    # No HOME given: the process's own home (``~``).
    monkeypatch.setenv("HOME", str(home))
    check_installed(["wandb"], {})
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(TrackerError, match="no wandb credentials"):
        check_installed(["wandb"], {})


def test_the_process_environment_is_read_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_installed(["wandb"])
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")
    with pytest.raises(TrackerError, match="no wandb credentials"):
        check_installed(["wandb"])


def test_netrc_lookup(tmp_path: Path) -> None:
    assert trackers._netrc_has(home_with_netrc(tmp_path, "api.wandb.ai"))
    other = home_with_netrc(tmp_path, "api.example.com")
    assert not trackers._netrc_has(other)
    assert trackers._netrc_has(other, "api.example.com")
    assert not trackers._netrc_has(tmp_path / "no-home")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".netrc").write_text("machine\n")
    assert not trackers._netrc_has(broken)


def test_every_missing_package_is_named_with_its_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", ("polar_no_such_module_a", "tensorboard==2.21.0"))
    monkeypatch.setitem(trackers.TRACKERS, "trackio", ("polar_no_such_module_b", "trackio==0.43.0"))
    with pytest.raises(TrackerError) as raised:
        check_installed(["tensorboard", "trackio"])
    assert str(raised.value) == (
        "--report-to needs tensorboard==2.21.0 trackio==0.43.0: pip install -c constraints.txt tensorboard==2.21.0 "
        "trackio==0.43.0 (or the pip extra: pip install -e '.[trackers]')"
    )


# -- where each tracker writes ----------------------------------------------------------------------------------------


def test_tracker_env_places_each_tracker_under_the_logging_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_DIR", "WANDB_PROJECT", "TRACKIO_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert tracker_env(["tensorboard", "wandb", "trackio"], Path("/logs"), "run-1", "proj") == {
        "TENSORBOARD_LOGGING_DIR": "/logs/run-1",
        "WANDB_DIR": "/logs",
        "WANDB_PROJECT": "proj",
        "TRACKIO_DIR": "/logs/trackio",
    }
    assert tracker_env(["wandb"], Path("/logs"), "run-1", "proj") == {"WANDB_DIR": "/logs", "WANDB_PROJECT": "proj"}
    assert tracker_env(["trackio"], Path("/logs"), "r", "p") == {"TRACKIO_DIR": "/logs/trackio"}
    assert tracker_env([], Path("/logs"), "r", "p") == {}


def test_tracker_env_keeps_the_users_own_places(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_DIR", "/mine/wandb")
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    monkeypatch.setenv("TRACKIO_DIR", "/mine/trackio")
    assert tracker_env(["wandb", "trackio"], Path("/logs"), "r", "p") == {
        "WANDB_DIR": "/mine/wandb",
        "WANDB_PROJECT": "my-project",
        "TRACKIO_DIR": "/mine/trackio",
    }


# -- the writers, on fake packages ------------------------------------------------------------------------------------


class FakeRun:
    def __init__(self, calls: list[Any], kind: str) -> None:
        self.calls, self.kind = calls, kind

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((self.kind, "log", metrics, step))

    def finish(self) -> None:
        self.calls.append((self.kind, "finish"))


@pytest.fixture
def fake_trackers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            calls.append(("tensorboard", "init", log_dir))

        def add_scalar(self, name: str, value: float, step: int) -> None:
            calls.append(("tensorboard", "scalar", name, value, step))

        def flush(self) -> None:
            calls.append(("tensorboard", "flush"))

        def close(self) -> None:
            calls.append(("tensorboard", "close"))

    tensorboard = ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    wandb = ModuleType("wandb")

    def wandb_init(**kwargs: Any) -> FakeRun:
        calls.append(("wandb", "init", kwargs, Path(kwargs["dir"]).is_dir()))
        return FakeRun(calls, "wandb")

    wandb.init = wandb_init  # type: ignore[attr-defined]
    trackio = ModuleType("trackio")

    def trackio_init(**kwargs: Any) -> FakeRun:
        calls.append(("trackio", "init", kwargs, os.environ.get("TRACKIO_DIR")))
        return FakeRun(calls, "trackio")

    trackio.init = trackio_init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    # Removed now, and again after the test: open_writers sets TRACKIO_DIR in this process for trackio's import.
    for name in ("WANDB_DIR", "WANDB_PROJECT", "TRACKIO_DIR"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_open_writers_opens_one_writer_per_tracker_and_logs_through_each(
    tmp_path: Path, fake_trackers: list[Any]
) -> None:
    logs = tmp_path / "runs" / "logs"  # two levels that do not exist yet
    writers = open_writers(["tensorboard", "wandb", "trackio"], logs, "run-1", "proj", {"lr": 1e-6})
    assert [type(w).__name__ for w in writers] == ["TensorBoardWriter", "WandbWriter", "TrackioWriter"]
    assert os.environ["TRACKIO_DIR"] == str(logs / "trackio")
    assert fake_trackers == [
        ("tensorboard", "init", str(logs / "run-1")),
        ("wandb", "init", {"project": "proj", "name": "run-1", "dir": str(logs), "config": {"lr": 1e-6},
                           "reinit": "create_new"}, True),
        ("trackio", "init", {"project": "proj", "name": "run-1", "config": {"lr": 1e-6}, "embed": False},
         str(logs / "trackio")),
    ]  # fmt: skip
    fake_trackers.clear()
    for writer in writers:
        writer.log({"loop/reward_mean": 0.5, "loop/rewarded": 4.0}, 3)
    for writer in writers:
        writer.close()
    metrics = {"loop/reward_mean": 0.5, "loop/rewarded": 4.0}
    assert fake_trackers == [
        ("tensorboard", "scalar", "loop/reward_mean", 0.5, 3),
        ("tensorboard", "scalar", "loop/rewarded", 4.0, 3),
        ("tensorboard", "flush"),  # each point on disk at once: a live view and a killed loop see it
        ("wandb", "log", metrics, 3),
        ("trackio", "log", metrics, 3),
        ("tensorboard", "close"),
        ("wandb", "finish"),
        ("trackio", "finish"),
    ]


def test_open_writers_opens_only_the_named_ones(tmp_path: Path, fake_trackers: list[Any]) -> None:
    assert [type(w).__name__ for w in open_writers(["wandb"], tmp_path, "r", "p", {})] == ["WandbWriter"]
    assert "TRACKIO_DIR" not in os.environ
    assert open_writers([], tmp_path, "r", "p", {}) == []


# -- the synchronous loop's points ------------------------------------------------------------------------------------


def test_sync_points_carry_every_figure_of_their_iteration() -> None:
    state = {
        "iterations": [
            {"iteration": 0, "reward_mean": 0.25, "reward_se": 0.1, "rewarded": 4, "rollout_s": 3.0,
             "train": {"status": "trained", "seconds": 1.0}, "push_s": 0.5},
            {"iteration": 1, "reward_mean": None, "reward_se": float("nan"), "rewarded": 0, "rollout_s": 2.0},
        ],
        "evals": [{"iteration": 0, "pass@1": 0.75, "pass@1_se": 0.05, "seconds": 0.5}],
    }  # fmt: skip
    p0, p1 = loop_points(state, 2)
    assert p0 == LoopPoint(
        0,
        {"loop/reward_mean": 0.25, "loop/reward_se": 0.1, "loop/rewarded": 4.0, "loop/rollout_s": 3.0,
         "loop/train_s": 1.0, "loop/push_s": 0.5, "loop/heldout_pass@1": 0.75, "loop/heldout_pass@1_se": 0.05,
         "loop/eval_s": 0.5, "loop/rollout_busy": 0.6, "loop/trainer_busy": 0.2, "loop/staleness": 0.0},
        complete=True,
    )  # fmt: skip
    # Nothing rewarded: no mean and no SE (not NaN); the last iteration is complete without a training.
    assert p1 == LoopPoint(
        1,
        {"loop/rewarded": 0.0, "loop/rollout_s": 2.0, "loop/rollout_busy": 1.0, "loop/trainer_busy": 0.0,
         "loop/staleness": 0.0},
        complete=True,
    )  # fmt: skip
    assert all(type(v) is float for v in p0.metrics.values())


@pytest.mark.parametrize(("iterations", "complete"), [(2, True), (3, False), (1, True)])
def test_an_untrained_iteration_is_complete_only_as_the_last(iterations: int, complete: bool) -> None:
    state = {"iterations": [{"iteration": 1, "reward_mean": 0.0, "reward_se": 0.0, "rewarded": 1, "rollout_s": 1.0}]}
    (point,) = loop_points(state, iterations)
    assert point.complete is complete


@pytest.mark.parametrize(("rollout_s", "busy"), [(0.0, None), (0.5, 1.0)])
def test_busy_fractions_only_when_the_iteration_took_time(rollout_s: float, busy: float | None) -> None:
    state = {
        "iterations": [{"iteration": 0, "reward_mean": 0.0, "reward_se": 0.0, "rewarded": 1, "rollout_s": rollout_s}]
    }
    (point,) = loop_points(state, 1)
    assert point.metrics.get("loop/rollout_busy") == busy


def test_an_empty_state_has_no_points() -> None:
    assert loop_points({}, 3) == [] and loop_points({"mode": "async"}, 3) == []


# -- the async loop's points ------------------------------------------------------------------------------------------


def async_state(**overrides: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "mode": "async",
        "batches": [
            {"index": 0, "version": 1, "reward_mean": 0.0, "reward_se": 0.0, "rewarded": 2},
            {"index": 1, "version": 2, "reward_mean": 1.0, "reward_se": 0.2, "rewarded": 2},
            {"index": 2, "version": 3, "reward_mean": 0.5, "reward_se": 0.1, "rewarded": 4, "final": True},
        ],
        "steps": [
            {"step": 0, "version": 3, "batches": [0, 1, 9], "groups_dropped": 1, "started_at": 1.0, "ended_at": 3.5,
             "status": "trained", "rollout_util": 0.9, "trainer_util": 0.4},
            {"step": 1, "version": 4, "batches": [], "groups_dropped": 2, "started_at": 4.0, "ended_at": 4.0,
             "status": "skipped", "rollout_util": 0.5, "trainer_util": 0.0},
        ],
        "pushes": [{"version": 4, "drain_s": 2.5, "reload_s": 1.5}, {"version": 5, "drain_s": 9.0, "reload_s": 9.0}],
    }  # fmt: skip
    state.update(overrides)
    return state


def test_async_points_carry_each_steps_figures_and_the_measuring_batch() -> None:
    step, skipped, final = loop_points(async_state(), 3)
    assert step == LoopPoint(
        0,
        {"loop/reward_mean": 0.5, "loop/reward_se": pytest.approx(0.1), "loop/rewarded": 4.0,
         "loop/staleness": 2.0, "loop/groups_dropped": 1.0, "loop/train_s": 2.5, "loop/rollout_busy": 0.9,
         "loop/trainer_busy": 0.4, "loop/push_s": 2.5, "loop/reload_s": 1.5},
        complete=True,
    )  # fmt: skip
    # A step that trained nothing: no reward, no staleness, and no push (the next version's push is not its own).
    assert skipped == LoopPoint(
        1,
        {"loop/rewarded": 0.0, "loop/groups_dropped": 2.0, "loop/train_s": 0.0, "loop/rollout_busy": 0.5,
         "loop/trainer_busy": 0.0},
        complete=True,
    )  # fmt: skip
    assert final == LoopPoint(2, {"loop/reward_mean": 0.5, "loop/reward_se": 0.1, "loop/rewarded": 4.0})
    assert all(type(v) is float for p in (step, skipped, final) for v in p.metrics.values())


def test_a_trained_step_waits_for_its_push() -> None:
    (step,) = loop_points(async_state(steps=async_state()["steps"][:1], pushes=[], batches=[]), 9)
    assert not step.complete and "loop/push_s" not in step.metrics and "loop/staleness" not in step.metrics


@pytest.mark.parametrize(("iterations", "with_final"), [(3, True), (2, True), (4, False)])
def test_the_measuring_batch_is_a_point_once_the_steps_are_done(iterations: int, with_final: bool) -> None:
    points = loop_points(async_state(), iterations)
    assert len(points) == (3 if with_final else 2)
    no_final = [{k: v for k, v in b.items() if k != "final"} for b in async_state()["batches"]]
    assert len(loop_points(async_state(batches=no_final), 1)) == 2


def test_the_measuring_batch_without_rewards_has_no_mean() -> None:
    batches = [{"index": 0, "version": 0, "reward_mean": None, "reward_se": None, "rewarded": 0, "final": True}]
    (point,) = loop_points({"mode": "async", "batches": batches}, 1)
    assert point == LoopPoint(0, {"loop/rewarded": 0.0})


def test_pooled_weights_by_rewards_and_skips_batches_without() -> None:
    assert pooled([]) == (None, None, 0)
    assert pooled([(None, None, 3), (0.5, 0.1, 0)]) == (None, None, 0)
    assert pooled([(1.0, None, 1), (0.0, 0.3, 3), (None, 0.5, 2)]) == (0.25, pytest.approx(0.225), 4)


# -- what is logged ---------------------------------------------------------------------------------------------------


class Memory:
    def __init__(self) -> None:
        self.points: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.points.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed += 1


def iteration(i: int, trained: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"iteration": i, "reward_mean": 0.5, "reward_se": 0.1, "rewarded": 2, "rollout_s": 1.0}
    if trained:
        row["train"] = {"status": "trained", "seconds": 1.0}
    return row


def test_each_complete_point_is_logged_once_in_order() -> None:
    state = {"iterations": [iteration(0, True), iteration(1, True), iteration(2, True)]}
    memory, other = Memory(), Memory()
    tracker = LoopTracker([memory, other], {}, 5)
    assert tracker.next == 0
    tracker.update(state)
    tracker.update(state)
    assert [s for s, _ in memory.points] == [0, 1, 2] and [s for s, _ in other.points] == [0, 1, 2]
    assert tracker.next == 3


def test_a_resume_starts_after_the_complete_prefix() -> None:
    before = {"iterations": [iteration(0, True), iteration(1, False), iteration(2, True)]}
    memory = Memory()
    tracker = LoopTracker([memory], before, 5)
    assert tracker.next == 1  # iteration 1 was still training: logged by this run, and everything after it
    tracker.update(before)
    assert memory.points == []  # in order: nothing past an incomplete point
    after = {"iterations": [iteration(0, True), iteration(1, True), iteration(2, True), iteration(3, False)]}
    tracker.close(after)
    assert [s for s, _ in memory.points] == [1, 2, 3] and memory.closed == 1
    resumed = Memory()
    LoopTracker([resumed], {"iterations": [iteration(0, True)]}, 5).update(
        {"iterations": [iteration(0, True), iteration(1, True)]}
    )
    assert [s for s, _ in resumed.points] == [1]


def test_close_closes_every_writer_even_when_logging_fails() -> None:
    class Broken(Memory):
        def log(self, metrics: dict[str, float], step: int) -> None:
            raise OSError("disk full")

    broken, memory = Broken(), Memory()
    tracker = LoopTracker([memory, broken], {}, 1)
    with pytest.raises(OSError, match="disk full"):
        tracker.close({"iterations": [iteration(0, False)]})
    assert memory.closed == 1 and broken.closed == 1
