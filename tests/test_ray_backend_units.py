"""`polar rollout --ray`'s driver and node worker (polar_cli.rollout.ray_backend) on a fake Ray: the placement, the
queue and its interleaving, a node's death, the early stop counted over every node, an interrupt, the sessions a
dead node held posted by the driver, and the stages display. No cluster, no proxy: the real ones are
tests/test_rollout_ray.py's (minutes)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

import polar_addon.store as store_package
from polar_addon.store.status import SessionStatus
from polar_cli.rollout import ray_backend
from polar_cli.rollout.config import RolloutConfig
from polar_cli.rollout.proxy import ExternalProxy
from polar_cli.rollout.ray_backend import (
    WORKER_LOST,
    NodeWorker,
    RayOptions,
    _Driver,
    _import_ray,
    cluster_nodes,
    run_rollout_ray,
)
from polar_cli.rollout.runner import plan_sessions
from polar_cli.rollout.session import PlannedSession, RolloutProgress, SessionResult
from polar_cli.rollout.tasks import Task

NODE_A = "a" * 40
NODE_B = "b" * 40


class ActorDied(Exception):
    """The fake's RayActorError."""


@dataclass(frozen=True)
class Affinity:
    node_id: str
    soft: bool


Script = Callable[["FakeWorker", PlannedSession], Awaitable[SessionResult]]


async def _complete(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
    await asyncio.sleep(0)
    return SessionResult(
        planned.session_id, planned.task.id, planned.task.id, planned.sample, SessionStatus.COMPLETED, reward=1.0,
        ran=True,
    )  # fmt: skip


class FakeWorker:
    """One node's actor: answers as the real NodeWorker would, as its script says."""

    def __init__(self, cluster: FakeRay, config: RolloutConfig, run_id: str, node: str) -> None:
        self.cluster, self.config, self.run_id, self.node = cluster, config, run_id, node
        self.ran: list[str] = []
        self.running = 0
        self.most = 0
        self.stopped: list[str] = []
        self.interrupts: list[str] = []
        self.closed = 0

    async def start(self) -> dict[str, Any]:
        failure = self.cluster.start_failures.get(self.node)
        if failure == "hang":
            await asyncio.Event().wait()
        if failure is not None:
            raise RuntimeError(failure)
        return {"node_id": self.node, "context_window": 4096, "max_output_tokens": 512}

    async def run(self, planned: PlannedSession) -> SessionResult:
        self.ran.append(planned.session_id)
        self.cluster.order.append((planned.session_id, self.node))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            result = await self.cluster.script(self, planned)
        finally:
            self.running -= 1
        result.node = self.node
        return result

    async def stop_group(self, group: str) -> None:
        self.stopped.append(group)

    async def stages(self) -> dict[str, int]:
        stages = self.cluster.stages.get(self.node)
        if isinstance(stages, Exception):
            raise stages
        return stages or {}

    async def interrupt(self, reason: str) -> None:
        self.interrupts.append(reason)

    async def close(self) -> None:
        self.closed += 1
        if self.node in self.cluster.close_fails:
            raise RuntimeError("the proxy would not stop")


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Future:
        return asyncio.ensure_future(self.fn(*args))  # awaited or not, as a Ray ObjectRef


class _Handle:
    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        for name in ("start", "run", "stop_group", "stages", "interrupt", "close"):
            setattr(self, name, _Method(getattr(worker, name)))


class _ActorClass:
    def __init__(self, cluster: FakeRay, cls: type) -> None:
        self.cluster, self.cls = cluster, cls
        self.chosen: dict[str, Any] = {}

    def options(self, **kwargs: Any) -> _ActorClass:
        self.cluster.options.append(kwargs)
        self.chosen = kwargs
        return self

    def remote(self, config: RolloutConfig, run_id: str, node: str) -> _Handle:
        assert self.chosen["scheduling_strategy"].node_id == node  # the options were made for this node
        handle = _Handle(FakeWorker(self.cluster, config, run_id, node))
        self.cluster.handles[node] = handle
        return handle


@dataclass
class FakeRay:
    alive: list[dict[str, Any]] = field(default_factory=list)
    initialized: bool = False
    script: Script = _complete
    start_failures: dict[str, str] = field(default_factory=dict)
    close_fails: set[str] = field(default_factory=set)
    stages: dict[str, Any] = field(default_factory=dict)
    inits: list[dict[str, Any]] = field(default_factory=list)
    shutdowns: int = 0
    remoted: list[type] = field(default_factory=list)
    options: list[dict[str, Any]] = field(default_factory=list)
    handles: dict[str, _Handle] = field(default_factory=dict)
    killed: list[_Handle] = field(default_factory=list)
    order: list[tuple[str, str]] = field(default_factory=list)
    exceptions: Any = field(default_factory=lambda: SimpleNamespace(RayActorError=ActorDied))

    def nodes(self) -> list[dict[str, Any]]:
        return self.alive

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs: Any) -> None:
        self.inits.append(kwargs)

    def shutdown(self) -> None:
        self.shutdowns += 1

    def remote(self, cls: type) -> _ActorClass:
        self.remoted.append(cls)
        return _ActorClass(self, cls)

    def kill(self, handle: _Handle) -> None:
        self.killed.append(handle)

    def worker(self, node: str) -> FakeWorker:
        return self.handles[node].worker


