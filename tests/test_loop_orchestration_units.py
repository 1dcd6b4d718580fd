"""`polar loop` (the synchronous loop, ``_run_loop``) on fakes, in seconds: the order of rollouts, trainings and
pushes, which shards and policy each training gets, the versions the engine is asked for, ``nothing_to_train``,
backfill rounds, a resume after a kill (what is redone and what is kept), the refusals, and loop.json whole.

``run_rollout``, the `polar train` subprocess, the engine, the clock and the curves plot are fakes; ``_run_loop``,
``_rollout``, ``_backfill``, ``run_train``, ``_policy`` and the state file are the real code. The real loops run in
test_loop.py, test_loop_backfill.py and test_train_toy_loop.py (minutes each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_addon.store.status import SessionStatus
from polar_cli.eval.report import CallStats
from polar_cli.rollout import loop
from polar_cli.rollout.loop import LoopConfig, run_loop
from polar_cli.rollout.runner import RolloutInterrupted, RolloutResult
from polar_cli.rollout.session import SessionResult
from polar_cli.rollout.tasks import Task, task_set_hash

TASKS = [Task(id="t1", instruction="one"), Task(id="t2", instruction="two")]
PREEXEC = object()
TOKEN = "ctl-" + "7" * 40  # the proxy's control token: never in a file the loop writes


class Harness:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: Path | None = None, **config: Any) -> None:
        self.now = 100.0
        self.log: list[tuple[Any, ...]] = []
        self.said: list[str] = []
        self.exit: dict[str, int] = {}  # iteration dir name -> polar train's exit status (default 0)
        self.rewards: dict[str, list[float]] = {}  # run id -> each task's session rewards (default [1.0, 0.0])
        self.interrupt: dict[str, str] = {}  # run id -> the signal its rollout reports
        self.kill: set[str] = set()  # run ids / iteration dir names whose rollout / training is killed (Ctrl-C)
        self.failed: set[str] = set()  # run ids whose sessions all fail
        self.scratch = True  # whether a rollout leaves a work/ scratch directory behind
        self.made: dict[str, bool] = {}  # iteration dir name -> whether its training writes a checkpoint (default yes)
        self.train_log: dict[str, bytes] = {}  # iteration dir name -> more of its training's output
        self.model = tmp_path / "model"
        self.model.mkdir(parents=True, exist_ok=True)
        (self.model / "config.json").write_text("{}")
        self.out = out or tmp_path / "out"
        settings: dict[str, Any] = {"tasks": TASKS, "harness": "cmd:true", "samples": 2, "seed": 5, "iterations": 1}
        self.config = LoopConfig(model=self.model, out=self.out, **{**settings, **config})
        self.curves: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
        self.seen: list[list[int]] = []
        h = self

        class Engine:
            def __init__(self, config: LoopConfig, state_dir: Path, keep: bool = False) -> None:
                assert config is h.config and not keep
                self.state_dir = state_dir
                self.serving: tuple[Path, int | None] | None = None
                self.pushes: list[dict[str, Any]] = []
                h.log.append(("engine", state_dir))

            def spec(self, policy: Path, progress: Any, version: int | None = None) -> str:
                h.log.append(("spec", str(policy), version))
                if self.serving is not None and self.serving != (policy, version):
                    progress(f"push of version {version}")
                    self.pushes.append({"version": version, "checkpoint": str(policy), "reload_s": 0.5 + version})
                self.serving = (policy, version)
                return f"fake:{policy}?weight_version={version}"

            def close(self) -> None:
                h.log.append(("close",))

        async def run_rollout(rollout: Any) -> RolloutResult:
            h.log.append(("rollout", rollout.run_id, rollout.seed, rollout.engine, [t.id for t in rollout.tasks]))
            assert rollout.samples == 2 and rollout.progress is not None
            assert Path(rollout.out).parent == rollout.logs_dir.parent == rollout.work_dir.parent
            assert Path(rollout.out).name == "shards" and rollout.logs_dir.name == "logs"
            if h.scratch:
                rollout.work_dir.mkdir(parents=True)  # the scratch a rollout leaves behind
            Path(rollout.out).mkdir(parents=True, exist_ok=True)
            (Path(rollout.out) / f"{rollout.run_id}.parquet").write_text("shard")
            # The proxy keeps its token next to the store, and an agent may print it (the progress file shows errors).
            (Path(rollout.out) / ".control-token").write_text(TOKEN + "\n")
            rollout.progress.errors.append(("s0", f"the harness printed {TOKEN}"))
            if rollout.run_id in h.kill:
                raise KeyboardInterrupt
            started = h.now
            h.now += 10.0
            status = SessionStatus.ERROR if rollout.run_id in h.failed else SessionStatus.COMPLETED
            rewards = h.rewards.get(rollout.run_id, [1.0, 0.0])
            sessions = [
                SessionResult(f"{rollout.run_id}-{t.id}-{n}", t.id, t.id, n, status, reward=r)
                for t in rollout.tasks
                for n, r in enumerate(rewards)
            ]
            interrupted = h.interrupt.get(rollout.run_id)
            run_id = f"{rollout.run_id} {TOKEN}"
            return RolloutResult(run_id, sessions, started, h.now, rollout.out, interrupted=interrupted)

        def train_run(cmd: list[str], stdout: Any, stderr: Any, preexec_fn: Any) -> Any:
            assert stderr is subprocess.STDOUT and preexec_fn is PREEXEC
            output = Path(cmd[cmd.index("--output") + 1])
            name = output.parent.name
            h.log.append(("train", name, cmd[cmd.index("--model") + 1], cmd[4 : cmd.index("--model")], output.exists()))
            h.commands.append(cmd)
            if name in h.kill:
                raise KeyboardInterrupt
            stdout.write(f"training {name}\n")
            stdout.flush()
            stdout.buffer.write(h.train_log.get(name, b""))
            code = h.exit.get(name, 0)
            if h.made.get(name, True):
                output.mkdir(parents=True)  # polar train writes into it before it knows whether anything is learnt
                (output / "config.json").write_text("{}")
            h.now += 7.0
            return SimpleNamespace(returncode=code)

        def preexec(cpus: frozenset[int] | None) -> object:
            h.log.append(("cpus", cpus))
            return PREEXEC

        def plot(records: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> Path:
            h.curves.append((json.loads(json.dumps(records)), list(evals)))
            return path

        @contextmanager
        def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
            h.log.append(("pinned", cpus))
            yield
            h.log.append(("unpinned",))

        def call_stats(store: str, session_ids: list[str]) -> dict[str, CallStats]:
            h.calls.append((store, list(session_ids)))
            # each session: 2 calls, the second session of a group one failed; one tool call each
            return {s: CallStats(calls=2, failed_calls=int(s.endswith("-1")), tool_call_turns=1) for s in session_ids}

        def stale(state_dir: Path) -> list[str]:
            h.log.append(("stale", state_dir))
            return []

        def writer_gone(log_dir: Path) -> None:
            h.log.append(("writer gone", log_dir, log_dir.parent.exists()))

        import polar_cli.train.plots as plots

        self.commands: list[list[str]] = []
        self.calls: list[tuple[str, list[str]]] = []
        monkeypatch.setattr(loop, "_Engine", Engine)
        monkeypatch.setattr(loop, "run_rollout", run_rollout)
        monkeypatch.setattr(loop, "subprocess", SimpleNamespace(run=train_run, STDOUT=subprocess.STDOUT))
        monkeypatch.setattr(loop, "train_preexec", preexec)
        monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: h.now))
        monkeypatch.setattr(loop, "stop_stale_engines", stale)
        monkeypatch.setattr(loop, "pinned", pinned)
        monkeypatch.setattr(loop, "read_call_stats", call_stats)
        monkeypatch.setattr(loop, "wait_writer_gone", writer_gone)
        monkeypatch.setattr(plots, "plot_loop_curves", plot)

    def run(self, iterations: int) -> list[loop.IterationStats]:
        self.config = LoopConfig(**{**self.config.__dict__, "iterations": iterations})
        return run_loop(self.config, lambda stats: self.seen.append([s.iteration for s in stats]), self.said.append)

    def state(self) -> dict[str, Any]:
        return json.loads((self.out / "loop.json").read_text())

    def it(self, i: int) -> Path:
        return self.out / f"iter-{i:03d}"

    def steps(self) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] not in ("writer gone", "cpus", "pinned", "unpinned")]


def record(h: Harness, i: int, policy: Path, rollout_s: float = 10.0, **more: Any) -> dict[str, Any]:
    """Iteration ``i``'s loop.json record from the fakes (2 tasks x rewards [1.0, 0.0])."""
    base = {
        "iteration": i, "policy": str(policy), "sessions": 4, "usable": 4, "rewarded": 4,
        "statuses": {"completed": 4, "failed": 0, "timeout": 0, "error": 0, "cancelled": 0},
        "reward_mean": 0.5, "reward_se": pytest.approx((1 / 3) ** 0.5 / 2), "rollout_s": rollout_s,
        "train": None, "push_s": None, "groups": None, "calls": {"answered_calls": 6, "tool_call_calls": 4},
    }  # fmt: skip
    return {**base, **more}


