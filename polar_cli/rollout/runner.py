"""The rollout runner: a harness over a task set, N samples per task, in sandboxes, verified and rewarded.

Stages, each with its own bound:

- INIT (``init_concurrency`` workers): start the runtime's sandbox, copy or clone the workspace, run the task's setup,
  snapshot the workspace, write the harness's config into the session's HOME. Infrastructure failures here are
  retried (``init_attempts``): nothing has run yet.
- READY: prepared sessions waiting for a run slot; at most ``ready`` sessions are in INIT or READY at once
  (``ready=0``: no buffer, each run slot prepares its own session first).
- RUN (``concurrency`` slots): the harness, once, under one deadline (``timeout_s``, else the task's agent timeout).
  A session that ran is never re-run, so a group stays whole.
- POSTRUN (``postrun_concurrency``): the agent's patch (``git diff`` of the workspace against its start), verified in
  a FRESH sandbox of the task (the task's workspace, its setup, the patch; Harbor's tests at ``/tests``), the
  verifier's reward and the session's status posted to the proxy with the control token, teardown.

The verifier also sees the harness's stdout (its final answer in print mode), as Harbor's verifiers see its agent
logs: saved by the runner, outside the workspace, so the agent's patch cannot plant another. Every verify command
gets its path in ``POLAR_AGENT_OUTPUT``; Harbor tasks also find it at ``/logs/agent/stdout.txt``.

Statuses (``SessionResult.status``; what is posted to the store in brackets): ``completed`` (reward from the
verifier; a verifier that left no readable reward, or ran past its timeout, scores 0: the code under test could
have caused either), ``failed`` [``agent_error``] (the harness exited non-zero, was killed by a signal from inside,
or produced nothing: exit 0 with no stdout and no change to the workspace; the policy's failure, reward 0, trained),
``timeout`` (the deadline ended the harness; its traces so far are kept; the policy's failure, trained with reward
0), ``error`` (only what polar can prove is infrastructure: the sandbox or setup failed, the runtime failed under
the harness, the runner cancelled it, the verifier's sandbox could not be started or its env resolved, the proxy
ended the session (its engine was taken out): masked), ``cancelled`` (``early_stop``: the group already had
enough usable sessions; posted as ``error`` with ``metadata.cancelled``, since the store's vocabulary has no such
status and the trace is partial). Sessions that never ran (cancelled or failed before RUN) made no calls; a failed
one is still posted as ``error`` so the store knows its group lost a member. The rule behind the split: a policy
must never gain by failing loudly, so whatever the sandbox's own processes can bring about (an exit code, a
signal, a killed or silent verifier, a memory blow-up) is a reward of 0, never a mask; an infrastructure failure
misread as ``failed`` before the first model call costs nothing, as such a session has no trace to train.

Interruption: SIGINT/SIGTERM (``stop_on_signals``) stop the run: nothing new starts, running harnesses and
verifiers are killed, every unfinished session ends ``cancelled`` (posted as ``error`` with ``metadata.cancelled``
when it ran, so none stays ``running`` in the store), and ``RolloutResult.interrupted`` names the signal.

Rewards come from the verifier only: the control token never enters a sandbox, and the harness gets no way to post
one (the proxy refuses posts without the token).

Identity: INIT registers every session (task, group = the task id, sample) with the proxy, which answers its secret;
``SessionContext`` carries only that secret (the preset puts it in the API key and the forward proxy's credentials), and
the proxy takes the labels from the registration, so an agent can neither write into a sibling's session nor relabel
its own. ``seed`` fixes session ids and task order.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import posixpath
import random
import shutil
import signal
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from polar_cli.rollout import workspace as ws
from polar_cli.rollout.config import RolloutConfig, make_run_id
from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext
from polar_cli.rollout.proxy import ControlClient, check_sessions_mode, start_proxy
from polar_cli.rollout.runtimes import get_runtime
from polar_cli.rollout.runtimes.base import (
    ExecResult,
    IsolatedSandbox,
    NetworkMode,
    ProxyEndpoints,
    Runtime,
    Sandbox,
    SandboxSpec,
)
from polar_cli.rollout.tasks import Task
from polar_cli.rollout.verify import (
    VERIFY_GUARD,
    NoReward,
    VerifierError,
    file_rewards,
    guard_left,
    harbor_rewards,
    read_reward_file,
    resolve_env,
)
from polar_cli.rollout.window import engine_window

log = logging.getLogger("polar.rollout")

Status = Literal["completed", "failed", "timeout", "error", "cancelled"]
STATUSES: tuple[str, ...] = ("completed", "failed", "timeout", "error", "cancelled")
USABLE = ("completed", "failed", "timeout")  # sessions a trainer learns from (error and cancelled are masked)
REWARDED = ("completed", "failed")  # sessions whose reward the runner knows (failed: 0)
MASKED = ("error", "cancelled")
# The store's name of each status the runner posts (the store has no "cancelled", and names a failed harness so).
STORE_STATUS = {"failed": "agent_error", "cancelled": "error"}
STAGES = ("pending", "init", "ready", "run", "postrun", "done")
_LOG_TAIL = 2000
AGENT_OUTPUT_ENV = "POLAR_AGENT_OUTPUT"  # the verify command's path to the harness's stdout
HARBOR_AGENT_DIR = "/logs/agent"  # Harbor's agent log directory (harbor/models/trial/paths.py)
AGENT_OUTPUT_NAME = "stdout.txt"


@dataclass
class SessionResult:
    session_id: str
    task_id: str
    group_id: str
    sample: int
    status: Status
    reward: float | None = None  # the verifier's outcome reward (``completed`` only)
    rewards: dict[str, float] = field(default_factory=dict)  # every reward the verifier gave, by name
    ran: bool = False  # the harness started (never re-run)
    exit_code: int | None = None  # the harness's
    reason: str | None = None  # why, for anything but a plain completed session
    init_attempts: int = 0
    patch_bytes: int = 0
    posted: bool = False  # status (and reward) stored through the proxy
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage: init, wait, run, postrun
    node: str | None = None  # the Ray node that ran it (``polar rollout --ray``)


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
        return {status: counts.get(status, 0) for status in STATUSES}

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


@dataclass
class RolloutProgress:
    """Live counters a display polls (the runner mutates them; one event loop, no locks needed)."""

    total: int = 0
    stages: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    group_rewards: dict[str, list[float]] = field(default_factory=dict)
    errors: deque = field(default_factory=lambda: deque(maxlen=5))  # (session, reason), most recent last
    started_at: float = field(default_factory=time.time)
    ran: int = 0
    nodes: Counter = field(default_factory=Counter)  # finished sessions per Ray node (``--ray``; empty otherwise)

    def move(self, before: str | None, after: str) -> None:
        if before is not None:
            self.stages[before] -= 1
        self.stages[after] += 1

    def sessions_per_minute(self) -> float:
        done = self.stages.get("done", 0)
        return done / max((time.time() - self.started_at) / 60, 1e-9)


class RolloutInterrupted(RuntimeError):
    """A rollout stopped by a signal (its sessions ended, their statuses posted)."""

    def __init__(self, message: str, signal_name: str) -> None:
        super().__init__(message)
        self.signal_name = signal_name


@dataclass
class _Session:
    task: Task
    sample: int
    session_id: str
    index: int
    result: SessionResult
    dir: Path | None = None
    sandbox: Sandbox | None = None
    home: Path | None = None
    workspace: Path | None = None
    base_tree: str | None = None
    ctx: SessionContext | None = None
    stage: str = "pending"
    ready_at: float = 0.0
    agent_output: str = ""  # the harness's stdout, for the verifier
    failure: str | None = None  # why POSTRUN scored a ``failed`` session 0 (the stored metadata.reason)


@dataclass(frozen=True)
class PlannedSession:
    """One session of a rollout's plan: what an executor (this module's, or ``ray_backend``'s) runs."""

    task: Task
    sample: int
    session_id: str
    index: int


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
        runner = _Runner(config, preset, runtime, endpoints, control, work_dir, run_id, window, output_cap)
        started = time.time()
        with _signals_interrupt(runner, config.stop_on_signals), _stop_interrupts(runner, config.stop):
            sessions = await runner.run(plan)
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
def _signals_interrupt(runner: _Runner, enabled: bool) -> Iterator[None]:
    """While the sessions run, SIGINT and SIGTERM interrupt the runner instead of killing the process (whose
    sessions would stay ``running`` in the store, their sandboxes and harnesses alive)."""
    loop = asyncio.get_running_loop()
    installed = []
    if enabled:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, runner.interrupt, sig.name)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such support
                continue
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextmanager
def _stop_interrupts(runner: _Runner, stop: asyncio.Event | None) -> Iterator[None]:
    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        runner.interrupt("stop")

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


