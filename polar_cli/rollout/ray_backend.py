"""``polar rollout --ray ADDRESS``: the rollout's sessions run on a Ray cluster, one worker actor per node.

Each actor (pinned to its node, exactly one per node: see Placement below) starts its own proxy on
that node's loopback (mitmdump + the polar addon, as the local runner does) writing to the one shared store (a
directory every node sees at the same path, or an ``s3://`` URI), and runs the sessions the driver hands it through
the same stages and code as the local runner (``session.SessionRunner.drive``): at most ``concurrency`` harnesses
at once per node, ``ready`` more in INIT/READY. The sandboxes reach only their own node's proxy: no central gateway
on the data path; the driver only hands out sessions and gathers their results.

The queue stays with the driver: a node takes a new session only when one of its slots is free. When a node dies,
its queued sessions were never handed out (other nodes take them); the sessions it held end ``error``, posted by the
driver straight into the store (metadata ``reason: worker_lost``, masked for training) once Ray reports the actor
dead. The dead proxy's journal holds everything it acknowledged; the driver's store adopts and seals it (the trace
store's crash recovery), so nothing acknowledged is lost and nothing is written twice.

Placement: a hard pin per node (``NodeAffinitySchedulingStrategy``), not Ray's ``SPREAD``. SPREAD is best effort:
two actors may land on one node (say a node still joining, or another job's tasks in flux), which then runs two
proxies and twice ``concurrency`` harnesses while another node idles: the over-packing that pushed a public run's
errors from 4% to 54% (128 containers on one node). A ``STRICT_SPREAD`` placement group would give one bundle per
node, but it waits until every bundle fits at once (one busy node holds the whole run back) and re-places a dead
node's bundle elsewhere. The pin gives exactly one worker, one proxy and ``concurrency`` RUN slots per node; the
sessions themselves are spread by the driver's queue (a node takes one whenever a slot frees, so faster nodes take
more), and per-session Ray tasks are not used because each would need its own proxy. Nodes that join after the
start are not used by that run.

Credentials for an ``s3://`` store are each node's own (the environment ``ray start`` ran with, ``~/.aws``, an
instance role), as for any code Ray runs there: the driver's ``AWS_*`` variables are not shipped (they would
override a node's role and travel through the cluster's control plane).

Nodes: every alive node with at least one CPU (start a head node with ``--num-cpus 0`` to keep sessions off it), or
the nodes offering ``resource`` when given. Ray itself is the optional ``fleet`` extra.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import time
from collections import Counter, deque
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polar_addon.store.status import USABLE, SessionStatus
from polar_cli.rollout.runner import (
    PlannedSession,
    RolloutConfig,
    RolloutProgress,
    RolloutResult,
    SessionResult,
    check_config,
    plan_sessions,
    rollout_run_id,
)

log = logging.getLogger("polar.rollout")

WORKER_LOST = "worker_lost"


@dataclass(frozen=True)
class RayOptions:
    address: str  # the cluster's address (``ray start --head`` printed it), or ``auto``
    resource: str | None = None  # only nodes offering this custom resource (``ray start --resources``)
    ready_s: float = 600.0  # how long a node's worker may take to start its proxy


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # the optional extra
        raise RuntimeError("--ray needs Ray: pip install 'polar[fleet]'") from exc
    return ray


class NodeWorker:
    """One node's worker (a Ray actor): its own proxy and runner; sessions arrive one call at a time."""

    def __init__(self, config: RolloutConfig, run_id: str, node_id: str) -> None:
        self.config, self.run_id, self.node_id = config, run_id, node_id
        self.stack = ExitStack()
        self.runner: Any = None
        self.slots: asyncio.Semaphore | None = None
        self.jobs: set[asyncio.Task] = set()

    async def start(self) -> dict[str, Any]:
        """Start this node's proxy; its process ids (the tests kill them) and the budget the harnesses are told."""
        from polar_cli.rollout.harnesses import get_preset
        from polar_cli.rollout.proxy import ControlClient, start_proxy
        from polar_cli.rollout.runner import budget
        from polar_cli.rollout.runtimes import get_runtime
        from polar_cli.rollout.session import SessionRunner

        config = self.config
        if config.work_dir is not None:
            work_dir = Path(config.work_dir) / f"node-{self.node_id[:12]}"
        else:
            work_dir = Path(self.stack.enter_context(tempfile.TemporaryDirectory(prefix="polar-rollout-")))
        work_dir.mkdir(parents=True, exist_ok=True)
        # A CA per node: nodes may share a home directory, and two mitmdumps creating one CA at once would race.
        confdir = Path(config.confdir).expanduser() / f"node-{self.node_id[:12]}"
        assert config.engine is not None and config.out is not None
        started = await asyncio.to_thread(
            self.stack.enter_context,
            start_proxy(
                config.engine,
                config.out,
                confdir=confdir,
                log_dir=Path(config.logs_dir or work_dir),
                options=dict(config.proxy_options),
            ),
        )
        control = ControlClient(started.endpoints.forward_port, started.control_token)
        preset = get_preset(config.harness) if isinstance(config.harness, str) else config.harness
        runtime = (
            get_runtime(config.runtime, **dict(config.runtime_options))
            if isinstance(config.runtime, str)
            else config.runtime
        )
        window, output_cap = await budget(config)
        self.closers = [control.aclose, runtime.close]
        # Every status this node posts names it (the store shows where each session ran).
        local = replace(
            config,
            progress=RolloutProgress(),
            stop_on_signals=False,
            status_metadata={**config.status_metadata, "node": self.node_id},
        )
        self.runner = SessionRunner(
            local, preset, runtime, started.endpoints, control, work_dir, self.run_id, window, output_cap
        )
        self.slots = asyncio.Semaphore(config.concurrency)
        return {
            "node_id": self.node_id,
            "pid": os.getpid(),
            "proxy_pid": started.process.pid,
            "context_window": window,
            "max_output_tokens": output_cap,
        }

    async def run(self, planned: PlannedSession) -> SessionResult:
        assert self.runner is not None and self.slots is not None
        job = asyncio.current_task()
        assert job is not None
        self.jobs.add(job)
        try:
            result = await self.runner.drive(planned, self.slots)
        finally:
            self.jobs.discard(job)
        result.node = self.node_id
        return result

    async def stop_group(self, group: str) -> None:
        """The driver's early stop (it counts usable sessions over every node): cancel this node's stragglers."""
        if self.runner is not None:
            self.runner.stop_group(group)

    async def stages(self) -> dict[str, int]:
        """Sessions in each stage on this node (the driver's display)."""
        if self.runner is None:
            return {}
        return {k: v for k, v in self.runner.progress.stages.items() if k not in ("pending", "done")}

    async def interrupt(self, reason: str) -> None:
        """Cancel every session here: each ends ``cancelled`` (posted when it ran) and its call returns."""
        if self.runner is not None:
            self.runner.interrupt(reason)
        for job in list(self.jobs):
            job.cancel()

    async def close(self) -> None:
        for close in getattr(self, "closers", []):
            try:
                await close()
            except Exception as exc:
                log.warning("polar rollout: node %s: close failed: %s", self.node_id[:12], exc)
        # The proxy stops gracefully: its open shard is sealed before the actor goes.
        await asyncio.to_thread(self.stack.close)


