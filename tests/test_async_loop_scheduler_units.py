"""`polar loop --async`'s scheduler (``_AsyncLoop``) on fakes, in seconds: which batch each step trains and on which
version, the staleness bound, the AHEAD window, never sampling a batch no step would take, the measuring batch, the
drains (wait, cut, keep) and their pushes, loop.json's records and figures, and a resume after a kill.

The rollouts (``_round``), the trainings (``_train``), the engine and the trace stores' versions are fakes; each
batch and each training waits for the test to finish it (an asyncio event) at a time the test sets on a fake clock,
so every interleaving and every figure is exact. The real loops run in test_async_loop.py (minutes, real engines).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_addon.store.status import SessionStatus
from polar_cli.rollout import async_loop
from polar_cli.rollout.loop import LoopConfig
from polar_cli.rollout.runner import RolloutResult
from polar_cli.rollout.session import SessionResult


async def settle() -> None:
    """Let both sides run until each waits on something only the test can give."""
    for _ in range(60):
        await asyncio.sleep(0)


async def settle_a_little() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        iterations: int,
        drain: str = "wait",
        max_staleness: int = 1,
        out: Path | None = None,
    ) -> None:
        self.now = 1000.0
        self.reload_s = 0.5  # how long a push's load takes on the fake clock
        self.log: list[tuple[Any, ...]] = []
        self.said: list[str] = []
        self.events: list[str] = []
        self.gates: dict[tuple[str, int], asyncio.Event] = {}
        self.status: dict[int, str] = {}  # step -> what its training answers (default "trained")
        self.stale_dirs: list[Path] = []
        self.rewards: dict[int, list[float]] = {}
        self.sessions: dict[tuple[int, int], list[tuple[str, float]]] = {}  # (batch, backfill round) -> (group, reward)
        self.hold: set[tuple[int, int]] = set()  # backfill rounds that wait for the test
        self.spans: dict[str, list[str | None]] = {}
        self.model = tmp_path / "model"
        self.model.mkdir(exist_ok=True)
        (self.model / "config.json").write_text("{}")
        self.out = out or tmp_path / "out"
        self.out.mkdir(exist_ok=True)
        self.config = LoopConfig(tasks=[], harness="cmd:true", model=self.model, iterations=iterations, out=self.out)
        self.drain, self.max_staleness = drain, max_staleness
        h = self

        class Engine:
            kind = "fake"

            def __init__(self, config: LoopConfig, state_dir: Path, keep: bool = False) -> None:
                assert config is h.config
                self.state_dir, self.keep = state_dir, keep
                h.log.append(("engine", state_dir, keep))

            def spec(self, policy: Path, progress: Any, version: int | None = None) -> str:
                h.log.append(("spec", version, str(policy)))
                progress(f"engine serves version {version}")
                h.now += h.reload_s
                return f"fake:{policy}?weight_version={version}"

            def close(self) -> None:
                h.log.append(("close",))

        async def fake_round(
            loop: Any, bdir: Path, index: int, spec: str, stop: asyncio.Event, backfill: int = 0
        ) -> RolloutResult:
            version = spec.rsplit("=", 1)[1]
            if backfill:
                h.log.append(("backfill", index, backfill, bdir.name))
            else:
                h.log.append(("batch", index, version, bdir.name))
                h.versions.setdefault(str(bdir / "shards"), {f"b{index}x": [version, version], f"b{index}y": [version]})
            if not backfill or (index, backfill) in h.hold:
                gate = h.gate("batch" if not backfill else f"bf{backfill}", index)
                waits = [asyncio.ensure_future(gate.wait()), asyncio.ensure_future(stop.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:
                    await settle_a_little()  # a cancelled rollout takes a while to end its sessions
                    h.log.append(("batch cancelled", index))
                    raise
                for w in waits:
                    w.cancel()
            played = h.sessions.get((index, backfill)) or [("g", r) for r in h.rewards.get(index, [1.0, 0.0])]
            sessions = [
                SessionResult(f"s{i}", "t", g, i, SessionStatus.COMPLETED, reward=r) for i, (g, r) in enumerate(played)
            ]
            return RolloutResult(f"r{index}", sessions, 0.0, 0.0, None, interrupted="stop" if stop.is_set() else None)

        async def fake_train(loop: Any, shards: list[Path], policy: Path, version: int, idir: Path) -> str:
            step = int(idir.name.split("-")[1])
            h.log.append(("train", step, version, [Path(s).parent.name for s in shards], str(policy)))
            try:
                await h.gate("train", step).wait()
            except asyncio.CancelledError:
                for _ in range(4):  # a killed training is waited for: longer than a batch's sessions
                    await settle_a_little()
                h.log.append(("train cancelled", step))
                raise
            status = h.status.get(step, "trained")
            if status == "trained":
                (idir / "checkpoint").mkdir(parents=True, exist_ok=True)
                (idir / "checkpoint" / "config.json").write_text("{}")
            return status

        async def to_thread(f: Any, *args: Any, **kwargs: Any) -> Any:
            return f(*args, **kwargs)

        self.versions: dict[str, dict[str, list[str | None]]] = {}
        monkeypatch.setattr(async_loop, "_Engine", Engine)
        monkeypatch.setattr(async_loop, "time", SimpleNamespace(time=lambda: h.now))
        monkeypatch.setattr(async_loop, "group_versions", lambda store: h.versions[store])
        monkeypatch.setattr(async_loop, "stop_stale_engines", lambda d: h.stale_dirs.append(d) or [])
        monkeypatch.setattr(async_loop._AsyncLoop, "_round", fake_round)
        monkeypatch.setattr(async_loop._AsyncLoop, "_train", fake_train)
        monkeypatch.setattr(asyncio, "to_thread", to_thread)

        def read_table(store: str, columns: list[str]) -> Any:
            assert columns == ["weight_versions_json"]
            column = SimpleNamespace(to_pylist=lambda: h.spans.get(store, []))
            return SimpleNamespace(column=lambda i: column if i == 0 else None)

        import polar_addon.store.reader

        monkeypatch.setattr(polar_addon.store.reader, "read_table", read_table)

    def gate(self, kind: str, n: int) -> asyncio.Event:
        return self.gates.setdefault((kind, n), asyncio.Event())

    def new_loop(self) -> async_loop._AsyncLoop:
        return async_loop._AsyncLoop(
            self.config,
            self.max_staleness,
            self.drain,  # type: ignore[arg-type]
            lambda e: self.events.append(
                f"{e['kind']} {e[e['kind']].index if e['kind'] == 'batch' else e['step'].step}"
            ),
            self.said.append,
        )

    async def start(self) -> asyncio.Task:
        self.loop = self.new_loop()
        task = asyncio.create_task(self.loop.run())
        await settle()
        return task

    async def finish(self, kind: str, n: int, at: float) -> None:
        self.now = at
        self.gate(kind, n).set()
        await settle()

    def since(self, mark: int) -> list[tuple[Any, ...]]:
        return self.log[mark:]

    def state(self) -> dict[str, Any]:
        return json.loads((self.out / "loop.json").read_text())


def ckpt(h: Harness, step: int) -> str:
    return str(h.out / f"train-{step:03d}" / "checkpoint")


def test_wait_drain_order_of_batches_steps_and_pushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3)

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        model = str(h.model)
        assert h.log == [
            ("engine", h.out / ".engines", False),
            ("spec", 0, model),
            ("batch", 0, "0", "batch-000"),
        ]
        assert h.stale_dirs == [h.out / ".engines"]
        mark = len(h.log)
        await h.finish("batch", 0, at=1010.0)
        # The trainer takes batch 0 on version 0; the rollout side samples batch 1 meanwhile (one step still needs
        # one), on version 0 still: nothing was pushed.
        assert h.since(mark) == [
            ("train", 0, 0, ["batch-000"], model),
            ("spec", 0, model),
            ("batch", 1, "0", "batch-001"),
        ]
        # loop.json shows what the running step trains.
        seen = h.state()
        assert [b["step"] for b in seen["batches"]] == [0] and seen["steps"] == []
        assert "summary" not in seen  # only the run's end makes one
        mark = len(h.log)
        await h.finish("batch", 1, at=1020.0)
        # AHEAD: batch 1 waits for the trainer, and the rollout side waits too.
        assert h.since(mark) == []
        await h.finish("train", 0, at=1030.0)
        # Step 1 takes batch 1 (one version behind: within the bound) on version 1. Every step has its batch now:
        # no batch is sampled that nobody would train.
        assert h.since(mark) == [("train", 1, 1, ["batch-001"], ckpt(h, 0))]
        mark = len(h.log)
        await h.finish("train", 1, at=1040.0)
        # The last policy (version 2) is pushed, then measured.
        assert h.since(mark) == [("spec", 2, ckpt(h, 1)), ("batch", 2, "2", "batch-002")]
        assert not task.done()
        await h.finish("batch", 2, at=1050.0)
        assert task.done()
        assert h.log[-1] == ("close",)
        return task.result()

    state = asyncio.run(scenario())
    assert state == h.state()
    assert h.events == ["batch 0", "batch 1", "step 0", "step 1", "batch 2"]
    assert [(b["index"], b["version"], b["step"], b["final"], b["cut"]) for b in state["batches"]] == [
        (0, 0, 0, False, False),
        (1, 0, 1, False, False),
        (2, 2, None, True, False),
    ]
    assert [b["policy"] for b in state["batches"]] == [str(h.model), str(h.model), ckpt(h, 1)]
    assert [(b["started_at"], b["ended_at"]) for b in state["batches"]] == [
        (1000.5, 1010.0),
        (1010.5, 1020.0),
        (1040.5, 1050.0),
    ]
    assert state["batches"][0]["shards"] == str(h.out / "batch-000" / "shards")
    steps = state["steps"]
    assert [(s["step"], s["version"], s["batches"], s["status"]) for s in steps] == [
        (0, 0, [0], "trained"),
        (1, 1, [1], "trained"),
    ]
    assert [(s["started_at"], s["ended_at"]) for s in steps] == [(1010.0, 1030.0), (1030.0, 1040.0)]
    assert [(s["groups_kept"], s["groups_dropped"]) for s in steps] == [(2, 0), (2, 0)]
    assert [s["checkpoint"] for s in steps] == [ckpt(h, 0), ckpt(h, 1)]
    assert steps[1]["log"] == str(h.out / "train-001" / "train.log")
    # Utilisation from the previous step's end (the run's start for the first) to each step's end:
    # step 0, [1000, 1030]: rollouts busy [1000.5, 1010] and [1010.5, 1020] = 19 of 30 s; trainer 20 of 30 s.
    assert steps[0]["rollout_util"] == pytest.approx(19 / 30)
    assert steps[0]["trainer_util"] == pytest.approx(20 / 30)
    # step 1, [1030, 1040]: rollouts idle, trainer busy throughout.
    assert (steps[1]["rollout_util"], steps[1]["trainer_util"]) == (0.0, pytest.approx(1.0))
    # Only version 2 was served after its publication (version 1 never was: no batch ran on it).
    assert state["pushes"] == [
        {
            "version": 2,
            "checkpoint": ckpt(h, 1),
            "published_at": 1040.0,
            "loaded_at": 1040.5,
            "drain_s": 0.5,
            "reload_s": 0.5,
            "engine": "fake",
        }
    ]
    assert "pushed version 2: drain 0.5 s (reload 0.5 s)" in h.said
    assert state["runs"] == [{"started_at": 1000.0, "ended_at": 1050.0}]
    assert (state["mode"], state["max_staleness"], state["drain"], state["engine"]) == ("async", 1, "wait", "local")
    assert state["identity"]["model"] == str(h.model.resolve()) and state["identity"]["samples"] == 8
    assert "iterations" not in state
    s = state["summary"]
    assert s == {
        "wall_s": 50.0,
        "rollout_util": pytest.approx(28.5 / 50),
        "trainer_util": pytest.approx(30 / 50),
        "batches": 3,
        "batches_cut": 0,
        "groups_dropped": 0,
        "final_version": 2,
        "complete": True,
        "runs": 1,
        "final_reward_mean": 0.5,
        "final_reward_se": 0.5,
        "drain_s": [0.5],
    }
    assert "versions" not in s
    assert h.said[:2] == [
        "engine serves version 0",
        "batch 0: 0 tasks x 8 samples on version 0 (" + str(h.model) + ")",
    ]
    assert [b["groups"] for b in state["batches"]] == [None, None, None]  # no --min-groups
    assert state["identity"] == {
        "tasks": async_loop.task_set_hash([]),
        "harness": "cmd:true",
        "model": str(h.model.resolve()),
        "samples": 8,
    }
    assert "step 1: polar train on version 1 with batches [1]" in h.said


def test_a_stale_batch_is_dropped_and_the_step_waits_for_a_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3, max_staleness=0)
    h.rewards[3] = [1.0, 1.0, 0.0, 1.0]

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        await h.finish("train", 0, at=1015.0)  # version 1 while batch 1 (version 0) runs
        mark = len(h.log)
        await h.finish("batch", 1, at=1020.0)
        # Step 1 (version 1) drops batch 1 (one version behind, bound 0) and waits: the rollout side samples batch 2
        # on version 1, pushed first.
        assert h.since(mark) == [("spec", 1, ckpt(h, 0)), ("batch", 2, "1", "batch-002")]
        assert h.loop.batches[1].step == 1  # taken by step 1 (and dropped)
        mark = len(h.log)
        await h.finish("batch", 2, at=1030.0)
        assert h.since(mark) == [("train", 1, 1, ["batch-002"], ckpt(h, 0))]
        await h.finish("train", 1, at=1040.0)
        await h.finish("batch", 3, at=1050.0)
        assert task.done()
        return task.result()

    state = asyncio.run(scenario())
    assert [(b["index"], b["version"], b["step"], b["dropped_groups"]) for b in state["batches"]] == [
        (0, 0, 0, {}),
        (1, 0, 1, {"b1x": 1, "b1y": 1}),
        (2, 1, 1, {}),
        (3, 2, None, {}),
    ]
    assert [(s["batches"], s["groups_kept"], s["groups_dropped"]) for s in state["steps"]] == [
        ([0], 2, 0),
        ([2], 2, 2),
    ]
    assert "step 1: batch 1 (version 0): dropped 2 group(s) beyond --max-staleness 0" in h.said
    assert [p["version"] for p in state["pushes"]] == [1, 2]
    assert state["pushes"][0]["drain_s"] == pytest.approx(1020.5 - 1015.0)
    assert "pushed version 1: drain 5.5 s (reload 0.5 s)" in h.said
    assert state["summary"]["groups_dropped"] == 2
    assert state["summary"]["final_reward_mean"] == 0.75
    assert state["summary"]["final_reward_se"] == pytest.approx(0.25)
    assert state["summary"]["drain_s"] == [pytest.approx(5.5), 0.5]


def test_four_iterations_keep_one_batch_ahead_and_one_version_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=4, max_staleness=1)

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1001.0)
        mark = len(h.log)
        await h.finish("batch", 1, at=1002.0)  # on version 0; waits while step 0 trains, and so does the rollout side
        assert h.since(mark) == []
        await h.finish("train", 0, at=1003.0)
        # Step 1 takes batch 1 (one behind: kept); one step still needs a batch, so batch 2 runs, on version 1.
        assert h.since(mark) == [
            ("train", 1, 1, ["batch-001"], ckpt(h, 0)),
            ("spec", 1, ckpt(h, 0)),
            ("batch", 2, "1", "batch-002"),
        ]
        mark = len(h.log)
        await h.finish("batch", 2, at=1004.0)
        assert h.since(mark) == []
        await h.finish("train", 1, at=1005.0)
        assert h.since(mark) == [("train", 2, 2, ["batch-002"], ckpt(h, 1))]
        mark = len(h.log)
        await h.finish("train", 2, at=1007.0)
        assert h.since(mark) == [("spec", 3, ckpt(h, 2)), ("batch", 3, "3", "batch-003")]
        await h.finish("batch", 3, at=1008.0)
        assert task.done()
        return task.result()

    state = asyncio.run(scenario())
    assert [(b["index"], b["version"], b["step"], b["final"]) for b in state["batches"]] == [
        (0, 0, 0, False),
        (1, 0, 1, False),
        (2, 1, 2, False),
        (3, 3, None, True),
    ]
    assert [(s["version"], s["batches"]) for s in state["steps"]] == [(0, [0]), (1, [1]), (2, [2])]
    assert [p["version"] for p in state["pushes"]] == [1, 3]


def test_one_training_samples_no_batch_beyond_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=2)

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        mark = len(h.log)
        await h.finish("batch", 0, at=1010.0)
        # The only step has its batch: nothing more is sampled until the last policy is ready.
        assert h.since(mark) == [("train", 0, 0, ["batch-000"], str(h.model))]
        mark = len(h.log)
        await h.finish("train", 0, at=1020.0)
        assert h.since(mark) == [("spec", 1, ckpt(h, 0)), ("batch", 1, "1", "batch-001")]
        await h.finish("batch", 1, at=1030.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [(b["index"], b["final"]) for b in state["batches"]] == [(0, False), (1, True)]


def test_a_single_iteration_only_measures_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=1)

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [(b["index"], b["version"], b["final"], b["step"]) for b in state["batches"]] == [(0, 0, True, None)]
    assert state["steps"] == [] and state["pushes"] == []
    assert state["summary"]["final_version"] == 0 and state["summary"]["complete"] is True
    assert state["summary"]["rollout_util"] == pytest.approx(9.5 / 10)
    assert state["summary"]["trainer_util"] == 0.0


def test_cut_stops_the_batch_in_flight_when_a_training_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3, drain="cut")

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        mark = len(h.log)
        await h.finish("train", 0, at=1015.0)
        # Batch 1 (in flight) was cut; step 1 takes it (what it finished is kept) and the push precedes nothing
        # else: no batch runs, and none is needed.
        assert h.since(mark) == [("train", 1, 1, ["batch-001"], ckpt(h, 0))]
        await h.finish("train", 1, at=1020.0)
        await h.finish("batch", 2, at=1030.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [(b["index"], b["cut"], b["ended_at"]) for b in state["batches"]] == [
        (0, False, 1010.0),
        (1, True, 1015.0),
        (2, False, 1030.0),
    ]
    assert state["summary"]["batches_cut"] == 1
    assert [p["version"] for p in state["pushes"]] == [2]


def test_wait_lets_the_batch_in_flight_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3, drain="wait")

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        mark = len(h.log)
        await h.finish("train", 0, at=1015.0)
        assert h.since(mark) == []  # batch 1 still runs; nothing is pushed under it
        await h.finish("batch", 1, at=1018.0)
        await h.finish("train", 1, at=1020.0)
        await h.finish("batch", 2, at=1030.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [b["cut"] for b in state["batches"]] == [False, False, False]
    assert state["batches"][1]["ended_at"] == 1018.0


def test_keep_pushes_right_after_a_training_under_the_batch_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3, drain="keep")
    h.spans[str(h.out / "batch-001" / "shards")] = [
        json.dumps([{"version": "0", "start": 0, "end": 3}, {"version": "1", "start": 3, "end": 10}]),
        None,
    ]
    h.spans[str(h.out / "batch-000" / "shards")] = [json.dumps([{"version": "0", "start": 0, "end": 4}])]

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        assert h.log[0] == ("engine", h.out / ".engines", True)
        await h.finish("batch", 0, at=1010.0)
        mark = len(h.log)
        await h.finish("train", 0, at=1015.0)
        # Pushed at once, under batch 1, which goes on (not cut); step 1 takes batch 1 only once it ends.
        assert h.since(mark) == [("spec", 1, ckpt(h, 0))]
        assert "pushed version 1 under batch 1: drain 0.5 s (reload 0.5 s)" in h.said
        mark = len(h.log)
        await h.finish("batch", 1, at=1018.0)
        assert h.since(mark) == [("train", 1, 1, ["batch-001"], ckpt(h, 0))]
        mark = len(h.log)
        await h.finish("train", 1, at=1020.0)
        # Pushed by the trainer with no batch in flight; the measuring batch's own serve finds it loaded.
        assert h.since(mark) == [("spec", 2, ckpt(h, 1)), ("spec", 2, ckpt(h, 1)), ("batch", 2, "2", "batch-002")]
        await h.finish("batch", 2, at=1030.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [(p["version"], p["during_batch"], p["published_at"], p["loaded_at"]) for p in state["pushes"]] == [
        (1, 1, 1015.0, 1015.5),
        (2, None, 1020.0, 1020.5),
    ]
    assert [b["cut"] for b in state["batches"]] == [False, False, False]
    assert [b["versions"] for b in state["batches"]] == [
        {"calls": 1, "calls_mixed": 0, "tokens": 4, "tokens_after_push": 0},
        {"calls": 2, "calls_mixed": 1, "tokens": 10, "tokens_after_push": 7},
        {"calls": 0, "calls_mixed": 0, "tokens": 0, "tokens_after_push": 0},
    ]
    assert state["summary"]["versions"] == {"calls": 3, "calls_mixed": 1, "tokens": 14, "tokens_after_push": 7}


def test_nothing_to_train_keeps_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3)
    h.status[0] = "nothing_to_train"

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        await h.finish("batch", 1, at=1011.0)
        mark = len(h.log)
        await h.finish("train", 0, at=1015.0)
        assert h.since(mark) == [("train", 1, 0, ["batch-001"], str(h.model))]
        mark = len(h.log)
        await h.finish("train", 1, at=1020.0)
        assert h.since(mark) == [("spec", 1, ckpt(h, 1)), ("batch", 2, "1", "batch-002")]
        await h.finish("batch", 2, at=1030.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [(s["status"], s["checkpoint"]) for s in state["steps"]] == [
        ("nothing_to_train", None),
        ("trained", ckpt(h, 1)),
    ]
    assert state["summary"]["final_version"] == 1
    assert [p["version"] for p in state["pushes"]] == [1]


def test_a_cancelled_loop_closes_the_engine_and_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3)

    async def scenario() -> None:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        task.cancel()  # a Ctrl-C: the finally still closes the engine and saves
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    # Both sides have ended (the batch's sessions, the training) before the engine under them is closed.
    assert sorted(h.log[-3:-1]) == [("batch cancelled", 1), ("train cancelled", 0)]
    assert h.log[-1] == ("close",)
    state = h.state()
    assert state["summary"]["complete"] is False and state["summary"]["batches"] == 1
    assert [b["step"] for b in state["batches"]] == [0]


def test_a_training_error_ends_the_run_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3)

    async def broken(*_a: Any) -> str:
        raise RuntimeError("polar train exited 1")

    monkeypatch.setattr(async_loop._AsyncLoop, "_train", broken)

    async def scenario() -> None:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        assert task.done()
        with pytest.raises(RuntimeError, match="^polar train exited 1$"):
            task.result()

    asyncio.run(scenario())
    assert h.log[-2:] == [("batch cancelled", 1), ("close",)]
    assert h.state()["summary"]["complete"] is False


def test_resume_after_a_kill_goes_on_from_the_last_finished_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=4)

    async def killed() -> None:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        await h.finish("batch", 1, at=1011.0)
        await h.finish("train", 0, at=1020.0)  # step 1 takes batch 1; batch 2 starts on version 1
        assert h.log[-3:] == [
            ("train", 1, 1, ["batch-001"], ckpt(h, 0)),
            ("spec", 1, ckpt(h, 0)),
            ("batch", 2, "1", "batch-002"),
        ]
        h.now = 1025.0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(killed())
    before = h.state()
    assert [b["step"] for b in before["batches"]] == [0, 1] and len(before["steps"]) == 1
    assert (h.out / "batch-002").is_dir()

    h.log.clear()
    h.said.clear()
    h.now = 2000.0
    h.gates.clear()

    async def resumed() -> dict[str, Any]:
        task = await h.start()
        assert h.loop.resumed and h.loop.first_version == 1 and h.loop.first_policy == Path(ckpt(h, 0))
        # Batch 1 waits for the trainer again: step 1 retrains it on version 1; batch 2 is redone in a new directory.
        assert h.log[1:] == [
            ("train", 1, 1, ["batch-001"], ckpt(h, 0)),
            ("spec", 1, ckpt(h, 0)),
            ("batch", 2, "1", "batch-002-attempt2"),
        ]
        await h.finish("batch", 2, at=2010.0)
        await h.finish("train", 1, at=2020.0)
        await h.finish("train", 2, at=2040.0)
        await h.finish("batch", 3, at=2050.0)
        return task.result()

    state = asyncio.run(resumed())
    assert h.said[0] == (
        f"resuming {h.out}: 1 step(s) and 2 batch(es) done, version 1, batches [1] waiting for the trainer"
    )
    assert state["steps"][0] == before["steps"][0]
    assert before["pushes"] and state["pushes"][: len(before["pushes"])] == before["pushes"]
    assert [p["version"] for p in state["pushes"]] == [1, 3]
    assert [(s["step"], s["version"], s["batches"]) for s in state["steps"]] == [(0, 0, [0]), (1, 1, [1]), (2, 2, [2])]
    assert [(b["index"], b["version"], b["step"], b["final"]) for b in state["batches"]] == [
        (0, 0, 0, False),
        (1, 0, 1, False),
        (2, 1, 2, False),
        (3, 3, None, True),
    ]
    assert state["batches"][2]["shards"] == str(h.out / "batch-002-attempt2" / "shards")
    assert state["runs"][0] == before["runs"][0]
    assert state["runs"][1] == {"started_at": 2000.0, "ended_at": 2050.0}
    assert state["summary"]["runs"] == 2
    assert state["summary"]["wall_s"] == pytest.approx(25.0 + 50.0)
    # Step 1's window runs from step 0's end (1020) to 2020 but counts only the runs: [1020, 1025] and [2000, 2020].
    s1 = state["steps"][1]
    assert s1["rollout_util"] == pytest.approx(9.5 / 25)  # batch 2, [2000.5, 2010]
    assert s1["trainer_util"] == pytest.approx(20 / 25)
    assert state["summary"]["complete"] is True
    # A complete run is left alone.
    assert h.new_loop().complete()


def test_resume_refuses_a_lost_checkpoint_and_a_synchronous_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3)
    step = {
        "step": 0, "version": 0, "batches": [], "groups_kept": 0, "groups_dropped": 0, "started_at": 0.0,
        "ended_at": 1.0, "status": "trained", "checkpoint": str(tmp_path / "gone"), "log": "l",
    }  # fmt: skip
    (h.out / "loop.json").write_text(json.dumps({"steps": [step]}))
    gone = f"step 0's checkpoint {tmp_path / 'gone'} is gone: the loop in {h.out} cannot resume; use another --out"
    with pytest.raises(ValueError, match=f"^{re.escape(gone)}$"):
        h.new_loop()
    (h.out / "loop.json").write_text(json.dumps({"iterations": [{}]}))
    with pytest.raises(ValueError, match="holds a synchronous loop"):
        h.new_loop()
    (h.out / "loop.json").write_text(json.dumps({"steps": [{**step, "status": "nothing_to_train"}]}))
    loop = h.new_loop()
    assert (loop.first_version, loop.first_policy, loop.resumed) == (0, h.model, True)


def test_a_rerun_with_more_iterations_goes_on_and_one_without_its_measuring_batch_is_not_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=2)

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        await h.finish("train", 0, at=1020.0)
        await h.finish("batch", 1, at=1030.0)
        return task.result()

    asyncio.run(scenario())
    assert h.new_loop().complete()
    h.config = LoopConfig(tasks=[], harness="cmd:true", model=h.model, iterations=3, out=h.out)
    assert not h.new_loop().complete()  # a measuring batch, but a training still to run
    state = h.state()
    state["batches"][-1]["final"] = False
    (h.out / "loop.json").write_text(json.dumps(state))
    h.config = LoopConfig(tasks=[], harness="cmd:true", model=h.model, iterations=2, out=h.out)
    assert not h.new_loop().complete()  # every training, but no measuring batch
    h.config = LoopConfig(tasks=[], harness="cmd:other", model=h.model, iterations=2, out=h.out)
    with pytest.raises(ValueError, match=r"^harness differ from the loop already in this directory"):
        h.new_loop()


def test_a_batch_none_of_whose_groups_is_usable_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=2, max_staleness=0)
    # Batch 0 holds no group (every session failed before a call); batch 1 mixes a group within the bound with one
    # past it (a keep push landed between two of its sessions): either is left out whole.
    h.versions[str(h.out / "batch-000" / "shards")] = {}
    h.versions[str(h.out / "batch-001" / "shards")] = {"a": ["0"], "b": ["-1"]}

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        mark = len(h.log)
        await h.finish("batch", 0, at=1010.0)
        assert h.since(mark) == [("spec", 0, str(h.model)), ("batch", 1, "0", "batch-001")]
        mark = len(h.log)
        await h.finish("batch", 1, at=1020.0)
        assert h.since(mark) == [("spec", 0, str(h.model)), ("batch", 2, "0", "batch-002")]
        mark = len(h.log)
        await h.finish("batch", 2, at=1030.0)
        assert h.since(mark) == [("train", 0, 0, ["batch-002"], str(h.model))]
        await h.finish("train", 0, at=1040.0)
        await h.finish("batch", 3, at=1050.0)
        return task.result()

    state = asyncio.run(scenario())
    assert [(b["index"], b["step"], b["dropped_groups"]) for b in state["batches"]] == [
        (0, 0, {}),
        (1, 0, {"b": 1}),
        (2, 0, {}),
        (3, None, {}),
    ]
    assert [(s["batches"], s["groups_kept"], s["groups_dropped"]) for s in state["steps"]] == [([2], 2, 1)]


def test_a_batch_with_untagged_calls_stops_the_loop_naming_three_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=2)
    h.versions[str(h.out / "batch-000" / "shards")] = {g: ["0", None] for g in ("a", "b", "c", "d")}

    async def scenario() -> None:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        assert task.done()
        message = (
            "batch 0: calls of group(s) ['a', 'b', 'c'] carry no numeric weight_version (engine local): "
            "their staleness cannot be bounded"
        )
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            task.result()

    asyncio.run(scenario())


def test_backfill_rounds_run_until_enough_groups_are_informative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=1)
    h.config = LoopConfig(
        tasks=[], harness="cmd:true", model=h.model, iterations=1, out=h.out, min_groups=2, max_backfill=3
    )
    h.sessions[(0, 0)] = [("g0", 1.0), ("g0", 0.0)]  # informative
    h.sessions[(0, 1)] = [("g1", 1.0), ("g1", 1.0)]  # not
    h.sessions[(0, 2)] = [("g2", 0.0), ("g2", 1.0)]  # informative: two, enough
    h.sessions[(0, 3)] = [("g3", 0.0), ("g3", 1.0)]

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        return task.result()

    state = asyncio.run(scenario())
    assert h.log[2:5] == [
        ("batch", 0, "0", "batch-000"),
        ("backfill", 0, 1, "batch-000"),
        ("backfill", 0, 2, "batch-000"),
    ]
    assert h.log[5] == ("close",)
    assert [line for line in h.said if "backfill round" in line] == [
        "batch 0: 1 informative groups < 2: backfill round 1",
        "batch 0: 1 informative groups < 2: backfill round 2",
    ]
    batch = state["batches"][0]
    assert batch["groups"] == {
        "target": 2, "sampled": 3, "informative": 2, "dropped": 1, "backfilled": 1, "rounds": 2,
    }  # fmt: skip
    assert (batch["sessions"], batch["rewarded"], batch["reward_mean"]) == (6, 6, pytest.approx(4 / 6))


def test_a_cut_ends_the_backfill_of_the_batch_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, monkeypatch, iterations=3, drain="cut")
    h.config = LoopConfig(
        tasks=[], harness="cmd:true", model=h.model, iterations=3, out=h.out, min_groups=1, max_backfill=3
    )
    h.sessions[(0, 0)] = [("g0", 1.0), ("g0", 0.0)]
    h.sessions[(1, 0)] = [("g1", 1.0), ("g1", 1.0)]  # not informative: backfill
    h.sessions[(1, 1)] = [("g1b", 1.0), ("g1b", 1.0)]  # cut before it is informative
    h.hold.add((1, 1))

    async def scenario() -> dict[str, Any]:
        task = await h.start()
        await h.finish("batch", 0, at=1010.0)
        mark = len(h.log)
        await h.finish("batch", 1, at=1012.0)
        assert h.since(mark) == [("backfill", 1, 1, "batch-001")]
        mark = len(h.log)
        await h.finish("train", 0, at=1015.0)  # the cut: no second backfill round
        assert h.since(mark) == [("train", 1, 1, ["batch-001"], ckpt(h, 0))]
        h.sessions[(2, 0)] = [("g2", 1.0), ("g2", 0.0)]
        await h.finish("train", 1, at=1020.0)
        await h.finish("batch", 2, at=1030.0)
        return task.result()

    state = asyncio.run(scenario())
    b1 = state["batches"][1]
    assert (b1["cut"], b1["ended_at"], b1["sessions"]) == (True, 1015.0, 4)
    assert b1["groups"] == {
        "target": 1, "sampled": 2, "informative": 0, "dropped": 2, "backfilled": 0, "rounds": 1,
    }  # fmt: skip


# -- the seams the scheduler's fakes replace: one rollout round, one training ------------------------------------------


def _bare_loop(tmp_path: Path, **options: Any) -> async_loop._AsyncLoop:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "out").mkdir(exist_ok=True)
    config = LoopConfig(harness="cmd:true", model=model, iterations=3, out=tmp_path / "out", **options)
    return async_loop._AsyncLoop(config, 2, "wait", None, None)


def _result(statuses: list[SessionStatus], interrupted: str | None = None) -> RolloutResult:
    sessions = [SessionResult(f"s{i}", "t", "g", i, s, reward=1.0) for i, s in enumerate(statuses)]
    return RolloutResult("r", sessions, 0.0, 1.0, None, interrupted=interrupted)


def test_a_round_runs_the_batch_or_its_backfill_into_the_batch_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polar_cli.rollout.tasks import Task

    loop = _bare_loop(tmp_path, tasks=[Task(id="t1", instruction="x")], seed=7)
    seen: list[Any] = []
    answers: list[RolloutResult] = []

    async def run_rollout(rollout: Any) -> RolloutResult:
        seen.append(rollout)
        Path(rollout.work_dir).mkdir(parents=True)  # scratch the round leaves behind on failure too
        return answers.pop(0)

    monkeypatch.setattr(async_loop, "run_rollout", run_rollout)
    bdir = tmp_path / "out" / "batch-004"
    bdir.mkdir()
    stop = asyncio.Event()
    completed = _result([SessionStatus.COMPLETED])
    answers += [completed, _result([SessionStatus.ERROR])]
    assert asyncio.run(loop._round(bdir, 4, "local:M?weight_version=2", stop)) is completed
    first = seen[0]
    assert (first.out, first.engine, first.seed, first.run_id, first.stop) == (
        str(bdir / "shards"), "local:M?weight_version=2", 11, "b004", stop,
    )  # fmt: skip
    assert [t.id for t in first.tasks] == ["t1"] and first.progress is not None
    assert json.loads((bdir / "rollout-summary.json").read_text())["sessions"] == 1
    assert not (bdir / "work").exists()
    # A backfill round: its own seed, run id, tasks and summary; one with no usable session is no failure.
    asyncio.run(loop._round(bdir, 4, "local:M", stop, 2))
    second = seen[1]
    assert (second.seed, second.run_id, [t.id for t in second.tasks]) == (200_011, "b004bf2", ["t1+bf2"])
    assert json.loads((bdir / "rollout-summary-bf2.json").read_text())["statuses"]["error"] == 1
    assert not (bdir / "work").exists()


def test_a_round_with_no_usable_session_or_stopped_by_a_signal_fails_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = _bare_loop(tmp_path, tasks=[])
    answers: list[RolloutResult] = []

    async def run_rollout(rollout: Any) -> RolloutResult:
        return answers.pop(0)

    monkeypatch.setattr(async_loop, "run_rollout", run_rollout)
    bdir = tmp_path / "out" / "batch-001"
    bdir.mkdir()
    stop = asyncio.Event()
    answers.append(_result([SessionStatus.ERROR, SessionStatus.ERROR]))
    with pytest.raises(
        RuntimeError, match=f"^batch 1: no session was usable \\(logs in {re.escape(str(bdir))}/logs\\)$"
    ):
        asyncio.run(loop._round(bdir, 1, "local:M", stop))
    # Cut by a push: whatever it finished is kept, even nothing.
    cut = _result([SessionStatus.ERROR], interrupted="stop")
    answers.append(cut)
    assert asyncio.run(loop._round(bdir, 1, "local:M", stop)) is cut
    answers.append(_result([SessionStatus.COMPLETED], interrupted="SIGTERM"))
    with pytest.raises(async_loop.RolloutInterrupted) as raised:
        asyncio.run(loop._round(bdir, 1, "local:M", stop, 1))
    assert str(raised.value) == f"batch 1: interrupted by SIGTERM (summary in {bdir})"
    assert raised.value.signal_name == "SIGTERM"
    assert json.loads((bdir / "rollout-summary-bf1.json").read_text())["interrupted"] == "SIGTERM"


def test_a_rounds_summary_never_shows_the_proxys_control_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _bare_loop(tmp_path, tasks=[])
    bdir = tmp_path / "out" / "batch-000"
    token = "ctl-" + "7" * 40

    async def run_rollout(rollout: Any) -> RolloutResult:
        # The proxy keeps its token next to the batch's store, and a run id can echo what the agent printed.
        Path(rollout.out).mkdir(parents=True)
        (Path(rollout.out) / ".control-token").write_text(token + "\n")
        rollout.progress.errors.append(("s0", f"the harness printed {token}"))  # shown in the progress file
        return RolloutResult(f"run {token}", _result([SessionStatus.COMPLETED]).sessions, 0.0, 1.0, rollout.out)

    monkeypatch.setattr(async_loop, "run_rollout", run_rollout)
    bdir.mkdir()
    asyncio.run(loop._round(bdir, 0, "local:M", asyncio.Event()))
    written = (bdir / "rollout-summary.json").read_text()
    assert token not in written and json.loads(written)["run_id"].startswith("run ")
    progress = (bdir / "rollout-progress.json").read_text()
    assert token not in progress and "the harness printed" in progress


def _fake_train(monkeypatch: pytest.MonkeyPatch, script: str) -> list[tuple[Any, ...]]:
    import sys

    calls: list[tuple[Any, ...]] = []

    def train_command(shards: list[Path], policy: Path, output: Path, args: list[str]) -> list[str]:
        calls.append((shards, policy, output, args))
        return [sys.executable, "-S", "-c", script, str(output)]

    monkeypatch.setattr(async_loop, "train_command", train_command)
    return calls


def test_a_training_runs_polar_train_told_the_version_and_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = _bare_loop(tmp_path, tasks=[], train_args=("--lr", "1e-5"), trackers_run="exp", train_cpus=frozenset({0}))
    idir = tmp_path / "out" / "train-002"
    (idir / "checkpoint").mkdir(parents=True)
    (idir / "checkpoint" / "old").write_text("a killed run's")
    script = (
        "import sys, os; print('stdout', os.path.exists(sys.argv[1]), sorted(os.sched_getaffinity(0))); "
        "sys.stderr.write('stderr\\n'); "
        "os.makedirs(sys.argv[1]); open(os.path.join(sys.argv[1], 'config.json'), 'w').write('{}')"
    )
    calls = _fake_train(monkeypatch, script)
    shards = [tmp_path / "out" / "batch-003" / "shards"]
    assert asyncio.run(loop._train(shards, tmp_path / "model", 5, idir)) == "trained"
    assert calls == [
        (
            shards,
            tmp_path / "model",
            idir / "checkpoint",
            ["--lr", "1e-5", "--run-name", "exp-train-002", "--current-weight-version", "5", "--max-staleness", "2"],
        )
    ]
    # The old checkpoint was cleared first; polar train runs on the train CPU set.
    assert (idir / "train.log").read_text() == "stdout False [0]\nstderr\n"
    assert sorted(p.name for p in (idir / "checkpoint").iterdir()) == ["config.json"]


def test_a_training_with_nothing_to_train_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _bare_loop(tmp_path, tasks=[])
    idir = tmp_path / "out" / "train-000"
    idir.mkdir()
    code = async_loop.EXIT_NOTHING_TO_TRAIN
    _fake_train(monkeypatch, f"import sys, os; os.makedirs(sys.argv[1]); sys.exit({code})")
    assert asyncio.run(loop._train([], tmp_path / "model", 0, idir)) == "nothing_to_train"
    assert not (idir / "checkpoint").exists()
    _fake_train(monkeypatch, f"import sys; sys.exit({code})")  # one that made no checkpoint directory at all
    assert asyncio.run(loop._train([], tmp_path / "model", 0, idir)) == "nothing_to_train"


def test_a_failed_training_says_its_exit_code_and_the_end_of_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = _bare_loop(tmp_path, tasks=[])
    idir = tmp_path / "out" / "train-000"
    idir.mkdir()
    _fake_train(monkeypatch, "import sys; sys.stdout.write('a' * 500 + 'b' * 3000); sys.exit(4)")
    with pytest.raises(RuntimeError) as raised:
        asyncio.run(loop._train([], tmp_path / "model", 0, idir))
    assert str(raised.value) == f"polar train exited 4 (log {idir / 'train.log'}):\n" + "b" * 3000
    # A log that is not UTF-8 (a crash half-way through a character) is still shown.
    _fake_train(monkeypatch, "import sys; sys.stdout.buffer.write(b'cut \\xe2\\x82 off'); sys.exit(1)")
    with pytest.raises(RuntimeError) as raised:
        asyncio.run(loop._train([], tmp_path / "model", 0, idir))
    assert str(raised.value).endswith(":\ncut \ufffd off")


def test_a_cancelled_training_kills_polar_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    loop = _bare_loop(tmp_path, tasks=[])
    idir = tmp_path / "out" / "train-000"
    idir.mkdir()
    _fake_train(monkeypatch, "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)")

    async def scenario() -> None:
        task = asyncio.create_task(loop._train([], tmp_path / "model", 0, idir))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if (idir / "train.log").read_text().strip():
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    pid = int((idir / "train.log").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running for a minute
        os.kill(pid, 0)