def trained(h: Harness, i: int, seconds: float = 7.0) -> dict[str, Any]:
    d = h.it(i)
    return {"status": "trained", "checkpoint": str(d / "checkpoint"), "seconds": seconds, "log": str(d / "train.log"),
            "shards": [str(d / "shards")]}  # fmt: skip


def test_three_iterations_roll_train_push_in_order_and_loop_json_holds_every_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(
        tmp_path,
        monkeypatch,
        train_args=["--lr", "1e-3"],
        trackers_run="exp",
        train_cpus=frozenset({3}),
        rollout_cpus=frozenset({0, 1}),
    )
    stats = h.run(3)
    # the whole loop on the rollout CPU set
    assert h.log[0] == ("pinned", frozenset({0, 1})) and h.log[-1] == ("unpinned",)
    ck0, ck1 = h.it(0) / "checkpoint", h.it(1) / "checkpoint"
    model = str(h.model)
    assert h.steps() == [
        ("engine", h.out / ".engines"),
        ("stale", h.out / ".engines"),
        ("spec", model, 0),
        ("rollout", "it000", 5, f"fake:{model}?weight_version=0", ["t1", "t2"]),
        ("train", "iter-000", model, [str(h.it(0) / "shards")], False),
        ("spec", str(ck0), 1),
        ("rollout", "it001", 6, f"fake:{ck0}?weight_version=1", ["t1", "t2"]),
        ("train", "iter-001", str(ck0), [str(h.it(1) / "shards")], False),
        ("spec", str(ck1), 2),
        ("rollout", "it002", 7, f"fake:{ck1}?weight_version=2", ["t1", "t2"]),
        ("close",),
    ]
    # Each training on the train CPU set (the loop's own config, not the default: --train-cpus).
    assert [e for e in h.log if e[0] == "cpus"] == [("cpus", frozenset({3}))] * 2
    assert h.commands[0] == [
        sys.executable, "-m", "polar_cli.app", "train", str(h.it(0) / "shards"), "--model", model,
        "--output", str(ck0), "--no-progress", "--lr", "1e-3", "--run-name", "exp-iter-000",
    ]  # fmt: skip
    assert h.commands[1][-2:] == ["--run-name", "exp-iter-001"]
    assert (h.it(0) / "train.log").read_text() == "training iter-000\n"
    assert [e[1] for e in h.log if e[0] == "writer gone"] == [h.it(i) / "logs" for i in range(3)]
    assert h.said == [
        f"iteration 0: rollout of 2 tasks x 2 samples on {model}",
        "iteration 0: polar train",
        "push of version 1",
        f"iteration 1: rollout of 2 tasks x 2 samples on {ck0}",
        "iteration 1: polar train",
        "push of version 2",
        f"iteration 2: rollout of 2 tasks x 2 samples on {ck1}",
    ]
    # the captured calls of each iteration's sessions, read from its own store
    assert h.calls[1] == (str(h.it(1) / "shards"), [f"it001-{t}-{n}" for t in ("t1", "t2") for n in (0, 1)])
    # on_iteration after each rollout and each training
    assert h.seen == [[0], [0], [0, 1], [0, 1], [0, 1, 2]]
    expected = [
        record(h, 0, h.model, train=trained(h, 0)),
        record(h, 1, ck0, train=trained(h, 1), push_s=1.5),
        record(h, 2, ck1, push_s=2.5),
    ]
    assert [s.__dict__ for s in stats] == expected
    state = h.state()
    assert state == {
        "iterations": expected,
        "identity": {"tasks": task_set_hash(TASKS), "harness": "cmd:true", "model": str(h.model.resolve()),
                     "samples": 2},
        "evals": [],
        "seconds_this_run": 44.0,  # 3 rollouts x 10 + 2 trainings x 7 on the fake clock
        "curves": str(h.out / "loop-curves.png"),
    }  # fmt: skip
    assert h.curves == [(json.loads(json.dumps(state["iterations"])), [])]
    assert not (h.it(0) / "work").exists()  # each rollout's scratch removed
    summary = (h.it(2) / "rollout-summary.json").read_text()
    assert TOKEN not in summary and json.loads(summary)["run_id"] == "it002 <redacted>"
    progress = (h.it(2) / "rollout-progress.json").read_text()
    assert TOKEN not in progress and "the harness printed" in progress