def cluster_nodes(ray: Any, resource: str | None) -> list[str]:
    """The ids of the alive nodes that run sessions."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if resource is not None:
        chosen = [n["NodeID"] for n in nodes if n.get("Resources", {}).get(resource, 0) > 0]
    else:
        chosen = [n["NodeID"] for n in nodes if n.get("Resources", {}).get("CPU", 0) >= 1]
    if not chosen:
        what = f"the resource {resource!r}" if resource else "a CPU"
        raise RuntimeError(f"no alive Ray node offers {what} (nodes: {len(nodes)})")
    return chosen


async def run_rollout_ray(config: RolloutConfig, options: RayOptions) -> RolloutResult:
    """Run every session of ``config`` on the Ray cluster at ``options.address``: the same sessions, statuses,
    store rows and :class:`RolloutResult` as :func:`runner.run_rollout`, each session's ``node`` set."""
    check_config(config)
    if config.engine is None or config.out is None:
        raise ValueError("--ray starts a proxy on every node: give --engine and --out (not --proxy)")
    if not isinstance(config.runtime, str):
        raise ValueError("--ray needs the runtime by name (each node starts its own)")
    ray = _import_ray()
    from polar_addon.control import load_or_create_token, token_file
    from polar_addon.store.shards import Output

    out = config.out if "://" in config.out else str(Path(config.out).resolve())
    if Output.local_root(out) is not None:
        # One token for every node's proxy, written before any starts (two proxies creating it at once would race).
        load_or_create_token(token_file(out, str(config.confdir)))
    run_id = rollout_run_id(config)
    plan = plan_sessions(config, run_id)
    progress = config.progress or RolloutProgress()
    progress.total = len(plan)
    progress.stages["pending"] = len(plan)
    if config.stop is not None:
        raise ValueError("--ray does not take a stop event yet (polar loop --async runs locally)")
    shipped = replace(
        config,
        out=out,
        progress=None,
        tasks=(),
        proxy=None,
        logs_dir=Path(config.logs_dir).resolve() if config.logs_dir else None,
        work_dir=Path(config.work_dir).resolve() if config.work_dir else None,
    )

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=options.address, logging_level=logging.WARNING, log_to_driver=False)
    driver = _Driver(ray, shipped, run_id, plan, progress, options)
    started = time.time()
    loop = asyncio.get_running_loop()
    installed = []
    if config.stop_on_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, driver.interrupt, sig.name)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
    try:
        results = await driver.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if started_ray:
            ray.shutdown()
    return RolloutResult(
        run_id, results, started, time.time(), out, driver.window, driver.output_cap, driver.interrupted
    )


