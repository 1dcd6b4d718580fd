"""One rollout session's lifecycle: INIT, READY, RUN, POSTRUN, verified and rewarded (:class:`SessionRunner`).

Stages, each with its own bound (the schedulers give the bounds: ``runner``'s local pipeline, ``ray_backend``'s node
workers):

- INIT (``init_concurrency`` workers): start the runtime's sandbox, copy or clone the workspace, run the task's setup,
  snapshot the workspace, write the harness's config into the session's HOME. Infrastructure failures here are
  retried (``init_attempts``): nothing has run yet.
- READY: prepared sessions waiting for a run slot; at most ``ready`` sessions are in INIT or READY at once
  (``ready=0``: no buffer, each run slot prepares its own session first).
- RUN (``concurrency`` slots): the harness, once, under one deadline (``timeout_s``, else the task's agent timeout).
  A session that ran is never re-run, so a group stays whole.
- POSTRUN (``postrun_concurrency``): the agent's patch (``git diff`` of the workspace against its start), verified in
  a FRESH sandbox of the task (the task's workspace, its setup, the patch; Harbor's tests at ``/tests``), the
  verifier's reward and the session's status posted to the proxy with the control token, teardown. What the
  verifier's run means is the task's :class:`~polar_cli.rollout.verifiers.Verifier` (exit code, reward file, Harbor).

The verifier also sees the harness's stdout (its final answer in print mode), as Harbor's verifiers see its agent
logs: saved by the runner, outside the workspace, so the agent's patch cannot plant another. Every verify command
gets its path in ``POLAR_AGENT_OUTPUT``; Harbor tasks also find it at ``/logs/agent/stdout.txt``.

Statuses (``SessionResult.status``, a :class:`~polar_addon.store.status.SessionStatus`; what is posted to the store,
its ``stored``, in brackets): ``completed`` (reward from the
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
import shutil
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_addon.store.status import REWARDED, USABLE, SessionStatus
from polar_cli.rollout import workspace as ws
from polar_cli.rollout.config import RolloutConfig
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext
from polar_cli.rollout.proxy import ControlClient, check_sessions_mode
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
from polar_cli.rollout.verifiers import AGENT_OUTPUT_NAME, Verifier, VerifyLayout, verifier_for
from polar_cli.rollout.verify import VERIFY_GUARD, NoReward, VerifierError, resolve_env

log = logging.getLogger("polar.rollout")

STAGES = ("pending", "init", "ready", "run", "postrun", "done")
_LOG_TAIL = 2000
AGENT_OUTPUT_ENV = "POLAR_AGENT_OUTPUT"  # the verify command's path to the harness's stdout
CANCEL_RETRY_S = 0.2  # how often an early-stopped harness is cancelled again until its RUN returns


@dataclass
class SessionResult:
    session_id: str
    task_id: str
    group_id: str
    sample: int
    status: SessionStatus
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

    def count(self, result: SessionResult, sign: int = 1) -> None:
        """Count a finished session into the totals (``sign=-1``: out again, before it is counted with another
        status)."""
        self.statuses[result.status] += sign
        rewards = self.group_rewards.setdefault(result.group_id, [])
        if result.status in REWARDED and result.reward is not None:
            if sign > 0:
                rewards.append(result.reward)
            elif result.reward in rewards:
                rewards.remove(result.reward)
        if sign > 0 and result.status == SessionStatus.ERROR and result.reason:
            self.errors.append((result.session_id, result.reason.splitlines()[0][:200]))

    def sessions_per_minute(self) -> float:
        done = self.stages.get("done", 0)
        return done / max((time.time() - self.started_at) / 60, 1e-9)


@dataclass(frozen=True)
class PlannedSession:
    """One session of a rollout's plan: what a scheduler (the local pipeline, a Ray node's worker) runs."""

    task: Task
    sample: int
    session_id: str
    index: int


@dataclass
class Session:
    """One session on its way through the stages: where it is and what it holds."""

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


class SessionRunner:
    """The stages of every session of one rollout (on one proxy): :meth:`init`, :meth:`ready`, :meth:`run`,
    :meth:`postrun`, each ending the session when it ends there. What they share is here: the task templates, the
    early-stop tally, the progress counters. A scheduler bounds how many sessions are in each stage and calls
    :meth:`end_interrupted` for those an interruption caught; :meth:`drive` is one session through all of them."""

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
        self.postrun_slots = asyncio.Semaphore(config.postrun_concurrency or config.concurrency)
        self.templates: dict[str, Path | None] = {}
        self.template_locks: dict[str, asyncio.Lock] = {}
        self.usable: Counter = Counter()
        self.stopped_groups: set[str] = set()
        self.running: dict[str, list[Session]] = {}
        self.cancels: set[asyncio.Task] = set()  # early-stop cancels in flight (held so they are not collected)
        self.interrupted: str | None = None  # what stopped the run (a signal's name, ``stop``)

    def open(self, planned: PlannedSession) -> Session:
        """A planned session, counted as pending."""
        p = planned
        session = Session(
            p.task,
            p.sample,
            p.session_id,
            p.index,
            SessionResult(p.session_id, p.task.id, p.task.id, p.sample, SessionStatus.ERROR),
        )
        self.progress.total += 1
        self.progress.stages["pending"] += 1
        return session

    def interrupt(self, reason: str) -> bool:
        """Mark the run stopped (False when it already was): nothing new starts. The scheduler then cancels what
        runs (each harness's or verifier's process tree is killed) and calls :meth:`end_interrupted`."""
        if self.interrupted is not None:
            log.warning("polar rollout: %s again: already stopping", reason)
            return False
        log.warning("polar rollout: %s: stopping (running sessions are cancelled, their statuses posted)", reason)
        self.interrupted = reason
        return True

    async def drive(self, planned: PlannedSession, run_slots: asyncio.Semaphore) -> SessionResult:
        """One session through INIT -> READY -> RUN (under ``run_slots``) -> POSTRUN, for a scheduler that hands out
        sessions one at a time (``ray_backend``: as many at once as RUN slots plus READY). Cancelled (an
        interrupt), it ends ``cancelled``, posted as ``error`` when the harness ran."""
        session = self.open(planned)
        try:
            if await self.init(session):
                self.ready(session)
                async with run_slots:
                    go_on = await self.run(session)
                if go_on:
                    await self.postrun(session)
        except asyncio.CancelledError:
            await self.teardown(session)
            self.interrupted = self.interrupted or "cancelled"
            await self.end_interrupted([session])
        return session.result

    async def end_interrupted(self, sessions: Sequence[Session]) -> None:
        """Every session the interruption caught ends ``cancelled``; each that ran (so the store knows it) gets a
        final status, which nothing else would post: no session stays ``running`` in the store."""
        for session in sessions:
            if session.stage != "done":
                stage = session.stage
                self._finish(session, SessionStatus.CANCELLED, f"interrupted by {self.interrupted} in {stage.upper()}")
                if session.result.ran:
                    await self._post_status(
                        session,
                        SessionStatus.CANCELLED,
                        {"reason": "interrupted", "cancelled": True, "signal": self.interrupted, "stage": stage},
                    )
            elif session.result.ran and not session.result.posted:  # it ended, but the interruption cut its post
                await self._post_status(
                    session, session.result.status, {"reason": "interrupted", "signal": self.interrupted}
                )

    def _move(self, session: Session, stage: str) -> None:
        self.progress.move(session.stage, stage)
        session.stage = stage

    def _finish(self, session: Session, status: SessionStatus, reason: str | None = None) -> None:
        """End ``session`` as ``status``. Again for a session that ended (the store's final word differs): its
        counts, rewards and early-stop tally as if it had ended so."""
        result, group = session.result, session.task.id
        if session.stage == "done":
            self.progress.count(result, -1)
            self.usable[group] -= result.status in USABLE
        else:
            self._move(session, "done")
        result.status, result.reason = status, reason
        self.progress.count(result)
        self.usable[group] += status in USABLE

    def _stop_if_enough(self, session: Session) -> None:
        """Early stop once ``session``'s group has M usable sessions. Asked only after its status was posted: the
        store may answer error, and a session that is not usable must not cancel its group's others."""
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
                job = asyncio.create_task(self._cancel_run(other))
                self.cancels.add(job)
                job.add_done_callback(self.cancels.discard)

    async def _cancel_run(self, session: Session) -> None:
        """Cancel ``session``'s harness until its RUN returns. A session is in RUN before its harness's process is
        spawned, and a runtime only kills the processes it already has: one cancel in that window would leave the
        straggler to run to its own end."""
        assert session.sandbox is not None
        while session in self.running.get(session.task.id, []):
            await session.sandbox.cancel()
            await asyncio.sleep(CANCEL_RETRY_S)

    # -- INIT -----------------------------------------------------------------------------------------------------

    async def init(self, session: Session) -> bool:
        """Prepare ``session`` (retrying infrastructure failures); False when it ended here."""
        self._move(session, "init")
        started = time.monotonic()
        reason = ""
        for attempt in range(1, self.config.init_attempts + 1):
            if session.task.id in self.stopped_groups:
                self._finish(
                    session, SessionStatus.CANCELLED, "early stop: the group had enough usable sessions before it ran"
                )
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
                await self.teardown(session)
                if attempt < self.config.init_attempts:
                    await asyncio.sleep(min(0.5 * attempt, 5.0))
        session.result.timings["init"] = time.monotonic() - started
        self._finish(session, SessionStatus.ERROR, f"INIT failed {self.config.init_attempts} times; last: {reason}")
        await self._post_status(session, SessionStatus.ERROR, {"reason": "init_failed"})
        return False

    def ready(self, session: Session) -> None:
        """``session`` (prepared by :meth:`init`) waits for a RUN slot."""
        self._move(session, "ready")

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

    async def _prepare(self, session: Session) -> None:
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

    async def _workspace_view(self, session: Session, name: str) -> Path:
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

    async def run(self, session: Session) -> bool:
        """Run the harness once; True when the session goes on to POSTRUN."""
        task, sandbox, ctx = session.task, session.sandbox, session.ctx
        assert sandbox is not None and ctx is not None
        if task.id in self.stopped_groups:
            await self.teardown(session)
            self._finish(
                session, SessionStatus.CANCELLED, "early stop: the group had enough usable sessions before it ran"
            )
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
            return await self._end(session, SessionStatus.ERROR, failure, {"reason": "runtime_failed"})
        session.result.exit_code = done.exit_code
        session.agent_output = done.stdout
        self._write_log(
            session, "harness.log", f"exit {done.exit_code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )
        cancelled = {"reason": "cancelled", "cancelled": True}
        if done.cancelled and task.id in self.stopped_groups:
            return await self._end(session, SessionStatus.CANCELLED, "early stop: cancelled while running", cancelled)
        if done.cancelled:  # the runner's own cancel (an interruption): nothing the harness did
            return await self._end(session, SessionStatus.ERROR, "cancelled by the runner while running", cancelled)
        if done.timed_out:
            return await self._end(
                session,
                SessionStatus.TIMEOUT,
                f"the harness ran past its {deadline:g} s deadline",
                {"reason": "timeout", "deadline_s": deadline},
            )
        if done.exit_code != 0:
            # Exit codes and signals are the sandbox's own doing (`kill -9 $$` included): the policy's failure,
            # scored 0, or failing loudly would escape the 0 that failing quietly gets.
            # A runtime limit that stopped it is still the policy's doing (it chose what to allocate or write), but
            # the reason says which, so a run that keeps hitting one shows it.
            tail = (done.stderr or done.stdout)[-_LOG_TAIL:]
            why = runtime_limit(done)
            return await self._end(
                session,
                SessionStatus.FAILED,
                f"the harness exited {done.exit_code}{why and f' ({why})'}: {tail}",
                {"reason": "harness_failed", "exit_code": done.exit_code, "oom_killed": done.oom_killed,
                 "limit": done.limit},
            )  # fmt: skip
        return True

    async def _end(self, session: Session, status: SessionStatus, reason: str, metadata: dict[str, Any]) -> bool:
        await self.teardown(session)
        if status == SessionStatus.FAILED:
            session.result.reward, session.result.rewards = 0.0, {"reward": 0.0}
        self._finish(session, status, reason)
        await self._post_status(session, status, metadata)
        self._stop_if_enough(session)
        return False

    # -- POSTRUN --------------------------------------------------------------------------------------------------

    async def postrun(self, session: Session) -> None:
        """Verify the agent's patch, store the rewards and the final status, tear the session down."""
        self._move(session, "postrun")
        async with self.postrun_slots:
            started = time.monotonic()
            try:
                status, reason, rewards = await self._verify(session)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                status, reason, rewards = SessionStatus.ERROR, f"POSTRUN: {type(exc).__name__}: {exc}", {}
            finally:
                await self.teardown(session)
            session.result.timings["postrun"] = time.monotonic() - started
            if status in REWARDED:
                session.result.rewards = rewards
                session.result.reward = rewards["reward"]
            if status == SessionStatus.COMPLETED:
                try:
                    for name, value in rewards.items():
                        await self.control.reward(session.session_id, value, name)
                except Exception as exc:
                    status, reason = SessionStatus.ERROR, f"the reward could not be stored: {exc}"
            self._finish(session, status, reason)
            metadata: dict[str, Any] = {"patch_bytes": session.result.patch_bytes}
            if status == SessionStatus.ERROR:
                metadata["reason"] = "verifier_failed"
            elif status == SessionStatus.FAILED:
                metadata["reason"] = session.failure or "harness_produced_nothing"
            elif reason:  # completed with a 0 the verifier did not give (no reward, a timeout): say why
                metadata["scored"] = reason[:500]
            await self._post_status(session, status, metadata)
            self._stop_if_enough(session)

    async def _verify(self, session: Session) -> tuple[SessionStatus, str | None, dict[str, float]]:
        assert session.dir is not None and session.base_tree is not None
        try:
            view = await self._workspace_view(session, "final-view")
        except FileNotFoundError as exc:
            # The runtime answered and the workspace was not there (removed, or replaced by a link the download
            # drops): the agent's doing, so the policy's failure; an error would mask the session, a way to hide
            # a bad outcome from the trainer.
            await self._teardown_sandbox(session)
            session.failure = "workspace_gone"
            return SessionStatus.FAILED, f"the workspace was gone after the run: {exc}", {"reward": 0.0}
        try:
            patch = await ws.diff(view, session.dir / "base.git", session.base_tree, self.config.max_patch_bytes)
        except ws.PatchTooLarge as exc:  # the agent's output, so the policy's failure (never read into memory)
            await self._teardown_sandbox(session)
            session.failure = "patch_too_large"
            return SessionStatus.FAILED, str(exc), {"reward": 0.0}
        session.result.patch_bytes = len(patch)
        self._write_log(session, "patch.diff", patch.decode("utf-8", "replace"))
        await self._teardown_sandbox(session)  # the agent's sandbox goes before the verifier's starts
        if session.result.exit_code == 0 and not session.agent_output.strip() and not patch:
            # Provable from what the runner holds (the harness's stdout, the workspace's diff): there is nothing
            # to verify, and a verifier that passes an untouched workspace must not pay for it.
            nothing = "the harness produced nothing: no stdout and no change to the workspace"
            return SessionStatus.FAILED, nothing, {"reward": 0.0}
        verifier = verifier_for(session.task)
        last: Exception | None = None
        for attempt in range(1, self.config.verify_attempts + 1):
            vdir = session.dir / f"verify-{attempt}"
            try:
                return await self._verify_once(session, verifier, vdir, patch)
            except (VerifierError, asyncio.CancelledError):
                raise
            except Exception as exc:  # the verifier's sandbox, setup or patch: infrastructure, retried
                last = exc
                log.warning("polar rollout: %s: verify attempt %d: %s", session.session_id, attempt, exc)
        raise RuntimeError(f"verification failed {self.config.verify_attempts} times; last: {last}")

    async def _verify_once(
        self, session: Session, verifier: Verifier, vdir: Path, patch: bytes
    ) -> tuple[SessionStatus, str | None, dict[str, float]]:
        task = session.task
        shutil.rmtree(vdir, ignore_errors=True)
        vdir.mkdir(parents=True)
        workspace, home = vdir / "workspace", vdir / "home"
        home.mkdir()
        await ws.copy_template(await self._template(task), workspace)
        layout: VerifyLayout = await verifier.layout(vdir, home)
        (layout.agent_logs / AGENT_OUTPUT_NAME).write_text(session.agent_output)
        env = resolve_env(dict(task.verify_env))
        sandbox = await self.runtime.start(
            self._spec(
                task, f"{session.session_id}-verify", workspace, home, layout.binds,
                read_only_binds=layout.read_only_binds,
            )
        )  # fmt: skip
        host_workspace = Path(sandbox.host_workspace) if sandbox.host_workspace else None
        env[AGENT_OUTPUT_ENV] = f"{verifier.agent_dir(sandbox)}/{AGENT_OUTPUT_NAME}"
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
            await verifier.before(sandbox)
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
            await verifier.collect(sandbox, layout)
        finally:
            await sandbox.stop()
        # Every process of the verifier's sandbox is dead now: none can rewrite the reward while it is read.
        try:
            if done.oom_killed:  # the tested code ran the verifier out of memory: its failure, never a mask
                raise NoReward("the verifier was killed by the runtime's memory limit (OOM)")
            return SessionStatus.COMPLETED, None, verifier.decide(done, guarded, layout, host_workspace)
        except NoReward as exc:
            return SessionStatus.COMPLETED, f"{exc}: scored 0", {"reward": 0.0}

    # -- store and teardown ---------------------------------------------------------------------------------------

    async def _post_status(self, session: Session, status: SessionStatus, metadata: dict[str, Any]) -> None:
        """Post how ``session`` ended (as the store names ``status``), with the rollout's labels."""
        full = {
            "rollout": self.run_id,
            "task": session.task.id,
            "group": session.task.id,
            "sample": session.sample,
            "harness": self.preset.name,
            **self.config.status_metadata,
            **metadata,
        }
        posted = status.stored
        try:
            stored, why = await self.control.status(session.session_id, posted, full)
            session.result.posted = True
            if stored == SessionStatus.ERROR and session.result.status in USABLE:
                # The proxy ended the session as error first (its engine was taken out mid-session): error is
                # final in the store, so the summary, the display and the result say error too.
                reason = f"ended as error by the proxy before the runner's {posted}: {why}"
                self._finish(session, SessionStatus.ERROR, reason)
        except Exception as exc:
            log.error("polar rollout: %s: status not stored: %s", session.session_id, exc)
            self.progress.errors.append((session.session_id, f"status not stored: {exc}"[:200]))

    def _write_log(self, session: Session, name: str, text: str) -> None:
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

    async def _teardown_sandbox(self, session: Session) -> None:
        sandbox, session.sandbox = session.sandbox, None
        if sandbox is not None:
            try:
                await sandbox.stop()
            except Exception as exc:
                log.warning("polar rollout: %s: sandbox stop failed: %s", session.session_id, exc)

    async def teardown(self, session: Session) -> None:
        """Stop ``session``'s sandbox and remove its directory (unless ``keep_sessions``); safe to call again."""
        await self._teardown_sandbox(session)
        if session.dir is not None and not self.config.keep_sessions:
            await asyncio.to_thread(shutil.rmtree, session.dir, True)


def runtime_limit(done: ExecResult) -> str:
    """Which of the runtime's limits ended an exec, in words ("" when none did)."""
    if done.oom_killed:
        return "killed by the runtime's memory limit: OOM"
    if done.limit == "disk":
        return "killed by the runtime's disk limit"
    return ""