def test_one_iteration_only_measures_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, out=tmp_path / "runs" / "out")  # --out's parents are made
    (only,) = h.run(1)
    assert only.train is None and only.policy == str(h.model)
    assert [e[0] for e in h.steps()] == ["engine", "stale", "spec", "rollout", "close"]
    assert h.state()["seconds_this_run"] == 10.0


def test_nothing_to_train_keeps_the_policy_and_its_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch)
    h.exit.update({"iter-000": 3, "iter-002": 3})
    h.made["iter-002"] = False  # exit 3 before it wrote anything
    stats = h.run(4)
    assert stats[0].train == {"status": "nothing_to_train", "seconds": 7.0, "log": str(h.it(0) / "train.log"),
                              "shards": [str(h.it(0) / "shards")]}  # fmt: skip
    assert not (h.it(0) / "checkpoint").exists()  # what it wrote is removed
    # iteration 1 samples the model again, at version 0 (no push); iteration 2 the first checkpoint, version 1
    ck1 = str(h.it(1) / "checkpoint")
    assert [e[1:] for e in h.log if e[0] == "spec"] == [(str(h.model), 0), (str(h.model), 0), (ck1, 1), (ck1, 1)]
    assert [e[2] for e in h.log if e[0] == "train"] == [str(h.model), str(h.model), ck1]
    assert [s.push_s for s in stats] == [None, None, 1.5, None]
    assert [s.policy for s in stats] == [str(h.model), str(h.model), ck1, ck1]
    assert stats[2].train["status"] == "nothing_to_train" and not (h.it(2) / "checkpoint").exists()