class _Driver:
    def __init__(
        self,
        ray: Any,
        config: RolloutConfig,
        run_id: str,
        plan: list[PlannedSession],
        progress: RolloutProgress,
        options: RayOptions,
    ) -> None:
        self.ray, self.config, self.run_id, self.plan, self.progress = ray, config, run_id, plan, progress
        self.options = options
        self.queue: deque[PlannedSession] = deque(plan)
        self.results: dict[str, SessionResult] = {}
        self.lost: list[tuple[PlannedSession, str, str]] = []  # (session, node, why)
        self.interrupted: str | None = None
        self.workers: dict[str, Any] = {}  # node id -> actor handle (alive ones)
        self.window: int | None = None
        self.output_cap: int | None = None
        self.node_stages: dict[str, dict[str, int]] = {}
        self.usable: Counter = Counter()  # per group, over every node (--early-stop)
        self.stopped_groups: set[str] = set()

    def interrupt(self, reason: str) -> None:
        if self.interrupted is not None:
            return
        log.warning("polar rollout: %s: stopping (running sessions are cancelled, their statuses posted)", reason)
        self.interrupted = reason
        for planned in self.queue:  # never handed out: cancelled before INIT
            self._done(
                SessionResult(
                    planned.session_id,
                    planned.task.id,
                    planned.task.id,
                    planned.sample,
                    SessionStatus.CANCELLED,
                    reason=f"interrupted by {reason} before INIT",
                )
            )
        self.queue.clear()
        self.progress.stages["pending"] = 0
        for worker in self.workers.values():
            worker.interrupt.remote(reason)

    async def run(self) -> list[SessionResult]:
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_class = ray.remote(NodeWorker)
        nodes = cluster_nodes(ray, self.options.resource)
        per_node = self.config.concurrency + (
            self.config.concurrency if self.config.ready is None else self.config.ready
        )
        handles = {
            node: actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                num_cpus=0,
                max_concurrency=per_node + 8,
                max_restarts=0,
            ).remote(self.config, self.run_id, node)
            for node in nodes
        }
        infos = await asyncio.wait_for(
            asyncio.gather(*(h.start.remote() for h in handles.values()), return_exceptions=True), self.options.ready_s
        )
        for (node, handle), info in zip(handles.items(), infos):
            if isinstance(info, BaseException):
                log.error("polar rollout: node %s: its worker did not start: %s", node[:12], info)
                ray.kill(handle)
                continue
            self.workers[node] = handle
            self.window, self.output_cap = info["context_window"], info["max_output_tokens"]
        if not self.workers:
            raise RuntimeError(f"no Ray node could start a worker: {infos[0]}")
        poller = asyncio.create_task(self._poll_stages())
        try:
            # Slots interleaved across nodes: the first sessions go one per node, not all to the first node.
            await asyncio.gather(*(self._feed(node) for _ in range(per_node) for node in list(self.workers)))
        finally:
            poller.cancel()
        if self.queue:  # every node died: what is left never ran
            for planned in list(self.queue):
                self.lost.append((planned, "", "no Ray worker left to run it"))
            self.queue.clear()
        if self.lost:
            await self._post_lost()
        await asyncio.gather(*(w.close.remote() for w in self.workers.values()), return_exceptions=True)
        for worker in self.workers.values():
            ray.kill(worker)
        self._refresh()
        return [self.results[p.session_id] for p in self.plan]

    async def _feed(self, node: str) -> None:
        """One of ``node``'s slots: hand it the next queued session whenever it finished the last."""
        ray = self.ray
        while self.queue and node in self.workers:
            planned = self.queue.popleft()
            self.progress.stages["pending"] -= 1
            if planned.task.id in self.stopped_groups:  # never handed out: its group stopped early
                self._done(
                    SessionResult(
                        planned.session_id,
                        planned.task.id,
                        planned.task.id,
                        planned.sample,
                        SessionStatus.CANCELLED,
                        reason="early stop: the group had enough usable sessions before it ran",
                    )
                )
                continue
            try:
                result = await self.workers[node].run.remote(planned)
            except ray.exceptions.RayActorError as exc:
                # The node (or its worker) died holding this session: it may have run; it is not run again.
                if self.workers.pop(node, None) is not None:
                    log.error("polar rollout: node %s lost: %s", node[:12], str(exc).splitlines()[0][:200])
                    self.progress.errors.append((f"node {node[:12]}", "its Ray worker died"))
                self.lost.append((planned, node, f"its Ray worker (node {node[:12]}) died: {type(exc).__name__}"))
                continue
            self._done(result)

    def _done(self, result: SessionResult) -> None:
        self.results[result.session_id] = result
        progress = self.progress
        progress.stages["done"] += 1
        progress.count(result)
        if result.ran:
            progress.ran += 1
        if result.node:
            progress.nodes[result.node[:12]] += 1
        if result.status in USABLE:
            self.usable[result.group_id] += 1
            early = self.config.early_stop
            if early and self.usable[result.group_id] >= early and result.group_id not in self.stopped_groups:
                # Counted over every node (a node's own runner sees only its share): every node cancels the
                # group's stragglers; the queue never hands its other sessions out.
                self.stopped_groups.add(result.group_id)
                for worker in self.workers.values():
                    worker.stop_group.remote(result.group_id)

    async def _poll_stages(self) -> None:
        while True:
            for node, worker in list(self.workers.items()):
                try:
                    self.node_stages[node] = await asyncio.wait_for(worker.stages.remote(), 5)
                except Exception:  # a dying node: its feeders report it
                    self.node_stages.pop(node, None)
            self._refresh()
            await asyncio.sleep(0.5)

    def _refresh(self) -> None:
        stages = self.progress.stages
        for name in ("init", "ready", "run", "postrun"):
            stages[name] = sum(s.get(name, 0) for node, s in self.node_stages.items() if node in self.workers)

    async def _post_lost(self) -> None:
        """The lost sessions end ``error`` in the store, written by the driver itself (their node's proxy is gone).
        Opening the store also adopts the dead proxies' journals: what they acknowledged is sealed into shards."""
        from polar_addon.store import TraceStore

        preset_name = getattr(self.config.harness, "name", None) or str(self.config.harness).split(":", 1)[0]
        store = await asyncio.to_thread(TraceStore, self.config.out)
        try:
            for planned, node, why in self.lost:
                result = SessionResult(
                    planned.session_id,
                    planned.task.id,
                    planned.task.id,
                    planned.sample,
                    SessionStatus.ERROR,
                    reason=why,
                    node=node or None,
                )
                metadata = {
                    "rollout": self.run_id,
                    "task": planned.task.id,
                    "group": planned.task.id,
                    "sample": planned.sample,
                    "harness": preset_name,
                    **self.config.status_metadata,
                    "reason": WORKER_LOST,
                    "node": node or None,
                }
                try:
                    await store.session_update(
                        planned.session_id,
                        task_id=planned.task.id,
                        group_id=planned.task.id,
                        sample_index=planned.sample,
                        status=SessionStatus.ERROR,
                        ended_at=time.time(),
                        metadata=metadata,
                    )
                    result.posted = True
                except Exception as exc:
                    log.error("polar rollout: %s: status not stored: %s", planned.session_id, exc)
                self._done(result)
        finally:
            await asyncio.to_thread(store.close)