def _node(node_id: str, alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


@pytest.fixture
def ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay(alive=[_node(NODE_A, CPU=4), _node(NODE_B, CPU=2)])
    module = ModuleType("ray")
    module.__getattr__ = lambda name: getattr(fake, name)  # type: ignore[method-assign]
    util = ModuleType("ray.util")
    strategies = ModuleType("ray.util.scheduling_strategies")
    strategies.NodeAffinitySchedulingStrategy = Affinity  # type: ignore[attr-defined]
    for name, mod in (("ray", module), ("ray.util", util), ("ray.util.scheduling_strategies", strategies)):
        monkeypatch.setitem(sys.modules, name, mod)
    return fake


class FakeStore:
    """The TraceStore the driver opens to post the lost sessions."""

    opened: list[FakeStore] = []
    fail: set[str] = set()

    def __init__(self, out: str) -> None:
        self.out = out
        self.updates: list[tuple[str, dict[str, Any]]] = []
        self.closed = False
        FakeStore.opened.append(self)

    async def session_update(self, session_id: str, **kwargs: Any) -> None:
        assert not self.closed
        if session_id in FakeStore.fail:
            raise OSError("disk full")
        self.updates.append((session_id, kwargs))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> type[FakeStore]:
    FakeStore.opened = []
    FakeStore.fail = set()
    monkeypatch.setattr(store_package, "TraceStore", FakeStore)
    return FakeStore


def _tasks(*ids: str) -> list[Task]:
    return [Task(id=i, instruction=f"do {i}") for i in ids]


def _config(tmp_path: Path, **kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "tasks": _tasks("t1", "t2"),
        "harness": "cmd:true {instruction}",
        "engine": "scripted:x.json",
        "out": str(tmp_path / "store"),
        "runtime": "bwrap",
        "run_id": "r1",
        "concurrency": 1,
        "ready": 0,
        "stop_on_signals": False,
        "confdir": tmp_path / "conf",
    }
    return RolloutConfig(**(base | kw))


def _run(config: RolloutConfig, options: RayOptions | None = None) -> Any:
    return asyncio.run(run_rollout_ray(config, options or RayOptions("ray://head:10001")))


# -- Ray itself -----------------------------------------------------------------------------------------------------


def test_without_ray_the_error_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError) as missing:
        _import_ray()
    assert str(missing.value) == "--ray needs Ray: pip install 'polar[fleet]'"
    assert isinstance(missing.value.__cause__, ImportError)


def test_the_options_default_to_every_cpu_node_and_ten_minutes_to_start() -> None:
    assert RayOptions("auto") == RayOptions("auto", None, 600.0)


def test_the_nodes_are_the_alive_ones_with_a_cpu_or_the_resource() -> None:
    fake = FakeRay(
        alive=[
            _node("head", CPU=0),
            _node("w1", CPU=1),
            _node("w2", CPU=0.5, gpu_box=1),
            _node("dead", alive=False, CPU=8, gpu_box=1),
            {"NodeID": "bare", "Alive": True},
            {"NodeID": "w3", "Resources": {"CPU": 2}},  # no Alive: not alive
            _node("w4", CPU=16, gpu_box=0.25),
        ]
    )
    assert cluster_nodes(fake, None) == ["w1", "w4"]
    assert cluster_nodes(fake, "gpu_box") == ["w2", "w4"]


def test_no_node_to_run_on_is_an_error_that_counts_the_alive_nodes() -> None:
    fake = FakeRay(alive=[_node("head", CPU=0), _node("dead", alive=False, CPU=4), _node("x", CPU=0.5)])
    with pytest.raises(RuntimeError) as none:
        cluster_nodes(fake, None)
    assert str(none.value) == "no alive Ray node offers a CPU (nodes: 2)"
    with pytest.raises(RuntimeError) as none:
        cluster_nodes(fake, "tpu")
    assert str(none.value) == "no alive Ray node offers the resource 'tpu' (nodes: 2)"


# -- what is refused before anything starts -------------------------------------------------------------------------


def test_a_running_proxy_a_runtime_object_or_a_stop_event_is_refused(
    tmp_path: Path, ray: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("c")
    proxied = _config(tmp_path, engine=None, out=None, proxy=ExternalProxy("http://127.0.0.1:1", "t" * 16, ca=ca))
    with pytest.raises(ValueError) as refused:
        _run(proxied)
    assert str(refused.value) == "--ray starts a proxy on every node: give --engine and --out (not --proxy)"
    with pytest.raises(ValueError, match="no tasks"):  # the local runner's checks come first
        _run(_config(tmp_path, tasks=()))

    async def stopped() -> None:
        await run_rollout_ray(_config(tmp_path, stop=asyncio.Event()), RayOptions("auto"))

    with pytest.raises(ValueError) as refused:
        asyncio.run(stopped())
    assert str(refused.value) == "--ray does not take a stop event yet (polar loop --async runs locally)"

    class Runtime:
        pass

    with pytest.raises(ValueError) as refused:
        _run(_config(tmp_path, runtime=Runtime()))
    assert str(refused.value) == "--ray needs the runtime by name (each node starts its own)"
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match="runtime by name"):  # refused before Ray is imported
        _run(_config(tmp_path, runtime=Runtime()))
    assert ray.inits == [] and ray.handles == {}