def test_a_failed_training_stops_the_loop_with_its_log_and_closes_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch)
    h.exit["iter-000"] = 1
    h.train_log["iter-000"] = b"x" * 3000 + b"\xff end\n"  # 3024 characters in all, one byte not UTF-8
    with pytest.raises(RuntimeError) as raised:
        h.run(2)
    log = h.it(0) / "train.log"
    tail = "x" * 2994 + "\ufffd end\n"  # the last 3000 characters: the first line and 6 x's are cut
    assert len(tail) == 3000
    assert str(raised.value) == f"polar train exited 1 (log {log}):\n{tail}"
    assert h.log[-1] == ("close",)
    state = h.state()
    assert state["iterations"][0]["train"] is None and "seconds_this_run" not in state and h.curves == []


def test_a_training_starts_from_an_empty_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed run's half-written checkpoint is removed before the training is redone."""
    h = Harness(tmp_path, monkeypatch)
    h.kill.add("iter-000")
    with pytest.raises(KeyboardInterrupt):
        h.run(2)
    assert (h.it(0) / "checkpoint" / "stale").parent.exists() is False
    (h.it(0) / "checkpoint").mkdir()
    (h.it(0) / "checkpoint" / "stale").write_text("half")
    state = h.state()
    assert [r["train"] for r in state["iterations"]] == [None]
    h.kill.clear()
    h.log.clear()
    h.run(2)
    # the rollout is kept, the training redone from its shards into an emptied output
    assert [e for e in h.steps() if e[0] in ("rollout", "train")] == [
        ("train", "iter-000", str(h.model), [str(h.it(0) / "shards")], False),
        ("rollout", "it001", 6, f"fake:{h.it(0) / 'checkpoint'}?weight_version=1", ["t1", "t2"]),
    ]
    assert not (h.it(0) / "checkpoint" / "stale").exists()