class _Runner:
    def __init__(
        self,
        config: RolloutConfig,
        preset: HarnessPreset,
        runtime: Runtime,
        endpoints: ProxyEndpoints,
        control: ControlClient,
        work_dir: Path,
        run_id: str,
        context_window: int | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        self.config, self.preset, self.runtime = config, preset, runtime
        self.context_window, self.max_output_tokens = context_window, max_output_tokens
        self.endpoints, self.control, self.work_dir, self.run_id = endpoints, control, work_dir, run_id
        # A claimed-mode proxy lets agents forge identities: used only for a --proxy the user said to trust.
        self.trust_claimed = config.proxy is not None and config.proxy.trust_claimed
        self.network: NetworkMode = config.network or getattr(runtime, "default_network", "proxy-only")
        self.progress = config.progress or RolloutProgress()
        self.ready_n = config.concurrency if config.ready is None else config.ready
        self.postrun = asyncio.Semaphore(config.postrun_concurrency or config.concurrency)
        self.templates: dict[str, Path | None] = {}
        self.template_locks: dict[str, asyncio.Lock] = {}
        self.usable: Counter = Counter()
        self.stopped_groups: set[str] = set()
        self.running: dict[str, list[_Session]] = {}
        self.cancels: set[asyncio.Task] = set()  # early-stop cancels in flight (held so they are not collected)
        self.interrupted: str | None = None  # the signal that stopped the run
        self.pipeline: asyncio.Task | None = None

    def interrupt(self, reason: str) -> None:
        """Stop the run: nothing new starts, running harnesses and verifiers are killed; :meth:`run` then ends every
        session as ``cancelled`` and returns."""
        if self.interrupted is not None:
            log.warning("polar rollout: %s again: already stopping", reason)
            return
        log.warning("polar rollout: %s: stopping (running sessions are cancelled, their statuses posted)", reason)
        self.interrupted = reason
        if self.pipeline is not None:
            self.pipeline.cancel()

    # -- the pipeline -------------------------------------------------------------------------------------------

    async def run(self, plan: Sequence[PlannedSession]) -> list[_Session]:
        sessions = [
            _Session(
                p.task,
                p.sample,
                p.session_id,
                p.index,
                SessionResult(p.session_id, p.task.id, p.task.id, p.sample, "error"),
            )
            for p in plan
        ]
        self.progress.total = len(sessions)
        self.progress.stages["pending"] = len(sessions)
        pending: deque[_Session] = deque(sessions)
        ready: asyncio.Queue[_Session | None] = asyncio.Queue()
        postruns: set[asyncio.Task] = set()

        async def run_slot() -> None:
            while True:
                if self.ready_n == 0:
                    if not pending:
                        return
                    session = pending.popleft()
                    if not await self._init(session):
                        continue
                else:
                    item = await ready.get()
                    if item is None:
                        return
                    session = item
                    slots.release()
                if await self._run(session):
                    job = asyncio.create_task(self._postrun(session))
                    postruns.add(job)
                    job.add_done_callback(postruns.discard)

        slots = asyncio.Semaphore(max(self.ready_n, 1))

        async def init_worker() -> None:
            while pending:
                await slots.acquire()
                if not pending:
                    slots.release()
                    return
                session = pending.popleft()
                if await self._init(session):
                    self._move(session, "ready")
                    await ready.put(session)
                else:
                    slots.release()

        init_workers = self.config.init_concurrency or min(self.ready_n, self.config.concurrency)
        runners: list[asyncio.Task] = []
        inits: list[asyncio.Task] = []

        async def pipeline() -> None:
            runners.extend(asyncio.create_task(run_slot()) for _ in range(self.config.concurrency))
            if self.ready_n > 0:
                inits.extend(asyncio.create_task(init_worker()) for _ in range(max(init_workers, 1)))
                await asyncio.gather(*inits)
                for _ in runners:
                    await ready.put(None)
            await asyncio.gather(*runners)
            while postruns:
                await asyncio.gather(*list(postruns))

        self.pipeline = asyncio.create_task(pipeline())
        try:
            await self.pipeline
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.interrupted is None or (current is not None and current.cancelling()):
                raise  # the caller cancelled us, not a signal
        finally:
            jobs = [job for job in (*runners, *inits, *postruns) if not job.done()]
            for job in jobs:
                job.cancel()
            if jobs:
                # Their own cleanup first: each kills its harness's or verifier's process tree.
                await asyncio.wait(jobs, timeout=60)
            for session in sessions:  # an interrupted run leaves no sandbox behind
                await self._teardown(session)
        if self.interrupted is not None:
            await self._end_interrupted(sessions)
        return sessions

    async def run_one(self, planned: PlannedSession, run_slots: asyncio.Semaphore) -> SessionResult:
        """One session through INIT -> READY -> RUN (under ``run_slots``) -> POSTRUN, for an executor that hands out
        sessions one at a time (``ray_backend``: as many at once as RUN slots plus READY). Cancelled (an
        interrupt), it ends ``cancelled``, posted as ``error`` when the harness ran, as :meth:`run` does."""
        p = planned
        session = _Session(
            p.task,
            p.sample,
            p.session_id,
            p.index,
            SessionResult(p.session_id, p.task.id, p.task.id, p.sample, "error"),
        )
        self.progress.total += 1
        self.progress.stages["pending"] += 1
        try:
            if await self._init(session):
                self._move(session, "ready")
                async with run_slots:
                    go_on = await self._run(session)
                if go_on:
                    await self._postrun(session)
        except asyncio.CancelledError:
            await self._teardown(session)
            self.interrupted = self.interrupted or "cancelled"
            await self._end_interrupted([session])
        return session.result

    async def _end_interrupted(self, sessions: list[_Session]) -> None:
        """Every session the interruption caught ends ``cancelled``; each that ran (so the store knows it) gets a
        final status, which nothing else would post: no session stays ``running`` in the store."""
        for session in sessions:
            if session.stage != "done":
                stage = session.stage
                self._finish(session, "cancelled", f"interrupted by {self.interrupted} in {stage.upper()}")
                if session.result.ran:
                    await self._post_status(
                        session,
                        "error",
                        {"reason": "interrupted", "cancelled": True, "signal": self.interrupted, "stage": stage},
                    )
            elif session.result.ran and not session.result.posted:  # it ended, but the interruption cut its post
                status = session.result.status
                await self._post_status(
                    session, STORE_STATUS.get(status, status), {"reason": "interrupted", "signal": self.interrupted}
                )

    def _refinish(self, session: _Session, status: Status, reason: str) -> None:
        """Change a finished session's status (the store's final word differs): counts, rewards and the early-stop
        tally as if it had ended so."""
        old = session.result.status
        self.progress.statuses[old] -= 1
        group = session.task.id
        if old in REWARDED and session.result.reward is not None:
            rewards = self.progress.group_rewards.get(group, [])
            if session.result.reward in rewards:
                rewards.remove(session.result.reward)
        if old in USABLE:
            self.usable[group] -= 1
        session.result.status, session.result.reason = status, reason
        self.progress.statuses[status] += 1
        if status == "error":
            self.progress.errors.append((session.session_id, reason.splitlines()[0][:200]))

    def _move(self, session: _Session, stage: str) -> None:
        self.progress.move(session.stage, stage)
        session.stage = stage

    def _finish(self, session: _Session, status: Status, reason: str | None = None) -> None:
        session.result.status = status
        session.result.reason = reason
        self._move(session, "done")
        self.progress.statuses[status] += 1
        group = session.task.id
        rewards = self.progress.group_rewards.setdefault(group, [])
        if status in REWARDED and session.result.reward is not None:
            rewards.append(session.result.reward)
        if status == "error" and reason:
            self.progress.errors.append((session.session_id, reason.splitlines()[0][:200]))
        if status in USABLE:
            self.usable[group] += 1

    def _stop_if_enough(self, session: _Session) -> None:
        """Early stop once ``session``'s group has M usable sessions. Asked only after its status was posted: the
        store may answer error (_refinish), and a session that is not usable must not cancel its group's others."""
        group = session.task.id
        if self.config.early_stop and self.usable[group] >= self.config.early_stop:
            self.stop_group(group)

    def stop_group(self, group: str) -> None:
        """Early stop of ``group``: its running harnesses are cancelled (ending ``cancelled``, masked), its sessions
        not yet running never run. Also called by a Ray driver that counted the group's usable sessions over every
        node (ray_backend)."""
        if group in self.stopped_groups:
            return
        self.stopped_groups.add(group)
        for other in self.running.get(group, []):
            if other.sandbox is not None:
                job = asyncio.create_task(other.sandbox.cancel())
                self.cancels.add(job)
                job.add_done_callback(self.cancels.discard)

    # -- INIT -----------------------------------------------------------------------------------------------------

    async def _init(self, session: _Session) -> bool:
        """Prepare ``session`` (retrying infrastructure failures); False when it ended here."""
        self._move(session, "init")
        started = time.monotonic()
        reason = ""
        for attempt in range(1, self.config.init_attempts + 1):
            if session.task.id in self.stopped_groups:
                self._finish(session, "cancelled", "early stop: the group had enough usable sessions before it ran")
                return False
            session.result.init_attempts = attempt
            try:
                await self._prepare(session)
                session.result.timings["init"] = time.monotonic() - started
                session.ready_at = time.monotonic()
                return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure before the harness ran is retried, bounded
                reason = f"INIT attempt {attempt}: {type(exc).__name__}: {exc}"
                log.warning("polar rollout: %s: %s", session.session_id, reason)
                await self._teardown(session)
                if attempt < self.config.init_attempts:
                    await asyncio.sleep(min(0.5 * attempt, 5.0))
        session.result.timings["init"] = time.monotonic() - started
        self._finish(session, "error", f"INIT failed {self.config.init_attempts} times; last: {reason}")
        await self._post_status(session, "error", {"reason": "init_failed"})
        return False

    async def _template(self, task: Task) -> Path | None:
        lock = self.template_locks.setdefault(task.id, asyncio.Lock())
        async with lock:
            if task.id not in self.templates:
                cache = self.work_dir / "templates" / hashlib.sha256(task.id.encode()).hexdigest()[:16]
                self.templates[task.id] = await ws.prepare_template(task, cache)
            return self.templates[task.id]

    def _spec(
        self,
        task: Task,
        name: str,
        workspace: Path,
        home: Path,
        binds: Mapping[str, Path] | None = None,
        env: Mapping[str, str] | None = None,
        read_only_binds: Mapping[str, Path] | None = None,
    ) -> SandboxSpec:
        read_only = (*self.config.read_only, *getattr(self.preset, "read_only", ()))
        return SandboxSpec(name=name, workspace=workspace, home=home, proxy=self.endpoints, network=self.network,
                           image=task.image, dockerfile=task.dockerfile, workdir=task.workdir, cpus=task.cpus,
                           memory_mb=task.memory_mb, read_only=tuple(read_only), binds=dict(binds or {}),
                           read_only_binds=dict(read_only_binds or {}), env=dict(env or {}))  # fmt: skip

    async def _prepare(self, session: _Session) -> None:
        task = session.task
        # Registered first: the labels the proxy records come from here, and the harness gets only the secret.
        secret, mode = await self.control.register(session.session_id, task.id, task.id, session.sample)
        check_sessions_mode(mode, self.trust_claimed)
        template = await self._template(task)
        session.dir = self.work_dir / "sessions" / session.session_id
        shutil.rmtree(session.dir, ignore_errors=True)
        session.dir.mkdir(parents=True, mode=0o700)  # what the sandbox leaves there is no other user's to run
        session.home = session.dir / "home"
        session.home.mkdir()
        session.workspace = session.dir / "workspace"
        await ws.copy_template(template, session.workspace)
        await ws.ensure_repo(session.workspace)
        session.sandbox = await self.runtime.start(
            self._spec(task, session.session_id, session.workspace, session.home)
        )
        if task.setup:
            done = await session.sandbox.exec(task.setup, cwd=session.sandbox.workspace, timeout_s=task.setup_timeout_s)
            if done.exit_code != 0:
                raise RuntimeError(
                    f"setup exited {done.exit_code}{' (timed out)' if done.timed_out else ''}: "
                    f"{(done.stderr or done.stdout)[-_LOG_TAIL:]}"
                )
        view = await self._workspace_view(session, "base-view")
        session.base_tree = await ws.snapshot(view, session.dir / "base.git")
        sandbox = session.sandbox
        session.ctx = SessionContext(
            session_id=session.session_id, task_id=task.id, group_id=task.id, sample=session.sample,
            model=self.config.model, proxy_url=sandbox.proxy_url, reverse_url=sandbox.reverse_url,
            ca_path=sandbox.ca_path, home=sandbox.home, workspace=sandbox.workspace, secret=secret,
            context_window=self.context_window, max_output_tokens=self.max_output_tokens)  # fmt: skip
        self.preset.configure(session.home, session.ctx)

    async def _workspace_view(self, session: _Session, name: str) -> Path:
        """The workspace's files on the host: the sandbox's own directory when the runtime uses one in place, else a
        fresh download."""
        assert session.sandbox is not None and session.dir is not None
        if session.sandbox.host_workspace is not None:
            return Path(session.sandbox.host_workspace)
        target = session.dir / name
        shutil.rmtree(target, ignore_errors=True)
        await session.sandbox.download(session.sandbox.workspace, target)
        return target

    # -- RUN ------------------------------------------------------------------------------------------------------

    async def _run(self, session: _Session) -> bool:
        """Run the harness once; True when the session goes on to POSTRUN."""
        task, sandbox, ctx = session.task, session.sandbox, session.ctx
        assert sandbox is not None and ctx is not None
        if task.id in self.stopped_groups:
            await self._teardown(session)
            self._finish(session, "cancelled", "early stop: the group had enough usable sessions before it ran")
            return False
        self._move(session, "run")
        session.result.timings["wait"] = time.monotonic() - session.ready_at
        self.running.setdefault(task.id, []).append(session)
        session.result.ran = True
        self.progress.ran += 1
        deadline = self.config.timeout_s or task.agent_timeout_s
        env = {**self.config.env, **self.preset.env(ctx), "POLAR_INSTRUCTION": task.instruction}
        started = time.monotonic()
        try:
            done = await sandbox.exec(
                self.preset.command(task.instruction, ctx), env=env, cwd=sandbox.workspace, timeout_s=deadline
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the runtime failed under a running harness: it ran, so it is not retried
            done = None
            failure = f"the runtime failed during RUN: {type(exc).__name__}: {exc}"
        finally:
            self.running[task.id].remove(session)
            session.result.timings["run"] = time.monotonic() - started
        if done is None:
            return await self._end(session, "error", failure, {"reason": "runtime_failed"})
        session.result.exit_code = done.exit_code
        session.agent_output = done.stdout
        self._write_log(
            session, "harness.log", f"exit {done.exit_code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )
        if done.cancelled and task.id in self.stopped_groups:
            return await self._end(
                session, "cancelled", "early stop: cancelled while running", {"reason": "cancelled", "cancelled": True}
            )
        if done.cancelled:  # the runner's own cancel (an interruption): nothing the harness did
            return await self._end(
                session, "error", "cancelled by the runner while running", {"reason": "cancelled", "cancelled": True}
            )
        if done.timed_out:
            return await self._end(
                session,
                "timeout",
                f"the harness ran past its {deadline:g} s deadline",
                {"reason": "timeout", "deadline_s": deadline},
            )
        if done.exit_code != 0:
            # Exit codes and signals are the sandbox's own doing (`kill -9 $$` included): the policy's failure,
            # scored 0, or failing loudly would escape the 0 that failing quietly gets.
            tail = (done.stderr or done.stdout)[-_LOG_TAIL:]
            return await self._end(
                session,
                "failed",
                f"the harness exited {done.exit_code}: {tail}",
                {"reason": "harness_failed", "exit_code": done.exit_code},
            )
        return True

    async def _end(self, session: _Session, status: Status, reason: str, metadata: dict[str, Any]) -> bool:
        await self._teardown(session)
        if status == "failed":
            session.result.reward, session.result.rewards = 0.0, {"reward": 0.0}
        self._finish(session, status, reason)
        await self._post_status(session, STORE_STATUS.get(status, status), metadata)
        self._stop_if_enough(session)
        return False

    # -- POSTRUN --------------------------------------------------------------------------------------------------

    async def _postrun(self, session: _Session) -> None:
        self._move(session, "postrun")
        async with self.postrun:
            started = time.monotonic()
            try:
                status, reason, rewards = await self._verify(session)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                status, reason, rewards = "error", f"POSTRUN: {type(exc).__name__}: {exc}", {}
            finally:
                await self._teardown(session)
            session.result.timings["postrun"] = time.monotonic() - started
            if status in REWARDED:
                session.result.rewards = rewards
                session.result.reward = rewards["reward"]
            if status == "completed":
                try:
                    for name, value in rewards.items():
                        await self.control.reward(session.session_id, value, name)
                except Exception as exc:
                    status, reason = "error", f"the reward could not be stored: {exc}"
            self._finish(session, status, reason)
            metadata: dict[str, Any] = {"patch_bytes": session.result.patch_bytes}
            if status == "error":
                metadata["reason"] = "verifier_failed"
            elif status == "failed":
                metadata["reason"] = session.failure or "harness_produced_nothing"
            elif reason:  # completed with a 0 the verifier did not give (no reward, a timeout): say why
                metadata["scored"] = reason[:500]
            await self._post_status(session, STORE_STATUS.get(status, status), metadata)
            self._stop_if_enough(session)

    async def _verify(self, session: _Session) -> tuple[Status, str | None, dict[str, float]]:
        assert session.dir is not None and session.base_tree is not None
        view = await self._workspace_view(session, "final-view")
        try:
            patch = await ws.diff(view, session.dir / "base.git", session.base_tree, self.config.max_patch_bytes)
        except ws.PatchTooLarge as exc:  # the agent's output, so the policy's failure (never read into memory)
            await self._teardown_sandbox(session)
            session.failure = "patch_too_large"
            return "failed", str(exc), {"reward": 0.0}
        session.result.patch_bytes = len(patch)
        self._write_log(session, "patch.diff", patch.decode("utf-8", "replace"))
        await self._teardown_sandbox(session)  # the agent's sandbox goes before the verifier's starts
        if session.result.exit_code == 0 and not session.agent_output.strip() and not patch:
            # Provable from what the runner holds (the harness's stdout, the workspace's diff): there is nothing
            # to verify, and a verifier that passes an untouched workspace must not pay for it.
            return "failed", "the harness produced nothing: no stdout and no change to the workspace", {"reward": 0.0}
        last: Exception | None = None
        for attempt in range(1, self.config.verify_attempts + 1):
            vdir = session.dir / f"verify-{attempt}"
            try:
                return await self._verify_once(session, vdir, patch)
            except (VerifierError, asyncio.CancelledError):
                raise
            except Exception as exc:  # the verifier's sandbox, setup or patch: infrastructure, retried
                last = exc
                log.warning("polar rollout: %s: verify attempt %d: %s", session.session_id, attempt, exc)
        raise RuntimeError(f"verification failed {self.config.verify_attempts} times; last: {last}")

    async def _verify_once(
        self, session: _Session, vdir: Path, patch: bytes
    ) -> tuple[Status, str | None, dict[str, float]]:
        task = session.task
        shutil.rmtree(vdir, ignore_errors=True)
        vdir.mkdir(parents=True)
        workspace, home = vdir / "workspace", vdir / "home"
        home.mkdir()
        await ws.copy_template(await self._template(task), workspace)
        binds: dict[str, Path] = {}
        read_only_binds: dict[str, Path] = {}
        logs = vdir / "logs-verifier"
        # The harness's stdout, in a directory of the verifier's own sandbox that the agent's patch never touches:
        # Harbor's /logs/agent, else the verifier's fresh HOME (every runtime brings HOME in, local included).
        agent_logs = vdir / "logs-agent" if task.format == "harbor" else home / ".polar-agent"
        agent_logs.mkdir()
        (agent_logs / AGENT_OUTPUT_NAME).write_text(session.agent_output)
        if task.format == "harbor":
            tests = vdir / "tests"
            assert task.tests_dir is not None
            await asyncio.to_thread(shutil.copytree, task.tests_dir, tests, symlinks=True)
            logs.mkdir()  # fresh per attempt: nothing of an earlier attempt passes for this one's reward
            binds = {"/logs/verifier": logs}
            # The code under test must rewrite neither the tests that score it nor the agent's answer they read.
            read_only_binds = {"/tests": tests, HARBOR_AGENT_DIR: agent_logs}
        env = resolve_env(dict(task.verify_env))
        sandbox = await self.runtime.start(
            self._spec(task, f"{session.session_id}-verify", workspace, home, binds, read_only_binds=read_only_binds)
        )
        # Where a reward file is on the host once the sandbox is stopped (a directory, the path under it): in the
        # verifier's workspace where the runtime binds it, else a copy brought out before the stop.
        reward_at = (Path(sandbox.host_workspace), task.reward_file or "") if sandbox.host_workspace else None
        inside = HARBOR_AGENT_DIR if task.format == "harbor" else f"{sandbox.home.rstrip('/')}/.polar-agent"
        env[AGENT_OUTPUT_ENV] = f"{inside}/{AGENT_OUTPUT_NAME}"
        try:
            if task.setup:
                done = await sandbox.exec(task.setup, cwd=sandbox.workspace, timeout_s=task.setup_timeout_s)
                if done.exit_code != 0:
                    raise RuntimeError(
                        f"setup exited {done.exit_code} in the verifier's sandbox: {done.stderr[-_LOG_TAIL:]}"
                    )
            if patch:
                if sandbox.host_workspace is not None:
                    await ws.apply(Path(sandbox.host_workspace), vdir / "apply.git", patch)
                else:
                    (vdir / "agent.patch").write_bytes(patch)
                    await sandbox.upload(vdir / "agent.patch", "/tmp/polar-agent.patch")
                    applied = await sandbox.exec(
                        ["git", "apply", "--binary", "/tmp/polar-agent.patch"], cwd=sandbox.workspace, timeout_s=120
                    )
                    if applied.exit_code != 0:
                        raise RuntimeError(f"the patch does not apply: {applied.stderr[-_LOG_TAIL:]}")
            if task.reward_file:
                # A reward file the agent's patch planted must not pass for the verifier's.
                await sandbox.exec(["rm", "-rf", "--", task.reward_file], cwd=sandbox.workspace, timeout_s=60)
            command: str | list[str] = task.verify or "true"
            # Only where the sandbox has its own pid namespace: the guard's `kill -1` on the host would reach
            # every process of polar's user.
            guarded = isinstance(sandbox, IsolatedSandbox)
            if guarded:
                command = ["/bin/sh", "-c", VERIFY_GUARD, "polar-verify-guard", "/bin/sh", "-c", command]
            done = await sandbox.exec(command, env=env, cwd=sandbox.workspace, timeout_s=task.verify_timeout_s)
            self._write_log(
                session, "verifier.log", f"exit {done.exit_code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            )
            if done.cancelled:
                raise RuntimeError("the verifier was cancelled")
            if task.reward_file and reward_at is None:  # an image's own workspace: copied out by the runtime
                reward_at = (vdir / "reward-out", posixpath.basename(task.reward_file))
                reward_at[0].mkdir()
                try:
                    await sandbox.download(task.reward_file, reward_at[0] / reward_at[1])
                except FileNotFoundError:
                    pass
        finally:
            await sandbox.stop()
        # Every process of the verifier's sandbox is dead now: none can rewrite the reward while it is read.
        try:
            return "completed", None, self._reward(task, done, guarded, logs, reward_at)
        except NoReward as exc:
            return "completed", f"{exc}: scored 0", {"reward": 0.0}

    @staticmethod
    def _reward(
        task: Task, done: ExecResult, guarded: bool, logs: Path, reward_at: tuple[Path, str] | None
    ) -> dict[str, float]:
        """The verifier's rewards, read from the host after its sandbox stopped (NoReward: scored 0)."""
        if done.timed_out:
            # The agent's patch made the tests hang: the policy's failure, scored like any failing test.
            raise NoReward(f"the verifier ran past its {task.verify_timeout_s:g} s timeout")
        left = guard_left(done.stdout) if guarded else None
        if left:
            raise NoReward(left)
        if task.format == "harbor":
            reward_json = read_reward_file(logs, "reward.json") if task.reward_json else None
            return harbor_rewards(reward_json, read_reward_file(logs, "reward.txt"), honour_json=task.reward_json)
        if task.reward_file:
            assert reward_at is not None
            text = read_reward_file(*reward_at)
            if text is None:
                raise NoReward(f"the verifier wrote no {task.reward_file}")
            return file_rewards(text, task.reward_file)
        return {"reward": 1.0 if done.exit_code == 0 else 0.0}

    # -- store and teardown ---------------------------------------------------------------------------------------

    async def _post_status(self, session: _Session, status: str, metadata: dict[str, Any]) -> None:
        full = {
            "rollout": self.run_id,
            "task": session.task.id,
            "group": session.task.id,
            "sample": session.sample,
            "harness": self.preset.name,
            **self.config.status_metadata,
            **metadata,
        }
        try:
            stored, why = await self.control.status(session.session_id, status, full)
            session.result.posted = True
            if stored == "error" and session.result.status in USABLE:
                # The proxy ended the session as error first (its engine was taken out mid-session): error is
                # final in the store, so the summary, the display and the result say error too.
                self._refinish(session, "error", f"ended as error by the proxy before the runner's {status}: {why}")
        except Exception as exc:
            log.error("polar rollout: %s: status not stored: %s", session.session_id, exc)
            self.progress.errors.append((session.session_id, f"status not stored: {exc}"[:200]))

    def _write_log(self, session: _Session, name: str, text: str) -> None:
        """``text`` (bounded by the runtime's capture) under logs/sessions/SESSION/, with its credentials redacted:
        the agent's output can quote its own secret or, from a trusted local run, the given control token."""
        if self.config.logs_dir is None:
            return
        from polar_cli.rollout.redact import redact

        known = (
            session.ctx.secret if session.ctx else None,
            self.config.proxy.control_token if self.config.proxy else None,
        )
        directory = Path(self.config.logs_dir).resolve() / "sessions" / session.session_id
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(redact(text, known))

    async def _teardown_sandbox(self, session: _Session) -> None:
        sandbox, session.sandbox = session.sandbox, None
        if sandbox is not None:
            try:
                await sandbox.stop()
            except Exception as exc:
                log.warning("polar rollout: %s: sandbox stop failed: %s", session.session_id, exc)

    async def _teardown(self, session: _Session) -> None:
        await self._teardown_sandbox(session)
        if session.dir is not None and not self.config.keep_sessions:
            await asyncio.to_thread(shutil.rmtree, session.dir, True)