def test_without_ray_installed_a_valid_rollout_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match="pip install 'polar\\[fleet\\]'"):
        _run(_config(tmp_path))


def test_a_running_proxy_is_refused_even_with_a_store(tmp_path: Path, ray: FakeRay) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("c")
    proxied = _config(tmp_path, engine=None, proxy=ExternalProxy("http://127.0.0.1:1", "t" * 16, ca=ca))
    with pytest.raises(ValueError, match="^--ray starts a proxy on every node"):
        _run(proxied)


# -- a rollout on the fake cluster ----------------------------------------------------------------------------------


def test_a_node_whose_close_fails_does_not_fail_the_rollout(tmp_path: Path, ray: FakeRay) -> None:
    ray.close_fails = {NODE_A}
    result = _run(_config(tmp_path, tasks=_tasks("t1", "t2", "t3")))
    assert [s.status for s in result.sessions] == [SessionStatus.COMPLETED] * 3
    assert ray.worker(NODE_A).closed == 1 and ray.worker(NODE_B).closed == 1 and len(ray.killed) == 2


def test_a_signal_that_cannot_be_handled_does_not_keep_the_other_from_being_handled(
    tmp_path: Path, ray: FakeRay
) -> None:
    added: list[signal.Signals] = []
    removed: list[signal.Signals] = []

    class Loop(asyncio.SelectorEventLoop):
        def add_signal_handler(self, sig: int, callback: Any, *args: Any) -> None:
            if sig == signal.SIGINT:
                raise NotImplementedError
            added.append(signal.Signals(sig))
            super().add_signal_handler(sig, callback, *args)

        def remove_signal_handler(self, sig: int) -> bool:
            removed.append(signal.Signals(sig))
            return super().remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=Loop) as runner:
        runner.run(run_rollout_ray(_config(tmp_path, stop_on_signals=True), RayOptions("auto")))
    assert added == [signal.SIGTERM] and removed == [signal.SIGTERM]