def test_a_killed_rollout_is_redone_whole_and_the_finished_iterations_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch)
    h.kill.add("it001")
    with pytest.raises(KeyboardInterrupt):
        h.run(3)
    assert h.log[-1] == ("close",)
    first = h.state()
    assert [r["iteration"] for r in first["iterations"]] == [0]
    assert (h.it(1) / "shards" / "it001.parquet").exists()  # the half-done attempt's shard
    h.kill.clear()
    h.log.clear()
    h.said.clear()
    h.seen.clear()
    h.now = 500.0
    stats = h.run(3)
    ck0 = h.it(0) / "checkpoint"
    assert [e for e in h.log if e[0] == "writer gone"] == [("writer gone", h.it(1) / "logs", True),
                                                           ("writer gone", h.it(2) / "logs", False)]  # fmt: skip
    assert h.steps()[2:] == [
        ("spec", str(ck0), 1),
        ("rollout", "it001", 6, f"fake:{ck0}?weight_version=1", ["t1", "t2"]),
        ("train", "iter-001", str(ck0), [str(h.it(1) / "shards")], False),
        ("spec", str(h.it(1) / "checkpoint"), 2),
        ("rollout", "it002", 7, f"fake:{h.it(1) / 'checkpoint'}?weight_version=2", ["t1", "t2"]),
        ("close",),
    ]
    # a fresh engine: its first load is no push; the first run's iteration 0 kept as it was
    assert stats[0].__dict__ == first["iterations"][0]
    assert stats[1].push_s is None and stats[2].push_s == 2.5
    assert h.state()["seconds_this_run"] == 27.0
    assert h.seen == [[0, 1], [0, 1], [0, 1, 2]]
    # A finished loop re-run: nothing redone, only the engine's life and the state file's run figures.
    h.log.clear()
    again = h.run(3)
    assert [e[0] for e in h.steps()] == ["engine", "stale", "close"]
    assert [s.__dict__ for s in again] == [s.__dict__ for s in stats]
    assert h.state()["seconds_this_run"] == 0.0
    # More iterations later: the old last one is trained first, then the new rollout.
    h.log.clear()
    assert len(h.run(4)) == 4
    assert [e[:2] for e in h.steps() if e[0] in ("rollout", "train")] == [("train", "iter-002"), ("rollout", "it003")]
    # Fewer: only the ones asked for are returned, and nothing is run.
    h.log.clear()
    assert [s.iteration for s in h.run(2)] == [0, 1]
    assert [e[0] for e in h.steps()] == ["engine", "stale", "close"]


def test_an_interrupted_or_failed_rollout_is_not_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch)
    h.interrupt["it000"] = "SIGTERM"
    with pytest.raises(RolloutInterrupted) as raised:
        h.run(2)
    assert str(raised.value) == f"iteration 0: interrupted by SIGTERM (summary in {h.it(0)})"
    assert raised.value.signal_name == "SIGTERM"
    assert json.loads((h.it(0) / "rollout-summary.json").read_text())["interrupted"] == "SIGTERM"
    assert not (h.it(0) / "work").exists()
    assert not (h.out / "loop.json").exists() and h.log[-1] == ("close",)
    del h.interrupt["it000"]
    h.failed.add("it000")
    with pytest.raises(RuntimeError) as failed:
        h.run(2)
    assert str(failed.value) == f"iteration 0: no session was usable (logs in {h.it(0) / 'logs'})"
    assert not (h.out / "loop.json").exists()


