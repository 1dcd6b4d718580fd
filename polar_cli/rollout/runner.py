"""The rollout runner: a harness over a task set, N samples per task, in sandboxes, verified and rewarded.

:func:`run_rollout` starts (or joins) the proxy, plans the sessions (:func:`plan_sessions`) and runs them through
the local pipeline (:class:`LocalPipeline`): bounded workers over one
:class:`~polar_cli.rollout.session.SessionRunner`, whose module explains the stages (INIT, READY, RUN, POSTRUN) and
the statuses. ``ray_backend`` runs the same :class:`SessionRunner` on each node of a Ray cluster, and the loops
(``loop``, ``async_loop``) call :func:`run_rollout` once per batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import signal
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from polar_addon.store.status import MASKED, REWARDED, RUNNER_STATUSES, USABLE
from polar_cli.rollout.config import RolloutConfig, make_run_id
from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.proxy import ControlClient, start_proxy
from polar_cli.rollout.runtimes import get_runtime
from polar_cli.rollout.runtimes.base import ProxyEndpoints, Runtime
from polar_cli.rollout.session import PlannedSession, RolloutProgress, Session, SessionResult, SessionRunner
from polar_cli.rollout.tasks import Task
from polar_cli.rollout.window import engine_window

# What callers import from here: the config and the session's result types (they live in config and session).
__all__ = [
    "LocalPipeline",
    "PlannedSession",
    "RolloutConfig",
    "RolloutInterrupted",
    "RolloutProgress",
    "RolloutResult",
    "SessionResult",
    "budget",
    "check_config",
    "check_runtime",
    "plan_sessions",
    "rollout_run_id",
    "run_rollout",
    "session_ids",
]


@dataclass
class RolloutResult:
    run_id: str
    sessions: list[SessionResult]
    started_at: float
    ended_at: float
    store: str | None
    context_window: int | None = None  # what the harnesses were told (given or read from the engine)
    max_output_tokens: int | None = None
    interrupted: str | None = None  # the signal that stopped the run (SIGINT, SIGTERM), None when it ran out

    def counts(self) -> dict[str, int]:
        counts = Counter(s.status for s in self.sessions)
        return {status: counts.get(status, 0) for status in RUNNER_STATUSES}

    def group_rewards(self) -> dict[str, list[float]]:
        groups: dict[str, list[float]] = {}
        for s in self.sessions:
            groups.setdefault(s.group_id, [])
            if s.status in REWARDED and s.reward is not None:
                groups[s.group_id].append(s.reward)
        return groups

    def group_masked(self) -> dict[str, tuple[int, int]]:
        """group -> (masked sessions, sessions): how much of each group a trainer never sees."""
        groups: dict[str, tuple[int, int]] = {}
        for s in self.sessions:
            masked, total = groups.get(s.group_id, (0, 0))
            groups[s.group_id] = (masked + (s.status in MASKED), total + 1)
        return groups

    @property
    def all_failed(self) -> bool:
        return not any(s.status in USABLE for s in self.sessions)

    def summary(self) -> dict[str, Any]:
        rewards = [s.reward for s in self.sessions if s.status in REWARDED and s.reward is not None]
        minutes = max(self.ended_at - self.started_at, 1e-9) / 60
        masked = self.group_masked()
        return {
            "run_id": self.run_id, "store": self.store, "sessions": len(self.sessions), "statuses": self.counts(),
            "context_window": self.context_window, "max_output_tokens": self.max_output_tokens,
            "interrupted": self.interrupted,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "mask_rate": sum(m for m, _ in masked.values()) / len(self.sessions) if self.sessions else None,
            "groups": {g: {"rewards": r, "mean": sum(r) / len(r) if r else None, "sessions": masked[g][1],
                           "masked": masked[g][0], "mask_rate": masked[g][0] / masked[g][1]}
                       for g, r in sorted(self.group_rewards().items())},
            "sessions_per_minute": sum(s.ran for s in self.sessions) / minutes,
            "seconds": self.ended_at - self.started_at,
            "session_results": [asdict(s) for s in self.sessions],
        }  # fmt: skip


class RolloutInterrupted(RuntimeError):
    """A rollout stopped by a signal (its sessions ended, their statuses posted)."""

    def __init__(self, message: str, signal_name: str) -> None:
        super().__init__(message)
        self.signal_name = signal_name


def rollout_run_id(config: RolloutConfig) -> str:
    return config.run_id or make_run_id(config.seed)


def plan_sessions(config: RolloutConfig, run_id: str) -> list[PlannedSession]:
    """Every session of ``config``, in the order they start (``seed`` shuffles the tasks)."""
    tasks = list(config.tasks)
    if config.seed is not None:
        random.Random(config.seed).shuffle(tasks)
    return [
        PlannedSession(task, sample, sid, i)
        for i, (task, sample, sid) in enumerate(session_ids(tasks, config.samples, run_id))
    ]


def session_ids(tasks: Sequence[Task], samples: int, run_id: str) -> list[tuple[Task, int, str]]:
    """(task, sample, session id) for every session; ids are ``RUN-TASKHASH-SAMPLE`` (task ids may hold characters a
    session id may not)."""
    out = []
    for task in tasks:
        digest = hashlib.sha256(task.id.encode()).hexdigest()[:10]
        out.extend((task, s, f"{run_id}-{digest}-{s}") for s in range(samples))
    return out


async def run_rollout(config: RolloutConfig) -> RolloutResult:
    """Run every session of ``config`` to an end (completed, timeout, error or cancelled) and return them all."""
    check_config(config)
    preset = get_preset(config.harness) if isinstance(config.harness, str) else config.harness
    runtime = (
        get_runtime(config.runtime, **dict(config.runtime_options))
        if isinstance(config.runtime, str)
        else config.runtime
    )
    check_runtime(config.tasks, runtime)
    run_id = rollout_run_id(config)
    plan = plan_sessions(config, run_id)
    async with AsyncExitStack() as stack:
        # Absolute: git, sandboxes and harnesses run with other working directories (a relative --out failed INIT).
        work_dir = Path(config.work_dir).resolve() if config.work_dir is not None else None
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polar-rollout-")))
        work_dir.mkdir(parents=True, exist_ok=True)
        endpoints, token = await stack.enter_async_context(_proxy(config, work_dir))
        control = ControlClient(endpoints.forward_port, token)
        stack.push_async_callback(control.aclose)
        stack.push_async_callback(runtime.close)
        window, output_cap = await budget(config)
        runner = SessionRunner(config, preset, runtime, endpoints, control, work_dir, run_id, window, output_cap)
        pipeline = LocalPipeline(runner)
        started = time.time()
        with _signals_interrupt(pipeline, config.stop_on_signals), _stop_interrupts(pipeline, config.stop):
            sessions = await pipeline.run(plan)
        return RolloutResult(
            run_id,
            [s.result for s in sessions],
            started,
            time.time(),
            config.out if config.proxy is None else None,
            window,
            output_cap,
            runner.interrupted,
        )


@contextmanager
def _signals_interrupt(pipeline: LocalPipeline, enabled: bool) -> Iterator[None]:
    """While the sessions run, SIGINT and SIGTERM interrupt the runner instead of killing the process (whose
    sessions would stay ``running`` in the store, their sandboxes and harnesses alive)."""
    loop = asyncio.get_running_loop()
    installed = []
    if enabled:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, pipeline.interrupt, sig.name)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such support
                continue
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextmanager
def _stop_interrupts(pipeline: LocalPipeline, stop: asyncio.Event | None) -> Iterator[None]:
    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        pipeline.interrupt("stop")

    watcher = asyncio.create_task(watch(stop)) if stop is not None else None
    try:
        yield
    finally:
        if watcher is not None:
            watcher.cancel()


async def budget(config: RolloutConfig) -> tuple[int | None, int | None]:
    """The window and output cap the harnesses are told: given, else what the started proxy serves."""
    window = config.context_window
    if window is None and config.engine is not None:
        window = await asyncio.to_thread(engine_window, config.engine)
    output_cap = config.max_output_tokens
    if output_cap is None and config.engine is not None:
        output_cap = int(config.proxy_options.get("polar_max_tokens") or 0) or None
    return window, output_cap


def check_runtime(tasks: Sequence[Task], runtime: Runtime) -> None:
    """Refuse, before any session runs, tasks the runtime cannot verify: Harbor's tests need /tests and /logs at
    their absolute paths (a harness run that could never be scored would only cost its time)."""
    harbor = [t.id for t in tasks if t.format == "harbor"]
    if harbor and not runtime.places_directories:
        raise ValueError(
            f"Harbor tasks ({', '.join(harbor[:3])}{', ...' if len(harbor) > 3 else ''}) need /tests and "
            f"/logs at absolute paths, which the {runtime.name} runtime cannot place: use --runtime bwrap "
            "or --runtime oci"
        )


def check_config(config: RolloutConfig) -> None:
    if not config.tasks:
        raise ValueError("no tasks")
    if config.samples < 1:
        raise ValueError("samples must be at least 1")
    if config.concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    # Zero tries would end every session as an infrastructure error without running anything.
    for name in ("init_attempts", "verify_attempts"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name.replace('_', ' ')} must be at least 1")
    if config.ready is not None and config.ready < 0:
        raise ValueError("ready must be 0 or more")
    if config.early_stop is not None and not 1 <= config.early_stop <= config.samples:
        raise ValueError(f"early_stop must be between 1 and samples ({config.samples})")
    if config.timeout_s is not None and config.timeout_s <= 0:
        raise ValueError("timeout must be positive")
    for name in ("context_window", "max_output_tokens"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"{name.replace('_', ' ')} must be at least 1")
    if config.context_window and config.max_output_tokens and config.max_output_tokens >= config.context_window:
        raise ValueError("max output tokens must be below the context window (the prompt needs room)")
    if (config.engine is None) == (config.proxy is None):
        raise ValueError("give an engine (the runner starts a proxy) or a running proxy, not both")
    if config.engine is not None and not config.out:
        raise ValueError("a started proxy needs a store (out)")


@asynccontextmanager
async def _proxy(config: RolloutConfig, work_dir: Path) -> AsyncIterator[tuple[ProxyEndpoints, str]]:
    if config.proxy is not None:
        yield config.proxy.endpoints(), config.proxy.control_token
        return
    assert config.engine is not None and config.out is not None
    manager = start_proxy(
        config.engine,
        config.out,
        confdir=Path(config.confdir),
        log_dir=config.logs_dir or work_dir,
        options=dict(config.proxy_options),
    )
    started = await asyncio.to_thread(manager.__enter__)
    try:
        yield started.endpoints, started.control_token
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


class LocalPipeline:
    """The local scheduler: bounded workers that move sessions through one :class:`SessionRunner`'s stages.
    ``init_concurrency`` INIT workers fill the READY buffer (at most ``ready`` sessions in INIT or READY at once),
    ``concurrency`` RUN slots take from it (``ready=0``: each slot prepares its own session first), and each session
    that ran goes on to POSTRUN (bounded by the runner's ``postrun_concurrency``) while its slot takes the next."""

    def __init__(self, runner: SessionRunner) -> None:
        self.runner = runner
        config = runner.config
        self.ready_n = config.concurrency if config.ready is None else config.ready
        self.init_workers = max(config.init_concurrency or min(self.ready_n, config.concurrency), 1)
        self.pending: deque[Session] = deque()
        self.ready: asyncio.Queue[Session | None] = asyncio.Queue()
        self.slots = asyncio.Semaphore(max(self.ready_n, 1))  # sessions in INIT or READY
        self.jobs: set[asyncio.Task] = set()  # every worker and POSTRUN
        self.task: asyncio.Task | None = None

    def interrupt(self, reason: str) -> None:
        """Stop the run: nothing new starts, running harnesses and verifiers are killed; :meth:`run` then ends every
        session as ``cancelled`` and returns."""
        if self.runner.interrupt(reason) and self.task is not None:
            self.task.cancel()

    async def run(self, plan: Sequence[PlannedSession]) -> list[Session]:
        """Every session of ``plan`` to an end, in plan order."""
        runner = self.runner
        sessions = [runner.open(p) for p in plan]
        self.pending.extend(sessions)
        self.task = asyncio.create_task(self._all())
        try:
            await self.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if runner.interrupted is None or (current is not None and current.cancelling()):
                raise  # the caller cancelled us, not a signal
        finally:
            jobs = [job for job in self.jobs if not job.done()]
            for job in jobs:
                job.cancel()
            if jobs:
                # Their own cleanup first: each kills its harness's or verifier's process tree.
                await asyncio.wait(jobs, timeout=60)
            for session in sessions:  # an interrupted run leaves no sandbox behind
                await runner.teardown(session)
        if runner.interrupted is not None:
            await runner.end_interrupted(sessions)
        return sessions

    def _spawn(self, work: Any) -> asyncio.Task:
        job = asyncio.create_task(work)
        self.jobs.add(job)
        return job

    async def _all(self) -> None:
        run_slots = [self._spawn(self._run_slot()) for _ in range(self.runner.config.concurrency)]
        if self.ready_n > 0:
            await asyncio.gather(*(self._spawn(self._init_worker()) for _ in range(self.init_workers)))
            for _ in run_slots:
                await self.ready.put(None)
        await asyncio.gather(*run_slots)
        while postruns := [job for job in self.jobs if not job.done()]:
            await asyncio.gather(*postruns)

    async def _init_worker(self) -> None:
        while self.pending:
            await self.slots.acquire()
            if not self.pending:
                self.slots.release()
                return
            session = self.pending.popleft()
            if await self.runner.init(session):
                self.runner.ready(session)
                await self.ready.put(session)
            else:
                self.slots.release()

    async def _run_slot(self) -> None:
        runner = self.runner
        while True:
            if self.ready_n == 0:
                if not self.pending:
                    return
                session = self.pending.popleft()
                if not await runner.init(session):
                    continue
            else:
                item = await self.ready.get()
                if item is None:
                    return
                session = item
                self.slots.release()
            if await runner.run(session):
                self._spawn(runner.postrun(session))