def test_one_pinned_worker_per_node_runs_the_sessions_and_the_result_is_in_plan_order(
    tmp_path: Path, ray: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    config = _config(
        tmp_path,
        tasks=_tasks("t1", "t2", "t3"),
        samples=2,
        out="store",  # relative: each node must get the same absolute path
        logs_dir=Path("logs"),
        work_dir=Path("work"),
        concurrency=2,
        ready=1,
        progress=RolloutProgress(),
    )
    result = _run(config, RayOptions("ray://head:10001"))
    assert ray.inits == [{"address": "ray://head:10001", "logging_level": logging.WARNING, "log_to_driver": False}]
    assert ray.shutdowns == 1 and ray.remoted == [NodeWorker]
    assert ray.options == [
        {
            "scheduling_strategy": Affinity(node, soft=False),
            "num_cpus": 0,
            "max_concurrency": 3 + 8,  # concurrency + ready sessions at once, and the driver's other calls
            "max_restarts": 0,
        }
        for node in (NODE_A, NODE_B)
    ]
    shipped = ray.worker(NODE_A).config
    assert ray.worker(NODE_B).config is shipped and ray.worker(NODE_A).run_id == "r1"
    assert shipped.out == str(tmp_path / "store") and result.store == str(tmp_path / "store")
    assert (shipped.logs_dir, shipped.work_dir) == (tmp_path / "logs", tmp_path / "work")
    assert (shipped.progress, shipped.tasks, shipped.proxy) == (None, (), None)
    # One control token for every node's proxy, made before any starts.
    assert (tmp_path / "store" / ".control-token").stat().st_mode & 0o777 == 0o600
    plan = plan_sessions(config, "r1")
    assert [s.session_id for s in result.sessions] == [p.session_id for p in plan]
    assert all(s.status == SessionStatus.COMPLETED and s.node in (NODE_A, NODE_B) for s in result.sessions)
    assert (result.run_id, result.context_window, result.max_output_tokens, result.interrupted) == (
        "r1",
        4096,
        512,
        None,
    )
    assert result.started_at <= result.ended_at
    progress = config.progress
    assert progress is not None and progress.total == 6 and progress.ran == 6
    assert progress.stages == {"pending": 0, "done": 6, "init": 0, "ready": 0, "run": 0, "postrun": 0}
    assert progress.statuses == {SessionStatus.COMPLETED: 6}
    assert sum(progress.nodes.values()) == 6 and set(progress.nodes) <= {NODE_A[:12], NODE_B[:12]}
    assert progress.group_rewards == {"t1": [1.0, 1.0], "t2": [1.0, 1.0], "t3": [1.0, 1.0]}
    for node in (NODE_A, NODE_B):
        assert ray.worker(node).closed == 1
    assert sorted(h.worker.node for h in ray.killed) == [NODE_A, NODE_B]


def test_the_first_sessions_go_one_per_node_and_a_node_takes_the_next_when_its_slot_frees(
    tmp_path: Path, ray: FakeRay
) -> None:
    release = {NODE_A: asyncio.Event, NODE_B: asyncio.Event}
    events: dict[str, asyncio.Event] = {}

    async def slow_b(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        if worker.node == NODE_B:  # node B holds its first session until A has run three
            event = events.setdefault(NODE_B, release[NODE_B]())
            while len(ray.worker(NODE_A).ran) < 3:
                await asyncio.sleep(0.001)
            event.set()
        return await _complete(worker, planned)

    ray.script = slow_b
    config = _config(tmp_path, tasks=_tasks("t1", "t2", "t3", "t4"), concurrency=1, ready=0)
    result = _run(config)
    plan = [p.session_id for p in plan_sessions(config, "r1")]
    assert ray.order[:2] == [(plan[0], NODE_A), (plan[1], NODE_B)]
    assert ray.worker(NODE_A).ran == [plan[0], plan[2], plan[3]] and ray.worker(NODE_B).ran == [plan[1]]
    assert ray.worker(NODE_A).most == 1  # one slot: concurrency 1, nothing ready ahead
    assert [s.node for s in result.sessions] == [NODE_A, NODE_B, NODE_A, NODE_A]


@pytest.mark.parametrize(("concurrency", "ready", "slots"), [(2, None, 4), (3, 0, 3), (1, 2, 3)])
def test_a_node_runs_concurrency_plus_ready_sessions_at_once(
    tmp_path: Path, ray: FakeRay, concurrency: int, ready: int | None, slots: int
) -> None:
    ray.alive = [_node(NODE_A, CPU=1)]

    async def hold(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        for _ in range(20):  # long enough for every free slot to be filled
            await asyncio.sleep(0)
        return await _complete(worker, planned)

    ray.script = hold
    result = _run(_config(tmp_path, tasks=_tasks(*(f"t{i}" for i in range(8))), concurrency=concurrency, ready=ready))
    assert ray.worker(NODE_A).most == slots and len(result.sessions) == 8
    assert ray.options[0]["max_concurrency"] == slots + 8


def test_a_remote_store_is_shipped_as_it_is_and_no_local_token_is_made(tmp_path: Path, ray: FakeRay) -> None:
    result = _run(_config(tmp_path, out="s3://bucket/run"))
    assert ray.worker(NODE_A).config.out == "s3://bucket/run" == result.store
    assert not (tmp_path / "conf").exists()  # each node's proxy makes (or reads) its own: no shared directory


def test_an_initialised_ray_is_neither_started_nor_shut_down(tmp_path: Path, ray: FakeRay) -> None:
    ray.initialized = True
    _run(_config(tmp_path))
    assert ray.inits == [] and ray.shutdowns == 0


def test_ray_is_shut_down_when_the_run_fails(tmp_path: Path, ray: FakeRay) -> None:
    ray.start_failures = {NODE_A: "no bwrap", NODE_B: "no disk"}
    with pytest.raises(RuntimeError) as failed:
        _run(_config(tmp_path))
    assert str(failed.value) == "no Ray node could start a worker: no bwrap"
    assert ray.shutdowns == 1 and len(ray.killed) == 2


def test_a_node_whose_worker_did_not_start_is_killed_and_left_out(
    tmp_path: Path, ray: FakeRay, caplog: pytest.LogCaptureFixture
) -> None:
    ray.start_failures = {NODE_A: "mitmdump failed"}
    with caplog.at_level(logging.ERROR, logger="polar.rollout"):
        result = _run(_config(tmp_path, tasks=_tasks("t1", "t2", "t3")))
    assert [h.worker.node for h in ray.killed].count(NODE_A) == 1 and ray.worker(NODE_A).ran == []
    assert [s.node for s in result.sessions] == [NODE_B] * 3
    assert ray.worker(NODE_A).closed == 0 and ray.worker(NODE_B).closed == 1
    assert f"polar rollout: node {NODE_A[:12]}: its worker did not start: mitmdump failed" in caplog.messages


def test_a_worker_that_does_not_start_in_time_fails_the_rollout(tmp_path: Path, ray: FakeRay) -> None:
    ray.start_failures = {NODE_B: "hang"}

    async def bounded() -> float:
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):  # the driver's own bound, or this test's at 10 s
            await asyncio.wait_for(run_rollout_ray(_config(tmp_path), RayOptions("auto", ready_s=0.2)), 10)
        return time.monotonic() - started

    assert asyncio.run(bounded()) < 5
    assert ray.shutdowns == 1


def test_only_the_nodes_with_the_resource_get_a_worker(tmp_path: Path, ray: FakeRay) -> None:
    ray.alive = [_node(NODE_A, CPU=4), _node(NODE_B, CPU=0, sandbox=2)]
    result = _run(_config(tmp_path), RayOptions("auto", resource="sandbox"))
    assert list(ray.handles) == [NODE_B] and {s.node for s in result.sessions} == {NODE_B}


# -- a node that dies -----------------------------------------------------------------------------------------------


def test_a_dying_node_loses_what_it_held_the_others_take_the_queue_and_the_lost_are_posted(
    tmp_path: Path, ray: FakeRay, store: type[FakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    async def a_dies(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        if worker.node == NODE_A:
            raise ActorDied("The actor died unexpectedly\nmore lines")
        for _ in range(5):
            await asyncio.sleep(0)
        return await _complete(worker, planned)

    ray.script = a_dies
    config = _config(
        tmp_path,
        tasks=_tasks("t1", "t2", "t3"),
        concurrency=1,
        ready=1,
        harness="cmd:python agent.py {instruction}",
        status_metadata={"iteration": 4, "node": "overridden"},
    )
    config.progress = RolloutProgress()
    with caplog.at_level(logging.ERROR, logger="polar.rollout"):
        result = _run(config)
    plan = plan_sessions(config, "r1")
    # Node A took two sessions at once (concurrency 1 + ready 1), both lost with it; B ran the third.
    lost = {p.session_id for p in plan} - set(ray.worker(NODE_B).ran)
    assert len(lost) == 2 and ray.worker(NODE_A).ran and set(ray.worker(NODE_A).ran) == lost
    by_id = {s.session_id: s for s in result.sessions}
    planned_of = {p.session_id: p for p in plan}
    for sid in lost:
        s = by_id[sid]
        assert (s.status, s.node, s.posted) == (SessionStatus.ERROR, NODE_A, True)
        assert (s.task_id, s.group_id, s.sample) == (s.session_id and planned_of[sid].task.id,) * 2 + (
            planned_of[sid].sample,
        )
        assert s.reason == f"its Ray worker (node {NODE_A[:12]}) died: ActorDied"
    [opened] = store.opened
    assert opened.out == str(tmp_path / "store") and opened.closed
    planned = {p.session_id: p for p in plan}
    assert sorted(sid for sid, _ in opened.updates) == sorted(lost)
    for sid, update in opened.updates:
        p = planned[sid]
        ended = update.pop("ended_at")
        assert result.started_at <= ended <= result.ended_at
        assert update == {
            "task_id": p.task.id,
            "group_id": p.task.id,
            "sample_index": p.sample,
            "status": SessionStatus.ERROR,
            "metadata": {
                "rollout": "r1",
                "task": p.task.id,
                "group": p.task.id,
                "sample": p.sample,
                "harness": "cmd",
                "iteration": 4,
                "reason": WORKER_LOST,
                "node": NODE_A,
            },
        }
    progress = config.progress
    assert list(progress.errors)[0] == (f"node {NODE_A[:12]}", "its Ray worker died")  # once, not per session
    assert [e for e in progress.errors if e[0].startswith("node ")] == [(f"node {NODE_A[:12]}", "its Ray worker died")]
    assert progress.statuses == {SessionStatus.COMPLETED: 1, SessionStatus.ERROR: 2}
    assert progress.stages["done"] == 3 and progress.ran == 1
    assert progress.nodes == {NODE_B[:12]: 1, NODE_A[:12]: 2}
    assert caplog.messages.count(f"polar rollout: node {NODE_A[:12]} lost: The actor died unexpectedly") == 1
    assert ray.worker(NODE_A).closed == 0 and [h.worker.node for h in ray.killed] == [NODE_B]


def test_when_every_node_dies_the_queue_is_lost_too(
    tmp_path: Path, ray: FakeRay, store: type[FakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    async def dies(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        raise ActorDied("x" * 300 + "\nsecond line")

    ray.script = dies
    config = _config(tmp_path, tasks=_tasks("t1", "t2", "t3"), harness="cmd:true")
    config.progress = RolloutProgress()
    with caplog.at_level(logging.ERROR, logger="polar.rollout"):
        result = _run(config)
    # Each node's loss is logged and shown once, its first line cut at 200 characters.
    assert [m for m in caplog.messages if " lost: " in m] == [
        f"polar rollout: node {n[:12]} lost: {'x' * 200}" for n in (NODE_A, NODE_B)
    ]
    assert [e for e in config.progress.errors if e[0].startswith("node ")] == [
        (f"node {n[:12]}", "its Ray worker died") for n in (NODE_A, NODE_B)
    ]
    reasons = [s.reason for s in result.sessions]
    assert reasons[:2] == [f"its Ray worker (node {n[:12]}) died: ActorDied" for n in (NODE_A, NODE_B)]
    assert reasons[2:] == ["no Ray worker left to run it"]
    assert [s.node for s in result.sessions] == [NODE_A, NODE_B, None]
    assert all(s.status == SessionStatus.ERROR and s.posted for s in result.sessions)
    assert [u["metadata"]["node"] for _, u in store.opened[0].updates] == [NODE_A, NODE_B, None]
    assert ray.killed == []


def test_a_lost_status_the_store_refuses_is_logged_and_not_posted(
    tmp_path: Path, ray: FakeRay, store: type[FakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    async def dies(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        raise ActorDied("gone")

    ray.script = dies
    config = _config(tmp_path, tasks=_tasks("t1", "t2"))
    first = plan_sessions(config, "r1")[0].session_id
    store.fail = {first}
    with caplog.at_level(logging.ERROR, logger="polar.rollout"):
        result = _run(config)
    assert [s.posted for s in result.sessions] == [False, True]
    assert f"polar rollout: {first}: status not stored: disk full" in caplog.messages
    assert store.opened[0].closed


def test_the_harness_named_in_a_lost_status_is_a_presets_name(
    tmp_path: Path, ray: FakeRay, store: type[FakeStore]
) -> None:
    async def dies(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        raise ActorDied("gone")

    ray.script = dies
    ray.alive = [_node(NODE_A, CPU=1)]
    _run(_config(tmp_path, tasks=_tasks("t1"), harness="codex:gpt-5"))
    assert store.opened[0].updates[0][1]["metadata"]["harness"] == "codex"
    _run(_config(tmp_path, tasks=_tasks("t1"), harness="cmd:python -c 'import a:b' {instruction}"))
    assert store.opened[-1].updates[0][1]["metadata"]["harness"] == "cmd"
    driver = _Driver(ray, _config(tmp_path, harness=SimpleNamespace(name="my-preset")), "r1", [], RolloutProgress(),
                     RayOptions("auto"))  # fmt: skip
    driver.lost = [(plan_sessions(_config(tmp_path), "r1")[0], "", "why")]
    asyncio.run(driver._post_lost())
    assert store.opened[-1].updates[0][1]["metadata"]["harness"] == "my-preset"


# -- the early stop, counted over every node ------------------------------------------------------------------------


def _result(planned: PlannedSession, status: SessionStatus, node: str | None = None, **kw: Any) -> SessionResult:
    return SessionResult(planned.session_id, planned.task.id, planned.task.id, planned.sample, status, node=node, **kw)


def _driver(tmp_path: Path, ray: FakeRay, **kw: Any) -> tuple[_Driver, list[PlannedSession]]:
    config = _config(tmp_path, **kw)
    plan = plan_sessions(config, "r1")
    progress = RolloutProgress(total=len(plan))
    progress.stages["pending"] = len(plan)
    driver = _Driver(ray, config, "r1", plan, progress, RayOptions("auto"))
    return driver, plan


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        recorder = self

        class _M:
            def remote(self, *args: Any) -> None:
                recorder.calls.append((name, args))

        return _M()


def test_a_group_stops_once_its_usable_sessions_reach_the_early_stop_on_every_node(
    tmp_path: Path, ray: FakeRay
) -> None:
    driver, plan = _driver(tmp_path, ray, tasks=_tasks("g1", "g2"), samples=4, early_stop=2)
    a, b = _Recorder(), _Recorder()
    driver.workers = {NODE_A: a, NODE_B: b}
    g1 = [p for p in plan if p.task.id == "g1"]
    driver._done(_result(g1[0], SessionStatus.COMPLETED, NODE_A, reward=1.0, ran=True))
    driver._done(_result(g1[1], SessionStatus.ERROR, NODE_B, ran=True))  # not usable: not counted
    driver._done(_result(g1[2], SessionStatus.CANCELLED))  # neither
    assert a.calls == [] and driver.usable == {"g1": 1}
    driver._done(_result(g1[3], SessionStatus.FAILED, NODE_B, reward=0.0, ran=True))
    assert a.calls == [("stop_group", ("g1",))] and b.calls == [("stop_group", ("g1",))]
    assert driver.stopped_groups == {"g1"}
    driver._done(_result(g1[3], SessionStatus.COMPLETED, NODE_A))  # a third usable one: no second stop
    assert len(a.calls) == 1 and driver.usable == {"g1": 3}
    progress = driver.progress
    assert progress.stages["done"] == 5 and progress.ran == 3
    assert progress.nodes == {NODE_A[:12]: 2, NODE_B[:12]: 2}


def test_without_early_stop_no_group_stops(tmp_path: Path, ray: FakeRay) -> None:
    driver, plan = _driver(tmp_path, ray, samples=3)
    a = _Recorder()
    driver.workers = {NODE_A: a}
    for p in plan:
        driver._done(_result(p, SessionStatus.COMPLETED, NODE_A, reward=1.0))
    assert a.calls == [] and driver.stopped_groups == set() and driver.usable == {"t1": 3, "t2": 3}


def test_a_stopped_groups_queued_sessions_are_never_handed_out(tmp_path: Path, ray: FakeRay) -> None:
    async def complete_then_wait(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        return await _complete(worker, planned)

    ray.alive = [_node(NODE_A, CPU=1)]
    ray.script = complete_then_wait
    config = _config(tmp_path, tasks=_tasks("g1", "g2"), samples=3, early_stop=1)
    config.progress = RolloutProgress()
    result = _run(config)
    statuses = [(s.group_id, s.sample, s.status) for s in result.sessions]
    assert statuses == [
        ("g1", 0, SessionStatus.COMPLETED),
        ("g1", 1, SessionStatus.CANCELLED),
        ("g1", 2, SessionStatus.CANCELLED),
        ("g2", 0, SessionStatus.COMPLETED),
        ("g2", 1, SessionStatus.CANCELLED),
        ("g2", 2, SessionStatus.CANCELLED),
    ]
    cancelled = [s for s in result.sessions if s.status == SessionStatus.CANCELLED]
    assert {s.reason for s in cancelled} == {"early stop: the group had enough usable sessions before it ran"}
    assert all(s.node is None and not s.ran and s.task_id == s.group_id for s in cancelled)
    assert len(ray.worker(NODE_A).ran) == 2 and ray.worker(NODE_A).stopped == ["g1", "g2"]
    assert config.progress.stages["pending"] == 0 and config.progress.stages["done"] == 6


# -- an interrupt ---------------------------------------------------------------------------------------------------


def test_an_interrupt_cancels_the_queue_before_init_and_every_nodes_sessions_once(
    tmp_path: Path, ray: FakeRay, caplog: pytest.LogCaptureFixture
) -> None:
    driver, plan = _driver(tmp_path, ray, tasks=_tasks("t1", "t2", "t3"))
    a, b = _Recorder(), _Recorder()
    driver.workers = {NODE_A: a, NODE_B: b}
    driver.queue.popleft()  # handed out already
    with caplog.at_level(logging.WARNING, logger="polar.rollout"):
        driver.interrupt("SIGTERM")
        driver.interrupt("SIGINT")  # a second signal changes nothing
    assert driver.interrupted == "SIGTERM" and not driver.queue
    assert a.calls == [("interrupt", ("SIGTERM",))] and b.calls == [("interrupt", ("SIGTERM",))]
    assert sorted(driver.results) == sorted(p.session_id for p in plan[1:])
    for p in plan[1:]:
        r = driver.results[p.session_id]
        assert (r.status, r.reason, r.task_id, r.group_id, r.sample) == (
            SessionStatus.CANCELLED,
            "interrupted by SIGTERM before INIT",
            p.task.id,
            p.task.id,
            p.sample,
        )
    assert driver.progress.stages["pending"] == 0 and driver.progress.stages["done"] == 2
    assert caplog.messages == [
        "polar rollout: SIGTERM: stopping (running sessions are cancelled, their statuses posted)"
    ]


def test_sigint_interrupts_a_rollout_that_handles_signals_and_the_handlers_go_after(
    tmp_path: Path, ray: FakeRay
) -> None:
    async def interrupted(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        if not worker.interrupts:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(500):  # bounded: a driver that never interrupts fails the test, not hangs it
                if worker.interrupts:
                    break
                await asyncio.sleep(0.01)
        return _result(planned, SessionStatus.CANCELLED, reason="interrupted by SIGINT")

    ray.alive = [_node(NODE_A, CPU=1)]
    ray.script = interrupted
    before = signal.getsignal(signal.SIGINT)
    result = _run(_config(tmp_path, tasks=_tasks("t1", "t2", "t3"), stop_on_signals=True))
    assert result.interrupted == "SIGINT" and ray.worker(NODE_A).interrupts == ["SIGINT"]
    assert [s.reason for s in result.sessions] == ["interrupted by SIGINT"] + ["interrupted by SIGINT before INIT"] * 2
    assert signal.getsignal(signal.SIGINT) is before


def test_without_signal_handling_the_handlers_are_left_alone(tmp_path: Path, ray: FakeRay) -> None:
    seen: list[Any] = []

    async def look(worker: FakeWorker, planned: PlannedSession) -> SessionResult:
        seen.append(signal.getsignal(signal.SIGTERM))
        return await _complete(worker, planned)

    before = signal.getsignal(signal.SIGTERM)
    ray.script = look
    _run(_config(tmp_path, tasks=_tasks("t1"), stop_on_signals=False))
    _run(_config(tmp_path, tasks=_tasks("t1"), stop_on_signals=True))
    assert seen[0] is before and seen[1] is not before


# -- the stages display ---------------------------------------------------------------------------------------------


def test_the_stages_are_summed_over_the_alive_nodes_only(tmp_path: Path, ray: FakeRay) -> None:
    driver, _ = _driver(tmp_path, ray)
    driver.workers = {NODE_A: object(), NODE_B: object()}
    driver.node_stages = {
        NODE_A: {"init": 1, "run": 2, "postrun": 1},
        NODE_B: {"ready": 3, "run": 1, "done": 9},
        "c" * 40: {"run": 5},  # a node gone
    }
    driver.progress.stages["done"] = 4
    driver._refresh()
    assert driver.progress.stages == {"pending": 2, "done": 4, "init": 1, "ready": 3, "run": 3, "postrun": 1}


def test_the_poller_asks_every_node_and_forgets_one_that_fails(tmp_path: Path, ray: FakeRay) -> None:
    driver, _ = _driver(tmp_path, ray)

    async def poll() -> None:
        ray.stages = {NODE_A: {"run": 2}, NODE_B: RuntimeError("dying")}
        driver.workers = {
            node: _Handle(FakeWorker(ray, driver.config, "r1", node)) for node in (NODE_A, NODE_B)
        }  # fmt: skip
        driver.node_stages[NODE_B] = {"run": 7}
        task = asyncio.create_task(driver._poll_stages())
        for _ in range(50):
            await asyncio.sleep(0.01)
            if NODE_B not in driver.node_stages:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(poll())
    assert driver.node_stages == {NODE_A: {"run": 2}} and driver.progress.stages["run"] == 2


def test_the_poller_waits_five_seconds_a_node_and_asks_again_every_half_second(
    tmp_path: Path, ray: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, _ = _driver(tmp_path, ray)
    bounds: list[float] = []
    pauses: list[float] = []
    real = asyncio

    async def wait_for(awaitable: Awaitable[Any], timeout: float) -> Any:
        bounds.append(timeout)
        return await real.wait_for(awaitable, timeout)

    async def sleep(delay: float) -> None:
        pauses.append(delay)
        if len(pauses) == 3:
            raise real.CancelledError
        await real.sleep(0)

    async def poll() -> None:
        # A node that fails on its very first poll (no stages kept for it yet) does not stop the poller.
        ray.stages = {NODE_A: RuntimeError("dying"), NODE_B: {"run": 1}}
        driver.workers = {
            node: _Handle(FakeWorker(ray, driver.config, "r1", node)) for node in (NODE_A, NODE_B)
        }  # fmt: skip
        with pytest.raises(real.CancelledError):
            await driver._poll_stages()

    monkeypatch.setattr(ray_backend, "asyncio", SimpleNamespace(wait_for=wait_for, sleep=sleep))
    asyncio.run(poll())
    assert bounds == [5, 5] * 3 and pauses == [0.5] * 3
    assert driver.node_stages == {NODE_B: {"run": 1}}


# -- the node's worker ----------------------------------------------------------------------------------------------


class FakeRunner:
    def __init__(self) -> None:
        self.progress = RolloutProgress()
        self.stopped: list[str] = []
        self.interrupted: list[str] = []
        self.gate = asyncio.Event()

    async def drive(self, planned: PlannedSession, slots: asyncio.Semaphore) -> SessionResult:
        assert isinstance(slots, asyncio.Semaphore)
        await self.gate.wait()
        return _result(planned, SessionStatus.COMPLETED, reward=1.0)

    def stop_group(self, group: str) -> None:
        self.stopped.append(group)

    def interrupt(self, reason: str) -> None:
        self.interrupted.append(reason)


def _worker(tmp_path: Path) -> tuple[NodeWorker, FakeRunner]:
    worker = NodeWorker(_config(tmp_path), "r1", NODE_A)
    runner = FakeRunner()
    worker.runner, worker.slots = runner, asyncio.Semaphore(1)
    return worker, runner


def test_a_node_worker_before_its_start_has_no_stages_and_ignores_stops(tmp_path: Path) -> None:
    worker = NodeWorker(_config(tmp_path), "r1", NODE_A)
    assert (worker.config.run_id, worker.run_id, worker.node_id, worker.runner, worker.slots) == (
        "r1",
        "r1",
        NODE_A,
        None,
        None,
    )
    assert worker.jobs == set()
    asyncio.run(worker.stop_group("g"))
    asyncio.run(worker.interrupt("SIGINT"))
    assert asyncio.run(worker.stages()) == {}
    asyncio.run(worker.close())  # nothing started: nothing to close


def test_a_node_worker_runs_a_session_names_its_node_and_forgets_the_job(tmp_path: Path) -> None:
    plan = plan_sessions(_config(tmp_path), "r1")

    async def go() -> None:
        worker, runner = _worker(tmp_path)
        job = asyncio.create_task(worker.run(plan[0]))
        await asyncio.sleep(0.01)
        assert worker.jobs == {job}
        runner.gate.set()
        result = await job
        assert result.node == NODE_A and result.status == SessionStatus.COMPLETED and worker.jobs == set()

    asyncio.run(go())


def test_a_node_worker_passes_stops_and_interrupts_to_its_runner_and_cancels_its_jobs(tmp_path: Path) -> None:
    plan = plan_sessions(_config(tmp_path), "r1")

    async def go() -> None:
        worker, runner = _worker(tmp_path)
        await worker.stop_group("t2")
        assert runner.stopped == ["t2"]
        jobs = [asyncio.create_task(worker.run(p)) for p in plan]
        await asyncio.sleep(0.01)
        assert len(worker.jobs) == 2
        await worker.interrupt("SIGTERM")
        assert runner.interrupted == ["SIGTERM"]
        for job in jobs:
            with pytest.raises(asyncio.CancelledError):
                await job
        assert worker.jobs == set()

    asyncio.run(go())


def test_a_node_workers_stages_leave_out_pending_and_done(tmp_path: Path) -> None:
    worker, runner = _worker(tmp_path)
    runner.progress.stages.update({"pending": 4, "init": 1, "ready": 2, "run": 3, "postrun": 1, "done": 7})
    assert asyncio.run(worker.stages()) == {"init": 1, "ready": 2, "run": 3, "postrun": 1}


def test_a_node_worker_closes_everything_even_after_a_failed_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker, _ = _worker(tmp_path)
    closed: list[str] = []

    async def fails() -> None:
        closed.append("control")
        raise OSError("connection reset")

    async def runtime() -> None:
        closed.append("runtime")

    worker.closers = [fails, runtime]
    worker.stack.callback(closed.append, "proxy")
    with caplog.at_level(logging.WARNING, logger="polar.rollout"):
        asyncio.run(worker.close())
    assert closed == ["control", "runtime", "proxy"]
    assert caplog.messages == [f"polar rollout: node {NODE_A[:12]}: close failed: connection reset"]


def test_the_driver_starts_with_an_empty_state(tmp_path: Path, ray: FakeRay) -> None:
    driver, plan = _driver(tmp_path, ray)
    assert list(driver.queue) == plan and driver.results == {} and driver.lost == []
    assert (driver.interrupted, driver.window, driver.output_cap) == (None, None, None)
    assert driver.workers == {} and driver.node_stages == {} and driver.stopped_groups == set()
    assert driver.usable == {} and driver.options == RayOptions("auto") and driver.run_id == "r1"
    assert ray_backend.WORKER_LOST == "worker_lost"