def test_backfill_rounds_go_into_the_same_shards_until_enough_groups_inform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, min_groups=2, max_backfill=3)
    h.scratch = False  # a rollout that made no work/ directory: nothing to remove, no error
    h.rewards.update({"it000": [1.0, 1.0], "it000bf1": [0.0, 0.0], "it000bf2": [1.0, 0.0]})
    stats = h.run(2)
    model = f"fake:{h.model}?weight_version=0"
    assert [e for e in h.log if e[0] == "rollout"] == [
        ("rollout", "it000", 5, model, ["t1", "t2"]),
        ("rollout", "it000bf1", 100_005, model, ["t1+bf1", "t2+bf1"]),
        ("rollout", "it000bf2", 200_005, model, ["t1+bf2", "t2+bf2"]),
        ("rollout", "it001", 6, f"fake:{h.it(0) / 'checkpoint'}?weight_version=1", ["t1", "t2"]),
    ]
    assert h.said[:4] == [
        f"iteration 0: rollout of 2 tasks x 2 samples on {h.model}",
        "iteration 0: 0 informative groups < 2: backfill round 1",
        f"iteration 0: rollout bf1 of 2 tasks x 2 samples on {h.model}",
        "iteration 0: 0 informative groups < 2: backfill round 2",
    ]
    assert "iteration 0: 2 informative groups after 2 backfill rounds: short" not in h.said
    assert stats[0].groups == {"target": 2, "sampled": 6, "informative": 2, "dropped": 4, "backfilled": 2, "rounds": 2}
    assert stats[0].sessions == 12 and stats[0].rollout_s == 30.0 and stats[0].reward_mean == 0.5
    assert sorted(p.name for p in (h.it(0) / "shards").glob("*.parquet")) == ["it000.parquet", "it000bf1.parquet",
                                                                    "it000bf2.parquet"]  # fmt: skip
    assert sorted(p.name for p in h.it(0).glob("rollout-summary*.json")) == [
        "rollout-summary-bf1.json", "rollout-summary-bf2.json", "rollout-summary.json"
    ]  # fmt: skip
    assert h.commands[0][4] == str(h.it(0) / "shards")  # one training over every round
    # enough at once: no round
    assert stats[1].groups == {"target": 2, "sampled": 2, "informative": 2, "dropped": 0, "backfilled": 0,
                               "rounds": 0}  # fmt: skip


def test_backfill_that_stays_short_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, min_groups=1, max_backfill=1)
    h.rewards.update({"it000": [1.0, 1.0], "it000bf1": [0.0, 0.0]})
    (only,) = h.run(1)
    assert h.said[-1] == "iteration 0: 0 informative groups after 1 backfill rounds: short"
    assert only.groups == {"target": 1, "sampled": 4, "informative": 0, "dropped": 4, "backfilled": 0, "rounds": 1}
    h2 = Harness(tmp_path / "b", monkeypatch, min_groups=1, max_backfill=0)
    h2.rewards["it000"] = [1.0, 1.0]
    (none,) = h2.run(1)
    assert none.groups == {"target": 1, "sampled": 2, "informative": 0, "dropped": 2, "backfilled": 0, "rounds": 0}
    assert [e[1] for e in h2.log if e[0] == "rollout"] == ["it000"]


def test_refusals_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"^iterations must be at least 1$"):
        h.run(0)
    (h.model / "config.json").unlink()
    with pytest.raises(ValueError) as no_model:
        h.run(1)
    assert str(no_model.value) == f"{h.model} is not a model directory (no config.json)"
    (h.model / "config.json").write_text("{}")
    h.out.mkdir()
    (h.out / "loop.json").write_text(json.dumps({"mode": "async", "iterations": []}))
    with pytest.raises(ValueError) as async_dir:
        h.run(1)
    assert str(async_dir.value) == f"{h.out} holds an async loop (polar loop --async): use another --out"
    assert h.steps() == []
    (h.out / "loop.json").unlink()
    h.run(1)
    h.config = LoopConfig(**{**h.config.__dict__, "harness": "cmd:other"})
    h.log.clear()
    with pytest.raises(ValueError) as changed:
        h.run(2)
    assert (
        str(changed.value)
        == "harness differ from the loop already in this directory (harness='cmd:true'): use another --out"
    )
    assert h.steps() == [] and len(h.state()["iterations"]) == 1


def test_an_eval_before_the_rollout_is_kept_and_counts_its_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evals = [Task(id="e1", instruction="held out")]
    h = Harness(tmp_path, monkeypatch, eval_tasks=evals, eval_every=2, eval_samples=3)
    made: list[tuple[int, str, int]] = []

    def evaluate(config: LoopConfig, i: int, policy: Path, engine: Any, say: Any, version: int) -> dict[str, Any]:
        assert config.eval_tasks == evals
        engine.spec(policy, say, version)
        say(f"eval {i}")
        made.append((i, str(policy), version))
        return {"iteration": i, "version": version}

    monkeypatch.setattr(loop, "_evaluate", evaluate)
    got: list[dict[str, Any]] = []
    h.config = LoopConfig(**{**h.config.__dict__, "iterations": 4})
    # Killed in the rollout after the base eval: the eval is in loop.json already, and not made again.
    h.kill.add("it000")
    with pytest.raises(KeyboardInterrupt):
        run_loop(h.config, progress=h.said.append, on_eval=got.append)
    assert h.state()["evals"] == [{"iteration": 0, "version": 0}] and h.state()["iterations"] == []
    assert h.said == ["eval 0", f"iteration 0: rollout of 2 tasks x 2 samples on {h.model}"]
    h.kill.clear()
    run_loop(h.config, progress=h.said.append, on_eval=got.append)
    cks = [str(h.it(i) / "checkpoint") for i in range(3)]
    assert made == [(0, str(h.model), 0), (2, cks[1], 2), (3, cks[2], 3)]  # the base, every 2nd, the last
    assert "eval 2" in h.said and "eval 1" not in h.said
    assert got == [{"iteration": i, "version": v} for i, _, v in made]
    state = h.state()
    assert state["evals"] == got
    assert state["identity"]["eval"] == {"tasks": task_set_hash(evals), "samples": 3}
    # the push is the eval's, and counted once for the iteration that samples those weights
    assert [r["push_s"] for r in state["iterations"]] == [None, 1.5, 2.5, 3.5]
    assert h.curves[-1][1] == got
    # A resume does not redo an evaluation already made (iteration 3's rollout is redone, not its eval).
    state["iterations"].pop()
    (h.out / "loop.json").write_text(json.dumps(state))
    made.clear()
    run_loop(h.config, progress=h.said.append)
    assert made == [] and len(h.state()["evals"]) == 3
    # eval_samples unset: the rollouts' samples
    h2 = Harness(tmp_path / "b", monkeypatch, eval_tasks=evals)
    monkeypatch.setattr(loop, "_evaluate", evaluate)
    h2.run(1)
    assert h2.state()["identity"]["eval"] == {"tasks": task_set_hash(evals), "samples": 2}


def test_a_ray_loop_runs_each_rollout_on_the_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from polar_cli.rollout import ray_backend

    h = Harness(tmp_path, monkeypatch, ray="10.0.0.1:6379", ray_resource="polar")
    local = loop.run_rollout
    asked: list[tuple[str, Any]] = []

    async def run_rollout_ray(rollout: Any, options: Any) -> RolloutResult:
        asked.append((rollout.run_id, options))
        return await local(rollout)

    async def not_local(rollout: Any) -> RolloutResult:
        raise AssertionError("a --ray loop ran a rollout on this machine")

    monkeypatch.setattr(ray_backend, "run_rollout_ray", run_rollout_ray)
    monkeypatch.setattr(loop, "run_rollout", not_local)
    stats = h.run(2)
    assert asked == [(r, ray_backend.RayOptions("10.0.0.1:6379", "polar")) for r in ("it000", "it001")]
    assert [s.sessions for s in stats] == [4, 4] and stats[0].train["status"] == "trained"
