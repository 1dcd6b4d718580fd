"""The session runner's bookkeeping and decisions outside RUN, in-process (polar_cli.rollout.session): the progress
counters a display and the early stop read, what an interruption ends and posts, INIT's bounded retries, POSTRUN's
statuses and rewards, the labels every status post carries, the proxy's final word, the logs' redaction.

The proxy, the runtime and the harness are fakes that record what the runner asked of them: each test is a
fraction of a second (tests/test_rollout_session_decisions.py drives the same runner against a real proxy)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest

from polar_addon.store.status import SessionStatus
from polar_cli.rollout import session as session_mod
from polar_cli.rollout import workspace as ws
from polar_cli.rollout.config import RolloutConfig
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext
from polar_cli.rollout.proxy import ControlError, ExternalProxy
from polar_cli.rollout.runtimes.base import ExecResult, IsolatedSandbox, ProxyEndpoints, Sandbox, SandboxSpec
from polar_cli.rollout.session import (
    PlannedSession,
    RolloutProgress,
    Session,
    SessionResult,
    SessionRunner,
    runtime_limit,
)
from polar_cli.rollout.tasks import Task
from polar_cli.rollout.verifiers import Verifier, VerifyLayout
from polar_cli.rollout.verify import VERIFY_GUARD, NoReward, VerifierError

S = SessionStatus
ENDPOINTS = ProxyEndpoints(forward_port=8080, reverse_port=8081, ca=Path("/ca.pem"))


class Control:
    """The proxy's control plane as the runner sees it; ``answer`` is the store's final word on a status."""

    def __init__(self, answer: tuple[str, str | None] | None = None, mode: str = "registered") -> None:
        self.answer, self.mode = answer, mode
        self.statuses: list[tuple[str, str, dict]] = []
        self.rewards: list[tuple[str, float, str]] = []
        self.registered: list[tuple] = []
        self.fail_status: Exception | None = None
        self.fail_reward_after: int | None = None

    async def register(self, session_id: str, task: str, group: str, sample: int) -> tuple[str, str]:
        self.registered.append((session_id, task, group, sample))
        return f"psk-{session_id}", self.mode

    async def reward(self, session_id: str, value: float, name: str = "reward") -> None:
        if self.fail_reward_after is not None and len(self.rewards) >= self.fail_reward_after:
            raise RuntimeError("503 twice")
        self.rewards.append((session_id, value, name))

    async def status(self, session_id: str, status: str, metadata: dict | None = None) -> tuple[str, str | None]:
        if self.fail_status is not None:
            raise self.fail_status
        self.statuses.append((session_id, status, dict(metadata or {})))
        return self.answer or (status, None)


class Box(Sandbox):
    """A sandbox that runs nothing: counts its stops and cancels, answers each exec with the next of ``answers``,
    else ``result``."""

    def __init__(self, host_workspace: Path | None = None, fail_stop: bool = False) -> None:
        self.workspace, self.home = "/ws", "/home/polar"
        self.proxy_url, self.reverse_url, self.ca_path = "http://127.0.0.1:8080", "http://127.0.0.1:8081", "/ca"
        self.host_workspace = host_workspace
        self.stops = self.cancels = 0
        self.fail_stop = fail_stop
        self.execs: list[tuple] = []
        self.downloads: list[tuple[str, Path]] = []
        self.uploads: list[tuple[bytes, str]] = []
        self.envs: list[dict | None] = []
        self.result = ExecResult(0, "", "")
        self.answers: list[ExecResult] = []

    async def exec(self, command, *, env=None, cwd=None, timeout_s=None, stdin=None) -> ExecResult:
        self.execs.append((command, cwd, timeout_s))
        self.envs.append(None if env is None else dict(env))
        return self.answers.pop(0) if self.answers else self.result

    async def upload(self, local: Path, remote: str) -> None:
        self.uploads.append((local.read_bytes(), remote))

    async def download(self, remote: str, local: Path) -> None:
        self.downloads.append((remote, local))
        local.mkdir(parents=True)

    async def cancel(self) -> None:
        self.cancels += 1

    async def stop(self) -> None:
        self.stops += 1
        if self.fail_stop:
            raise OSError("already gone")


class Runtime:
    default_network = "host"

    def __init__(self) -> None:
        self.specs: list[SandboxSpec] = []
        self.boxes: list[Box] = []

    async def start(self, spec: SandboxSpec) -> Box:
        self.specs.append(spec)
        box = Box(host_workspace=spec.workspace)
        self.boxes.append(box)
        return box


class Preset(HarnessPreset):
    name = "fake-harness"
    read_only = (Path("/opt/harness"),)

    def __init__(self) -> None:
        self.configured: list[tuple[Path, SessionContext]] = []

    def configure(self, home: Path, ctx: SessionContext) -> None:
        self.configured.append((home, ctx))

    def env(self, ctx: SessionContext) -> dict[str, str]:
        return {"OPENAI_API_KEY": ctx.api_key(), "SHARED": "preset"}

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return ["agent", "--session", ctx.session_id, instruction]


TASK = Task(
    id="t1",
    instruction="fix it",
    image="img:1",
    dockerfile=Path("/env/Dockerfile"),
    workdir="/app",
    cpus=2.0,
    memory_mb=512,
)


def _runner(tmp_path: Path, control: Control | None = None, **fields: Any) -> SessionRunner:
    defaults: dict[str, Any] = {"tasks": [TASK], "harness": "codex", "runtime": "bwrap"}
    runtime = fields.pop("runtime_object", Runtime())
    config = RolloutConfig(**{**defaults, **fields})
    return SessionRunner(
        config,
        Preset(),
        runtime,
        ENDPOINTS,
        control or Control(),
        tmp_path / "work",
        "run7",  # type: ignore[arg-type]
    )


def _session(runner: SessionRunner, sample: int = 0, task: Task = TASK) -> Session:
    return runner.open(PlannedSession(task, sample, f"run7-{task.id}-{sample}", sample))


def _result(status: S, group: str = "g", reward: float | None = None, reason: str | None = None) -> SessionResult:
    return SessionResult("s", "t", group, 0, status, reward=reward, reason=reason)


# --- progress -------------------------------------------------------------------------------------------------------


def test_progress_moves_a_session_between_stages() -> None:
    progress = RolloutProgress()
    progress.move(None, "pending")
    progress.move(None, "pending")
    progress.move("pending", "init")
    progress.move("init", "done")
    assert dict(progress.stages) == {"pending": 1, "init": 0, "done": 1}


def test_progress_counts_rewards_of_rewarded_sessions_and_takes_them_out_again() -> None:
    progress = RolloutProgress()
    done = _result(S.COMPLETED, reward=0.5)
    progress.count(done)
    progress.count(_result(S.FAILED, reward=0.0))
    progress.count(_result(S.TIMEOUT, reward=0.25))  # a timeout's reward is not the verifier's
    progress.count(_result(S.COMPLETED, group="h"))  # no reward known
    assert progress.group_rewards == {"g": [0.5, 0.0], "h": []}
    assert (progress.statuses[S.COMPLETED], progress.statuses[S.FAILED], progress.statuses[S.TIMEOUT]) == (2, 1, 1)
    progress.count(done, -1)
    progress.count(_result(S.COMPLETED, reward=0.75), -1)  # never counted in: nothing to take out
    assert progress.group_rewards == {"g": [0.0], "h": []}
    assert progress.statuses[S.COMPLETED] == 0
    assert list(progress.errors) == []


def test_progress_keeps_the_first_line_of_the_last_five_errors() -> None:
    progress = RolloutProgress()
    progress.count(_result(S.ERROR, group="e"))  # no reason: nothing to show
    progress.count(_result(S.COMPLETED, reason="scored 0"))  # not an error
    progress.count(_result(S.ERROR, reason="x" * 300 + "\nsecond line"))
    assert progress.group_rewards["e"] == []
    assert list(progress.errors) == [("s", "x" * 200)]
    progress.count(_result(S.ERROR, reason="taken out"), -1)  # counted out: not a new error
    assert len(progress.errors) == 1
    for n in range(6):
        progress.count(SessionResult(f"s{n}", "t", "g", 0, S.ERROR, reason=f"e{n}"))
    assert list(progress.errors) == [(f"s{n}", f"e{n}") for n in range(1, 6)]
    assert progress.statuses[S.ERROR] == 7


def test_sessions_per_minute_over_the_elapsed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    progress = RolloutProgress(started_at=880.0)
    monkeypatch.setattr(session_mod.time, "time", lambda: 1000.0)
    assert progress.sessions_per_minute() == 0.0
    progress.stages["done"] = 4
    assert progress.sessions_per_minute() == 2.0
    progress.started_at = 1000.0  # none elapsed: bounded, never a division by zero
    assert progress.sessions_per_minute() == pytest.approx(4e9)


def test_a_limit_says_which_one_ended_the_exec() -> None:
    assert runtime_limit(ExecResult(-9, "", "", oom_killed=True, limit="disk")) == (
        "killed by the runtime's memory limit: OOM"
    )
    assert runtime_limit(ExecResult(-9, "", "", limit="disk")) == "killed by the runtime's disk limit"
    assert runtime_limit(ExecResult(-9, "", "", limit="pids")) == ""
    assert runtime_limit(ExecResult(1, "", "")) == ""


# --- the runner's setup and bookkeeping -------------------------------------------------------------------------------


def test_the_runner_takes_its_network_trust_and_bounds_from_the_config(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    runner = _runner(tmp_path)
    assert (runner.network, runner.trust_claimed, runner.run_id) == ("host", False, "run7")
    assert isinstance(runner.progress, RolloutProgress)

    class Bare:  # a runtime that names no default network
        pass

    assert _runner(tmp_path, runtime_object=Bare()).network == "proxy-only"
    progress = RolloutProgress()
    given = _runner(tmp_path, network="none", progress=progress)
    assert given.network == "none" and given.progress is progress
    trusted = ExternalProxy("http://127.0.0.1:1", "t" * 16, ca=ca, trust_claimed=True)
    assert _runner(tmp_path, proxy=trusted).trust_claimed is True
    untrusted = ExternalProxy("http://127.0.0.1:1", "t" * 16, ca=ca)
    assert _runner(tmp_path, proxy=untrusted).trust_claimed is False

    async def slots(runner: SessionRunner) -> int:
        taken = 0
        while not runner.postrun_slots.locked():
            await runner.postrun_slots.acquire()
            taken += 1
        return taken

    assert asyncio.run(slots(_runner(tmp_path, concurrency=3))) == 3
    assert asyncio.run(slots(_runner(tmp_path, concurrency=3, postrun_concurrency=2))) == 2


def test_an_opened_session_is_pending_with_an_error_result_until_it_ends(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    session = _session(runner, sample=3)
    assert (session.task, session.sample, session.session_id, session.index) == (TASK, 3, "run7-t1-3", 3)
    result = session.result
    assert (result.session_id, result.task_id, result.group_id, result.sample, result.status) == (
        "run7-t1-3",
        "t1",
        "t1",
        3,
        S.ERROR,
    )
    _session(runner, sample=4)
    assert runner.progress.total == 2 and runner.progress.stages["pending"] == 2
    assert session.stage == "pending"
    runner.ready(session)
    assert session.stage == "ready" and dict(runner.progress.stages) == {"pending": 1, "ready": 1}


def test_an_interrupt_is_taken_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runner = _runner(tmp_path)
    with caplog.at_level(logging.WARNING, logger="polar.rollout"):
        assert runner.interrupt("SIGTERM") is True
        assert runner.interrupt("SIGINT") is False
    assert runner.interrupted == "SIGTERM"
    assert [r.getMessage() for r in caplog.records] == [
        "polar rollout: SIGTERM: stopping (running sessions are cancelled, their statuses posted)",
        "polar rollout: SIGINT again: already stopping",
    ]


def test_a_session_ended_again_is_counted_as_its_new_status(tmp_path: Path) -> None:
    runner = _runner(tmp_path, early_stop=1)
    session = _session(runner)
    session.result.reward = 1.0
    runner._finish(session, S.COMPLETED)
    assert session.stage == "done" and runner.usable["t1"] == 1
    assert runner.progress.group_rewards["t1"] == [1.0] and runner.progress.stages["done"] == 1
    runner._finish(session, S.ERROR, "ended as error by the proxy")
    assert (session.result.status, session.result.reason) == (S.ERROR, "ended as error by the proxy")
    assert runner.usable["t1"] == 0 and runner.progress.group_rewards["t1"] == []
    assert (runner.progress.statuses[S.COMPLETED], runner.progress.statuses[S.ERROR]) == (0, 1)
    assert runner.progress.stages["done"] == 1 and runner.progress.stages["pending"] == 0
    runner._finish(session, S.TIMEOUT)
    assert runner.usable["t1"] == 1 and runner.progress.statuses[S.ERROR] == 0
    runner._finish(_session(runner, 1), S.FAILED)  # a sibling's usable session adds to the group's
    assert runner.usable["t1"] == 2


def test_stopping_a_group_cancels_each_running_harness_until_its_run_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_mod, "CANCEL_RETRY_S", 0.01)
    runner = _runner(tmp_path)
    running, unstarted, other = (
        _session(runner, 0),
        _session(runner, 1),
        _session(runner, 2, Task(id="t2", instruction="x")),
    )
    running.sandbox, other.sandbox = Box(), Box()
    runner.running = {"t1": [running, unstarted], "t2": [other]}

    async def main() -> None:
        runner.stop_group("t1")
        runner.stop_group("t1")  # once: no second round of cancels
        assert len(runner.cancels) == 1

        async def cancelled_thrice() -> None:
            while running.sandbox.cancels < 3:  # type: ignore[union-attr]
                await asyncio.sleep(0.01)

        await asyncio.wait_for(cancelled_thrice(), 5)  # a cancel that never comes fails here, not by hanging
        runner.running["t1"].remove(running)  # its RUN returned
        await asyncio.wait_for(asyncio.gather(*runner.cancels), 5)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert runner.stopped_groups == {"t1"} and runner.cancels == set()
    assert 3 <= running.sandbox.cancels <= 5 and other.sandbox.cancels == 0  # type: ignore[union-attr]


# --- interruption ----------------------------------------------------------------------------------------------------


def test_an_interruption_ends_and_posts_what_it_caught(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control)
    runner.interrupted = "SIGINT"
    ran, waiting, finished, unposted = (_session(runner, n) for n in range(4))
    for s in (ran, finished, unposted):
        s.result.ran = True
    runner._move(ran, "run")
    runner._move(waiting, "ready")
    runner._finish(finished, S.COMPLETED)
    finished.result.posted = True
    runner._finish(unposted, S.FAILED)
    asyncio.run(runner.end_interrupted([ran, waiting, finished, unposted]))
    assert (ran.result.status, ran.result.reason) == (S.CANCELLED, "interrupted by SIGINT in RUN")
    assert (waiting.result.status, waiting.result.reason) == (S.CANCELLED, "interrupted by SIGINT in READY")
    assert (finished.result.status, unposted.result.status) == (S.COMPLETED, S.FAILED)
    posted = [
        (sid, status, {k: m[k] for k in m if k in ("reason", "cancelled", "signal", "stage")})
        for sid, status, m in control.statuses
    ]
    assert posted == [
        ("run7-t1-0", "error", {"reason": "interrupted", "cancelled": True, "signal": "SIGINT", "stage": "run"}),
        ("run7-t1-3", "agent_error", {"reason": "interrupted", "signal": "SIGINT"}),
    ]
    assert ran.result.posted and unposted.result.posted and not waiting.result.posted


def test_drive_goes_through_the_stages_that_do_not_end_the_session(tmp_path: Path) -> None:
    calls: list[str] = []

    def runner_with(init: bool, run: bool) -> SessionRunner:
        runner = _runner(tmp_path)

        async def fake_init(session: Session) -> bool:
            calls.append(f"init {session.session_id}")
            return init

        async def fake_run(session: Session) -> bool:
            calls.append(f"run {session.session_id} in {session.stage}")
            return run

        async def fake_postrun(session: Session) -> None:
            calls.append(f"postrun {session.session_id}")

        runner.init, runner.run, runner.postrun = fake_init, fake_run, fake_postrun  # type: ignore[method-assign]
        return runner

    planned = PlannedSession(TASK, 0, "s-0", 0)
    for init, run, expected in [
        (False, True, ["init s-0"]),
        (True, False, ["init s-0", "run s-0 in ready"]),
        (True, True, ["init s-0", "run s-0 in ready", "postrun s-0"]),
    ]:
        calls.clear()
        result = asyncio.run(runner_with(init, run).drive(planned, asyncio.Semaphore(1)))
        assert calls == expected and result.session_id == "s-0"


def test_a_cancelled_drive_ends_the_session_cancelled(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control)
    box = Box()

    async def hang(session: Session) -> bool:
        session.sandbox = box
        session.result.ran = True
        runner._move(session, "run")
        await asyncio.sleep(30)
        return True

    async def ready(session: Session) -> bool:
        return True

    runner.init, runner.run = ready, hang  # type: ignore[method-assign]

    async def main(reason: str | None) -> SessionResult:
        runner.interrupted = reason
        job = asyncio.create_task(runner.drive(PlannedSession(TASK, 0, "s-0", 0), asyncio.Semaphore(1)))
        await asyncio.sleep(0.05)
        job.cancel()
        return await job

    result = asyncio.run(main(None))
    assert (result.status, result.reason) == (S.CANCELLED, "interrupted by cancelled in RUN")
    assert runner.interrupted == "cancelled" and box.stops == 1
    [(sid, status, metadata)] = control.statuses
    assert (sid, status) == ("s-0", "error")
    assert (
        metadata.items() >= {"reason": "interrupted", "cancelled": True, "signal": "cancelled", "stage": "run"}.items()
    )
    result = asyncio.run(main("SIGTERM"))
    assert result.reason == "interrupted by SIGTERM in RUN" and runner.interrupted == "SIGTERM"


# --- INIT ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """INIT's pauses between attempts, recorded instead of slept."""
    taken: list[float] = []
    real = asyncio.sleep

    async def sleep(delay: float, *args: Any) -> None:
        taken.append(delay)
        await real(0)

    monkeypatch.setattr(session_mod.asyncio, "sleep", sleep)
    return taken


def _failing_prepare(runner: SessionRunner, failures: int, box: Box | None = None) -> list[int]:
    attempts: list[int] = []

    async def prepare(session: Session) -> None:
        attempts.append(session.result.init_attempts)
        session.sandbox = box
        if len(attempts) <= failures:
            raise RuntimeError(f"boom {len(attempts)}")

    runner._prepare = prepare  # type: ignore[method-assign]
    return attempts


def test_init_retries_with_growing_pauses_and_tears_each_failure_down(tmp_path: Path, sleeps: list[float]) -> None:
    control = Control()
    runner = _runner(tmp_path, control, init_attempts=3)
    box = Box()
    attempts = _failing_prepare(runner, 2, box)
    session = _session(runner)
    assert asyncio.run(runner.init(session)) is True
    assert attempts == [1, 2, 3] and session.result.init_attempts == 3
    assert sleeps == [0.5, 1.0] and box.stops == 2
    assert session.stage == "init" and control.statuses == []
    assert 0 <= session.result.timings["init"] < 60 and session.ready_at > 0  # a duration, not a clock reading


def test_init_that_keeps_failing_ends_as_error_and_says_why(
    tmp_path: Path, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    control = Control()
    runner = _runner(tmp_path, control, init_attempts=12)
    attempts = _failing_prepare(runner, 99)
    session = _session(runner)
    with caplog.at_level(logging.WARNING, logger="polar.rollout"):
        assert asyncio.run(runner.init(session)) is False
    assert attempts == list(range(1, 13))
    assert sleeps == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.0]  # at most 5 s, none after the last
    assert (session.result.status, session.result.reason) == (
        S.ERROR,
        "INIT failed 12 times; last: INIT attempt 12: RuntimeError: boom 12",
    )
    assert caplog.records[0].getMessage() == "polar rollout: run7-t1-0: INIT attempt 1: RuntimeError: boom 1"
    [(sid, status, metadata)] = control.statuses
    assert (sid, status, metadata["reason"]) == ("run7-t1-0", "error", "init_failed")
    assert session.stage == "done" and 0 <= session.result.timings["init"] < 60


def test_init_attempts_one_means_one_try(tmp_path: Path, sleeps: list[float]) -> None:
    runner = _runner(tmp_path, init_attempts=1)
    attempts = _failing_prepare(runner, 1)
    session = _session(runner)
    assert asyncio.run(runner.init(session)) is False
    assert attempts == [1] and sleeps == []
    assert session.result.reason == "INIT failed 1 times; last: INIT attempt 1: RuntimeError: boom 1"


def test_a_group_stopped_during_init_retries_ends_cancelled_unposted(tmp_path: Path, sleeps: list[float]) -> None:
    control = Control()
    runner = _runner(tmp_path, control, init_attempts=3)
    attempts = _failing_prepare(runner, 5)
    session = _session(runner)

    async def main() -> bool:
        original = runner._prepare

        async def prepare_then_stop(s: Session) -> None:
            runner.stopped_groups.add("t1")
            await original(s)

        runner._prepare = prepare_then_stop  # type: ignore[method-assign]
        return await runner.init(session)

    assert asyncio.run(main()) is False
    assert attempts == [1]
    assert (session.result.status, session.result.reason) == (
        S.CANCELLED,
        "early stop: the group had enough usable sessions before it ran",
    )
    assert control.statuses == []


def test_a_cancelled_init_is_not_retried(tmp_path: Path, sleeps: list[float]) -> None:
    runner = _runner(tmp_path, init_attempts=3)
    attempts: list[int] = []

    async def prepare(session: Session) -> None:
        attempts.append(1)
        raise asyncio.CancelledError

    runner._prepare = prepare  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(runner.init(_session(runner)))
    assert attempts == [1]


def test_a_task_template_is_prepared_once_into_its_own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[tuple[str, Path]] = []

    async def prepare_template(task: Task, cache: Path) -> Path:
        prepared.append((task.id, cache))
        await asyncio.sleep(0.01)  # a second caller waits for the first instead of preparing again
        return cache / "tree"

    monkeypatch.setattr(ws, "prepare_template", prepare_template)
    runner = _runner(tmp_path)
    other = Task(id="t2", instruction="x")

    async def main() -> list[Path | None]:
        return list(await asyncio.gather(runner._template(TASK), runner._template(TASK), runner._template(other)))

    first, again, second = asyncio.run(main())
    cache = tmp_path / "work" / "templates"
    assert prepared == [
        ("t1", cache / hashlib.sha256(b"t1").hexdigest()[:16]),
        ("t2", cache / hashlib.sha256(b"t2").hexdigest()[:16]),
    ]
    assert first == again == cache / hashlib.sha256(b"t1").hexdigest()[:16] / "tree"
    assert second == cache / hashlib.sha256(b"t2").hexdigest()[:16] / "tree"


def test_a_sandbox_spec_carries_the_task_the_runner_and_the_presets_paths(tmp_path: Path) -> None:
    runner = _runner(tmp_path, read_only=[Path("/usr/node")], network="none")
    spec = runner._spec(TASK, "s-0", tmp_path / "w", tmp_path / "h")
    assert spec == SandboxSpec(
        name="s-0",
        workspace=tmp_path / "w",
        home=tmp_path / "h",
        proxy=ENDPOINTS,
        network="none",
        image="img:1",
        dockerfile=Path("/env/Dockerfile"),
        workdir="/app",
        cpus=2.0,
        memory_mb=512,
        read_only=(Path("/usr/node"), Path("/opt/harness")),
        binds={},
        read_only_binds={},
        env={},
    )
    binds = {"/tests": tmp_path / "t"}
    full = runner._spec(TASK, "v", tmp_path, tmp_path, binds, {"A": "1"}, {"/ro": tmp_path / "ro"})
    assert (full.binds, full.env, full.read_only_binds) == (binds, {"A": "1"}, {"/ro": tmp_path / "ro"})
    assert isinstance(full.binds, dict) and full.binds is not binds

    class Duck:  # a preset that names no read-only paths of its own
        name = "duck"

    runner.preset = Duck()  # type: ignore[assignment]
    assert runner._spec(TASK, "s-0", tmp_path, tmp_path).read_only == (Path("/usr/node"),)


def test_templates_of_different_tasks_are_prepared_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One task's slow clone must not hold every other task's INIT: only the same task's preparations wait."""
    started: dict[str, asyncio.Event] = {}

    async def prepare_template(task: Task, cache: Path) -> Path:
        started[task.id].set()
        other = "t2" if task.id == "t1" else "t1"
        await asyncio.wait_for(started[other].wait(), 5)  # each waits for the other to have started
        return cache

    monkeypatch.setattr(ws, "prepare_template", prepare_template)
    runner = _runner(tmp_path)

    async def main() -> None:
        started.update(t1=asyncio.Event(), t2=asyncio.Event())
        await asyncio.gather(runner._template(TASK), runner._template(Task(id="t2", instruction="x")))

    asyncio.run(main())


@pytest.fixture
def fake_ws(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The workspace functions, recorded: a template copy makes the directory, a snapshot answers ``tree-1``."""
    calls: list[tuple] = []

    async def prepare_template(task: Task, cache: Path) -> Path:
        return cache

    async def copy_template(template: Path | None, dest: Path) -> None:
        calls.append(("copy", template, dest))
        dest.mkdir(parents=True)

    async def ensure_repo(workspace: Path) -> None:
        calls.append(("repo", workspace))

    async def snapshot(workspace: Path, git_dir: Path, max_growth: int | None = None) -> str:
        calls.append(("snapshot", workspace, git_dir))
        return "tree-1"

    for name, fn in [("prepare_template", prepare_template), ("copy_template", copy_template),
                     ("ensure_repo", ensure_repo), ("snapshot", snapshot)]:  # fmt: skip
        monkeypatch.setattr(ws, name, fn)
    return calls


def test_prepare_registers_first_and_gives_the_harness_only_the_secret(tmp_path: Path, fake_ws: list[tuple]) -> None:
    control = Control()
    runtime = Runtime()
    runner = _runner(tmp_path, control, runtime_object=runtime, model="pol")
    runner.context_window, runner.max_output_tokens = 4096, 512
    task = Task(id="t1", instruction="x", setup="make deps", setup_timeout_s=7.0)
    session = _session(runner, sample=2, task=task)
    stale = tmp_path / "work" / "sessions" / "run7-t1-2"
    stale.mkdir(parents=True)
    (stale / "left-over").write_text("")
    asyncio.run(runner._prepare(session))
    assert control.registered == [("run7-t1-2", "t1", "t1", 2)]
    assert session.dir == stale and not (stale / "left-over").exists()
    assert (stale.stat().st_mode & 0o777) == 0o700
    assert session.home == stale / "home" and session.home.is_dir()
    assert session.workspace == stale / "workspace"
    cache = tmp_path / "work" / "templates" / hashlib.sha256(b"t1").hexdigest()[:16]
    assert fake_ws == [
        ("copy", cache, stale / "workspace"),
        ("repo", stale / "workspace"),
        ("snapshot", stale / "workspace", stale / "base.git"),
    ]
    assert session.base_tree == "tree-1"
    [spec] = runtime.specs
    assert (spec.name, spec.workspace, spec.home) == ("run7-t1-2", stale / "workspace", stale / "home")
    [box] = runtime.boxes
    assert session.sandbox is box and box.execs == [("make deps", "/ws", 7.0)]
    assert session.ctx == SessionContext(
        session_id="run7-t1-2", task_id="t1", group_id="t1", sample=2, model="pol", proxy_url="http://127.0.0.1:8080",
        reverse_url="http://127.0.0.1:8081", ca_path="/ca", home="/home/polar", workspace="/ws", secret="psk-run7-t1-2",
        context_window=4096, max_output_tokens=512,
    )  # fmt: skip
    assert runner.preset.configured == [(stale / "home", session.ctx)]  # type: ignore[attr-defined]


def test_prepare_refuses_a_claimed_mode_proxy_unless_trusted(tmp_path: Path, fake_ws: list[tuple]) -> None:
    runner = _runner(tmp_path, Control(mode="claimed"))
    session = _session(runner)
    with pytest.raises(ControlError):
        asyncio.run(runner._prepare(session))
    assert session.sandbox is None and fake_ws == []
    ca = tmp_path / "ca.pem"
    trusted = _runner(tmp_path, Control(mode="claimed"), proxy=ExternalProxy("http://127.0.0.1:1", "t" * 16, ca=ca,
                                                                             trust_claimed=True))  # fmt: skip
    session = _session(trusted)
    asyncio.run(trusted._prepare(session))
    assert session.ctx is not None and session.ctx.secret == "psk-run7-t1-0"


def test_a_failing_setup_says_its_exit_and_output_tail(tmp_path: Path, fake_ws: list[tuple]) -> None:
    class SetupFails(Runtime):
        def __init__(self, result: ExecResult) -> None:
            super().__init__()
            self.result = result

        async def start(self, spec: SandboxSpec) -> Box:
            box = await super().start(spec)
            box.result = self.result
            return box

    task = Task(id="t1", instruction="x", setup="make")
    for result, message in [
        (ExecResult(2, "out", ""), "setup exited 2: out"),
        (ExecResult(-1, "", "e" * 2500, timed_out=True), "setup exited -1 (timed out): " + "e" * 2000),
        (ExecResult(1, "so", "se"), "setup exited 1: se"),
    ]:
        runner = _runner(tmp_path, runtime_object=SetupFails(result))
        session = _session(runner, task=task)
        with pytest.raises(RuntimeError) as err:
            asyncio.run(runner._prepare(session))
        assert str(err.value) == message
        assert session.ctx is None
    no_setup = _runner(tmp_path, runtime_object=Runtime())
    session = _session(no_setup)
    asyncio.run(no_setup._prepare(session))
    assert session.sandbox is not None and session.sandbox.execs == []  # type: ignore[attr-defined]


def test_a_workspace_only_inside_the_sandbox_is_snapshotted_from_a_download(
    tmp_path: Path, fake_ws: list[tuple]
) -> None:
    class Inside(Runtime):
        async def start(self, spec: SandboxSpec) -> Box:
            box = await super().start(spec)
            box.host_workspace = None
            return box

    runner = _runner(tmp_path, runtime_object=Inside())
    session = _session(runner)
    asyncio.run(runner._prepare(session))
    assert session.dir is not None
    assert session.sandbox.downloads == [("/ws", session.dir / "base-view")]  # type: ignore[union-attr]
    assert fake_ws[-1] == ("snapshot", session.dir / "base-view", session.dir / "base.git")


def test_the_workspace_is_read_in_place_or_downloaded_fresh(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    session = _session(runner)
    session.dir = tmp_path / "s"
    session.sandbox = Box(host_workspace=tmp_path / "in-place")
    assert asyncio.run(runner._workspace_view(session, "v")) == tmp_path / "in-place"
    box = Box()
    session.sandbox = box
    (tmp_path / "s" / "v").mkdir(parents=True)
    (tmp_path / "s" / "v" / "stale").write_text("")
    assert asyncio.run(runner._workspace_view(session, "v")) == tmp_path / "s" / "v"
    assert box.downloads == [("/ws", tmp_path / "s" / "v")]
    assert not (tmp_path / "s" / "v" / "stale").exists()
    assert asyncio.run(runner._workspace_view(session, "first")) == tmp_path / "s" / "first"  # nothing to remove


# --- POSTRUN ---------------------------------------------------------------------------------------------------------


def _verified(runner: SessionRunner, outcome: Any, patch_bytes: int = 12) -> Session:
    """A session that ran, POSTRUN'd with ``_verify`` answering ``outcome`` (or raising it)."""

    async def verify(session: Session) -> tuple:
        session.result.patch_bytes = patch_bytes
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    runner._verify = verify  # type: ignore[method-assign]
    session = _session(runner)
    session.result.ran = True
    session.sandbox = Box()
    runner._move(session, "run")
    asyncio.run(runner.postrun(session))
    return session


def _labels(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k not in ("rollout", "task", "group", "sample", "harness")}


def test_a_verified_session_posts_each_reward_then_completed(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control)
    session = _verified(runner, (S.COMPLETED, None, {"reward": 0.5, "tests": 1.0}))
    assert control.rewards == [("run7-t1-0", 0.5, "reward"), ("run7-t1-0", 1.0, "tests")]
    assert (session.result.status, session.result.reward, session.result.rewards) == (
        S.COMPLETED,
        0.5,
        {"reward": 0.5, "tests": 1.0},
    )
    [(_, status, metadata)] = control.statuses
    assert (status, _labels(metadata)) == ("completed", {"patch_bytes": 12})
    assert session.sandbox is None and session.stage == "done" and 0 <= session.result.timings["postrun"] < 60
    assert runner.progress.group_rewards["t1"] == [0.5]


def test_a_session_is_in_postrun_while_it_is_verified(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    seen: list[tuple] = []

    async def verify(session: Session) -> tuple:
        seen.append((session.stage, runner.progress.stages["postrun"], runner.progress.stages["run"]))
        return S.COMPLETED, None, {"reward": 1.0}

    runner._verify = verify  # type: ignore[method-assign]
    session = _session(runner)
    runner._move(session, "run")
    asyncio.run(runner.postrun(session))
    assert seen == [("postrun", 1, 0)]
    assert runner.progress.stages["postrun"] == 0 and runner.progress.stages["done"] == 1


def test_a_zero_the_verifier_did_not_give_says_why(tmp_path: Path) -> None:
    control = Control()
    reason = "reward.txt is missing: scored 0" + "." * 600
    session = _verified(_runner(tmp_path, control), (S.COMPLETED, reason, {"reward": 0.0}))
    assert (session.result.reason, session.result.reward) == (reason, 0.0)
    assert _labels(control.statuses[0][2]) == {"patch_bytes": 12, "scored": reason[:500]}
    assert control.rewards == [("run7-t1-0", 0.0, "reward")]


def test_a_failed_session_is_posted_with_its_failure_and_no_reward_post(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control)
    nothing = _verified(runner, (S.FAILED, "the harness produced nothing", {"reward": 0.0}))
    assert (nothing.result.status, nothing.result.reward, nothing.result.rewards) == (S.FAILED, 0.0, {"reward": 0.0})
    assert control.rewards == []
    assert control.statuses[0][1] == "agent_error"
    assert _labels(control.statuses[0][2]) == {"patch_bytes": 12, "reason": "harness_produced_nothing"}

    async def too_large(session: Session) -> tuple:
        session.failure = "patch_too_large"
        return S.FAILED, "patch over 10 bytes", {"reward": 0.0}

    runner._verify = too_large  # type: ignore[method-assign]
    session = _session(runner, 1)
    asyncio.run(runner.postrun(session))
    assert _labels(control.statuses[1][2]) == {"patch_bytes": 0, "reason": "patch_too_large"}


def test_a_verifier_that_fails_is_an_error_without_a_reward(tmp_path: Path) -> None:
    control = Control()
    session = _verified(_runner(tmp_path, control), RuntimeError("verification failed 2 times"))
    assert (session.result.status, session.result.reason, session.result.reward, session.result.rewards) == (
        S.ERROR,
        "POSTRUN: RuntimeError: verification failed 2 times",
        None,
        {},
    )
    assert control.rewards == []
    assert (control.statuses[0][1], _labels(control.statuses[0][2])) == (
        "error",
        {"patch_bytes": 12, "reason": "verifier_failed"},
    )
    assert session.sandbox is None


def test_a_reward_the_store_refused_makes_the_session_an_error(tmp_path: Path) -> None:
    control = Control()
    control.fail_reward_after = 1
    session = _verified(_runner(tmp_path, control, early_stop=1), (S.COMPLETED, None, {"reward": 1.0, "b": 0.0}))
    assert (session.result.status, session.result.reason) == (S.ERROR, "the reward could not be stored: 503 twice")
    assert control.statuses[0][1] == "error" and _labels(control.statuses[0][2])["reason"] == "verifier_failed"


def test_postrun_early_stops_the_group_once_it_is_usable(tmp_path: Path) -> None:
    runner = _runner(tmp_path, early_stop=1)
    _verified(runner, (S.COMPLETED, None, {"reward": 1.0}))
    assert runner.stopped_groups == {"t1"}
    errored = _runner(tmp_path, early_stop=1)
    _verified(errored, RuntimeError("x"))
    assert errored.stopped_groups == set()


def test_a_cancelled_verification_propagates_after_teardown(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control)
    with pytest.raises(asyncio.CancelledError):
        _verified(runner, asyncio.CancelledError())
    assert control.statuses == []


@pytest.fixture
def verify_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A session whose run is over, with ``ws.diff`` answering ``patch[0]`` (bytes, or an exception to raise)."""
    patch: list[Any] = [b""]
    diffs: list[tuple] = []

    async def diff(workspace: Path, git_dir: Path, base_tree: str, max_bytes: int) -> bytes:
        diffs.append((workspace, git_dir, base_tree, max_bytes))
        if isinstance(patch[0], Exception):
            raise patch[0]
        return patch[0]

    monkeypatch.setattr(ws, "diff", diff)

    def make(runner: SessionRunner, exit_code: int = 0, output: str = "") -> Session:
        session = _session(runner)
        session.dir, session.base_tree = tmp_path / "s", "base"
        session.sandbox = Box(host_workspace=tmp_path / "w")
        session.result.exit_code, session.agent_output = exit_code, output
        return session

    return make, patch, diffs


def test_a_harness_that_produced_nothing_is_failed_unverified(tmp_path: Path, verify_session) -> None:
    make, patch, diffs = verify_session
    runner = _runner(tmp_path, max_patch_bytes=99)
    once: list[Path] = []

    async def verify_once(session: Session, verifier: Any, vdir: Path, patch: bytes) -> tuple:
        once.append(vdir)
        return S.COMPLETED, None, {"reward": 1.0}

    runner._verify_once = verify_once  # type: ignore[method-assign]
    session = make(runner, output=" \n")
    box = session.sandbox
    assert asyncio.run(runner._verify(session)) == (
        S.FAILED,
        "the harness produced nothing: no stdout and no change to the workspace",
        {"reward": 0.0},
    )
    assert diffs == [(tmp_path / "w", tmp_path / "s" / "base.git", "base", 99)]
    assert once == [] and session.sandbox is None and box.stops == 1  # type: ignore[union-attr]
    # Any output, any change, or a non-zero exit (a signal the runner did not see as failure): verified.
    for exit_code, output, change in [(0, "done", b""), (0, "", b"diff"), (1, "", b"")]:
        patch[0] = change
        session = make(runner, exit_code, output)
        assert asyncio.run(runner._verify(session)) == (S.COMPLETED, None, {"reward": 1.0})
        assert session.result.patch_bytes == len(change)
    assert once == [tmp_path / "s" / "verify-1"] * 3


def test_the_tasks_verifier_gets_the_session_and_its_patch_from_a_downloaded_workspace(
    tmp_path: Path, verify_session
) -> None:
    make, patch, diffs = verify_session
    patch[0] = b"+x\n"
    runner = _runner(tmp_path)
    got: list[tuple] = []

    async def verify_once(session: Session, verifier: Any, vdir: Path, patch: bytes) -> tuple:
        got.append((session, type(verifier).__name__, verifier.task, vdir, patch))
        return S.COMPLETED, None, {"reward": 1.0}

    runner._verify_once = verify_once  # type: ignore[method-assign]
    session = make(runner)
    box = session.sandbox
    box.host_workspace = None  # type: ignore[union-attr]
    assert asyncio.run(runner._verify(session)) == (S.COMPLETED, None, {"reward": 1.0})
    assert box.downloads == [("/ws", tmp_path / "s" / "final-view")]  # type: ignore[union-attr]
    assert diffs[0][0] == tmp_path / "s" / "final-view"
    assert got == [(session, "ExitCodeVerifier", TASK, tmp_path / "s" / "verify-1", b"+x\n")]
    assert session.result.patch_bytes == 3


def test_a_workspace_the_agent_removed_is_its_failure_not_a_mask(tmp_path: Path, verify_session) -> None:
    make, _, diffs = verify_session
    runner = _runner(tmp_path)
    session = make(runner, output="x")

    class Gone(Box):
        async def download(self, remote: str, local: Path) -> None:
            raise FileNotFoundError(f"{remote}: no such directory")

    box = session.sandbox = Gone()
    assert asyncio.run(runner._verify(session)) == (
        S.FAILED,
        "the workspace was gone after the run: /ws: no such directory",
        {"reward": 0.0},
    )
    assert session.failure == "workspace_gone" and session.sandbox is None and box.stops == 1 and diffs == []


def test_a_patch_over_the_bound_is_failed_before_any_verifier(tmp_path: Path, verify_session) -> None:
    make, patch, _ = verify_session
    patch[0] = ws.PatchTooLarge("the patch is over 99 bytes")
    runner = _runner(tmp_path)
    session = make(runner, output="x")
    assert asyncio.run(runner._verify(session)) == (S.FAILED, "the patch is over 99 bytes", {"reward": 0.0})
    assert session.failure == "patch_too_large" and session.sandbox is None


def test_the_verifier_sandbox_is_retried_then_the_last_failure_said(
    tmp_path: Path, verify_session, caplog: pytest.LogCaptureFixture
) -> None:
    make, patch, _ = verify_session
    patch[0] = b"diff"
    runner = _runner(tmp_path, verify_attempts=3)
    tried: list[Path] = []

    async def verify_once(session: Session, verifier: Any, vdir: Path, patch: bytes) -> tuple:
        tried.append(vdir)
        raise OSError(f"no sandbox {len(tried)}")

    runner._verify_once = verify_once  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="polar.rollout"), pytest.raises(RuntimeError) as err:
        asyncio.run(runner._verify(make(runner)))
    assert str(err.value) == "verification failed 3 times; last: no sandbox 3"
    assert tried == [tmp_path / "s" / f"verify-{n}" for n in (1, 2, 3)]
    assert caplog.records[0].getMessage() == "polar rollout: run7-t1-0: verify attempt 1: no sandbox 1"

    async def verifier_error(session: Session, verifier: Any, vdir: Path, patch: bytes) -> tuple:
        tried.append(vdir)
        raise VerifierError("the verify env names an unset variable")

    tried.clear()
    runner._verify_once = verifier_error  # type: ignore[method-assign]
    with pytest.raises(VerifierError):
        asyncio.run(runner._verify(make(runner)))
    assert len(tried) == 1


def test_the_patch_is_logged_before_the_verifier_runs(tmp_path: Path, verify_session) -> None:
    make, patch, _ = verify_session
    patch[0] = b"+caf\xc3\xa9 \xff\n"
    runner = _runner(tmp_path, logs_dir=tmp_path / "logs")

    async def verify_once(session: Session, verifier: Any, vdir: Path, patch: bytes) -> tuple:
        return S.COMPLETED, None, {"reward": 1.0}

    runner._verify_once = verify_once  # type: ignore[method-assign]
    asyncio.run(runner._verify(make(runner)))
    log_file = tmp_path / "logs" / "sessions" / "run7-t1-0" / "patch.diff"
    assert log_file.read_text() == "+café \ufffd\n"


# --- posting, logs, teardown -----------------------------------------------------------------------------------------


def test_a_status_post_carries_the_rollouts_labels_and_the_stored_name(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control, status_metadata={"run": "nightly", "harness": "overridden"})
    session = _session(runner, sample=5)
    for status, stored in [(S.FAILED, "agent_error"), (S.CANCELLED, "error"), (S.TIMEOUT, "timeout")]:
        asyncio.run(runner._post_status(session, status, {"reason": "r", "sample": 99}))
        assert control.statuses[-1] == (
            "run7-t1-5",
            stored,
            {"rollout": "run7", "task": "t1", "group": "t1", "sample": 99, "harness": "overridden", "run": "nightly",
             "reason": "r"},
        )  # fmt: skip
    assert session.result.posted
    asyncio.run(runner._post_status(session, S.COMPLETED, {}))
    assert control.statuses[-1][2] == {
        "rollout": "run7", "task": "t1", "group": "t1", "sample": 5, "harness": "overridden", "run": "nightly",
    }  # fmt: skip
    plain = _runner(tmp_path, control)
    asyncio.run(plain._post_status(_session(plain), S.COMPLETED, {}))
    assert control.statuses[-1][2]["harness"] == "fake-harness"


def test_the_proxys_error_is_final_for_a_usable_session(tmp_path: Path) -> None:
    control = Control(answer=("error", "engine e1 taken out"))
    runner = _runner(tmp_path, control, early_stop=1)
    session = _session(runner)
    session.result.reward = 1.0
    runner._finish(session, S.COMPLETED)
    asyncio.run(runner._post_status(session, S.COMPLETED, {}))
    assert (session.result.status, session.result.reason) == (
        S.ERROR,
        "ended as error by the proxy before the runner's completed: engine e1 taken out",
    )
    assert runner.usable["t1"] == 0 and runner.progress.group_rewards["t1"] == []
    failed = _session(runner, 1)
    runner._finish(failed, S.FAILED)
    asyncio.run(runner._post_status(failed, S.FAILED, {}))
    assert failed.result.reason == "ended as error by the proxy before the runner's agent_error: engine e1 taken out"
    cancelled = _session(runner, 2)
    runner._finish(cancelled, S.CANCELLED, "early stop")
    asyncio.run(runner._post_status(cancelled, S.CANCELLED, {}))
    assert (cancelled.result.status, cancelled.result.reason) == (S.CANCELLED, "early stop")
    agreed = Control(answer=("completed", None))
    ok = _runner(tmp_path, agreed)
    kept = _session(ok)
    ok._finish(kept, S.COMPLETED)
    asyncio.run(ok._post_status(kept, S.COMPLETED, {}))
    assert kept.result.status == S.COMPLETED and kept.result.reason is None


def test_a_status_the_proxy_never_stored_is_shown_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    control = Control()
    control.fail_status = RuntimeError("connection refused " + "z" * 300)
    runner = _runner(tmp_path, control)
    session = _session(runner)
    with caplog.at_level(logging.ERROR, logger="polar.rollout"):
        asyncio.run(runner._post_status(session, S.COMPLETED, {}))
    assert not session.result.posted
    [(sid, text)] = runner.progress.errors
    assert sid == "run7-t1-0" and text == ("status not stored: connection refused " + "z" * 300)[:200]
    assert caplog.records[0].getMessage().startswith("polar rollout: run7-t1-0: status not stored: connection refused")


def test_session_logs_are_written_redacted_only_when_asked(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    proxy = ExternalProxy("http://127.0.0.1:1", "control-token-0123456789", ca=ca)
    runner = _runner(tmp_path, logs_dir=tmp_path / "logs", proxy=proxy)
    session = _session(runner)
    session.ctx = SessionContext("s", "t", "g", 0, "m", "p", "r", "c", "h", "w", secret="psk-the-secret-value")
    runner._write_log(session, "harness.log", "key psk-the-secret-value token control-token-0123456789 end")
    runner._write_log(session, "harness.log", "second write replaces")
    path = tmp_path / "logs" / "sessions" / "run7-t1-0" / "harness.log"
    assert path.read_text() == "second write replaces"
    runner._write_log(session, "a.log", "key psk-the-secret-value token control-token-0123456789 end")
    assert (path.parent / "a.log").read_text() == "key <redacted> token <redacted> end"
    quiet = _runner(tmp_path / "q")
    quiet._write_log(_session(quiet), "harness.log", "x")
    assert not (tmp_path / "q").exists() and not (Path.cwd() / "sessions").exists()


def test_teardown_stops_the_sandbox_once_and_removes_the_directory_unless_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for keep in (False, True):
        runner = _runner(tmp_path, keep_sessions=keep)
        session = _session(runner)
        box = Box(fail_stop=True)
        session.sandbox, session.dir = box, tmp_path / f"s-{keep}"
        (session.dir / "home").mkdir(parents=True)
        with caplog.at_level(logging.WARNING, logger="polar.rollout"):
            asyncio.run(runner.teardown(session))
            asyncio.run(runner.teardown(session))
        assert box.stops == 1 and session.sandbox is None
        assert session.dir.exists() is keep
    assert [r.getMessage() for r in caplog.records] == [
        "polar rollout: run7-t1-0: sandbox stop failed: already gone"
    ] * 2
    runner = _runner(tmp_path)
    asyncio.run(runner.teardown(_session(runner)))  # nothing started: nothing to do


# --- one verification ------------------------------------------------------------------------------------------------


class Judge(Verifier):
    """A verifier that records when it is asked what, and decides ``outcome`` (rewards, or an exception raised)."""

    def __init__(self, task: Task) -> None:
        super().__init__(task)
        self.calls: list[tuple] = []
        self.outcome: Any = {"reward": 1.0, "style": 0.5}

    async def layout(self, vdir: Path, home: Path) -> VerifyLayout:
        self.calls.append(("layout", vdir, home))
        (vdir / "agent").mkdir()
        return VerifyLayout(vdir, vdir / "agent", {"/logs/v": vdir / "v"}, {"/tests": vdir / "t"})

    async def before(self, sandbox: Sandbox) -> None:
        self.calls.append(("before", len(sandbox.execs), sandbox.stops))  # type: ignore[attr-defined]

    async def collect(self, sandbox: Sandbox, layout: VerifyLayout) -> None:
        self.calls.append(("collect", sandbox.stops, layout.dir))  # type: ignore[attr-defined]

    def decide(self, done: ExecResult, guarded: bool, layout: VerifyLayout, host: Path | None) -> dict[str, float]:
        self.calls.append(("decide", done, guarded, layout.dir, host))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class IsoBox(Box, IsolatedSandbox):
    """A sandbox with its own pid namespace (bwrap, oci): the verify command runs under the guard."""


class OneBox(Runtime):
    def __init__(self, box: Box, in_place: bool = True) -> None:
        super().__init__()
        self.box, self.in_place = box, in_place

    async def start(self, spec: SandboxSpec) -> Box:
        self.specs.append(spec)
        self.box.host_workspace = spec.workspace if self.in_place else None
        return self.box


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch, fake_ws: list[tuple]) -> list[tuple]:
    """The patches applied in place (``ws.apply``), recorded."""
    calls: list[tuple] = []

    async def apply(workspace: Path, git_dir: Path, patch: bytes) -> None:
        calls.append((workspace, git_dir, patch))

    monkeypatch.setattr(ws, "apply", apply)
    return calls


def _verify_once(tmp_path: Path, box: Box, task: Task, patch: bytes, in_place: bool = True, **fields: Any):
    runtime = OneBox(box, in_place)
    runner = _runner(tmp_path, runtime_object=runtime, tasks=[task], **fields)
    session = _session(runner, task=task)
    session.agent_output = "my final answer"
    judge = Judge(task)
    vdir = tmp_path / "s" / "verify-2"
    outcome = asyncio.run(runner._verify_once(session, judge, vdir, patch))
    return outcome, judge, runtime, vdir


def test_a_verification_runs_the_verify_command_in_a_fresh_sandbox_of_the_task(
    tmp_path: Path, applied: list[tuple], fake_ws: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POLAR_TEST_UNSET_VAR", raising=False)
    task = Task(id="t1", instruction="x", verify="pytest -q", verify_timeout_s=33.0,
                verify_env={"MODE": "${POLAR_TEST_UNSET_VAR:-ci}"})  # fmt: skip
    stale = tmp_path / "s" / "verify-2"
    (stale / "old").mkdir(parents=True)
    box = Box()
    box.result = ExecResult(0, "4 passed", "warn")
    outcome, judge, runtime, vdir = _verify_once(tmp_path, box, task, b"", logs_dir=tmp_path / "logs")
    assert outcome == (S.COMPLETED, None, {"reward": 1.0, "style": 0.5})
    assert not (vdir / "old").exists() and (vdir / "home").is_dir()
    cache = tmp_path / "work" / "templates" / hashlib.sha256(b"t1").hexdigest()[:16]
    assert fake_ws == [("copy", cache, vdir / "workspace")] and applied == []
    assert (vdir / "agent" / "stdout.txt").read_text() == "my final answer"
    [spec] = runtime.specs
    assert (spec.name, spec.workspace, spec.home) == ("run7-t1-0-verify", vdir / "workspace", vdir / "home")
    assert (spec.binds, spec.read_only_binds) == ({"/logs/v": vdir / "v"}, {"/tests": vdir / "t"})
    assert box.execs == [("pytest -q", "/ws", 33.0)]
    # The verifier's own place for the harness's stdout in this sandbox (the default: under its HOME).
    assert box.envs == [{"MODE": "ci", "POLAR_AGENT_OUTPUT": "/home/polar/.polar-agent/stdout.txt"}]
    assert judge.calls == [
        ("layout", vdir, vdir / "home"),
        ("before", 0, 0),
        ("collect", 0, vdir),  # before the stop: an image's files are copied out while it runs
        ("decide", box.result, False, vdir, vdir / "workspace"),  # after it: nothing can rewrite the reward then
    ]
    assert box.stops == 1
    log_file = tmp_path / "logs" / "sessions" / "run7-t1-0" / "verifier.log"
    assert log_file.read_text() == "exit 0\n--- stdout\n4 passed\n--- stderr\nwarn"


def test_no_verify_command_runs_true(tmp_path: Path, applied: list[tuple]) -> None:
    box = Box()
    _verify_once(tmp_path, box, Task(id="t1", instruction="x"), b"")
    assert box.execs == [("true", "/ws", 300.0)]


def test_setup_then_the_patch_applied_in_place_or_uploaded(tmp_path: Path, applied: list[tuple]) -> None:
    task = Task(id="t1", instruction="x", setup="make deps", setup_timeout_s=9.0, verify="v")
    box = Box()
    (_, _, _, vdir) = _verify_once(tmp_path, box, task, b"+fix\n")
    assert applied == [(vdir / "workspace", vdir / "apply.git", b"+fix\n")]
    assert box.execs == [("make deps", "/ws", 9.0), ("v", "/ws", 300.0)]
    assert box.envs[0] is None and box.uploads == []

    applied.clear()
    inside = Box()
    (_, judge, _, vdir) = _verify_once(tmp_path / "b", inside, task, b"+fix\n", in_place=False)
    assert applied == []
    assert (vdir / "agent.patch").read_bytes() == b"+fix\n"
    assert inside.uploads == [(b"+fix\n", "/tmp/polar-agent.patch")]
    assert inside.execs == [
        ("make deps", "/ws", 9.0),
        (["git", "apply", "--binary", "/tmp/polar-agent.patch"], "/ws", 120),
        ("v", "/ws", 300.0),
    ]
    assert judge.calls[1] == ("before", 2, 0)  # after the setup and the patch, before the command
    assert judge.calls[-1][-1] is None  # no workspace on the host to read from


def test_a_setup_or_patch_that_fails_in_the_verifiers_sandbox_is_infrastructure(
    tmp_path: Path, applied: list[tuple]
) -> None:
    task = Task(id="t1", instruction="x", setup="make")
    box = Box()
    box.answers = [ExecResult(3, "o" * 10, "e" * 2500)]
    with pytest.raises(RuntimeError) as err:
        _verify_once(tmp_path, box, task, b"+x")
    assert str(err.value) == "setup exited 3 in the verifier's sandbox: " + "e" * 2000
    assert box.stops == 1 and applied == [] and len(box.execs) == 1

    inside = Box()
    inside.answers = [ExecResult(0, "", ""), ExecResult(1, "", "error: corrupt patch at line 3")]
    with pytest.raises(RuntimeError) as err:
        _verify_once(tmp_path / "b", inside, task, b"+x", in_place=False)
    assert str(err.value) == "the patch does not apply: error: corrupt patch at line 3"
    assert inside.stops == 1 and len(inside.execs) == 2


def test_where_the_sandbox_has_its_own_pids_the_verify_command_runs_under_the_guard(
    tmp_path: Path, applied: list[tuple]
) -> None:
    box = IsoBox()
    _, judge, _, _ = _verify_once(tmp_path, box, Task(id="t1", instruction="x", verify="pytest"), b"")
    assert box.execs[0][0] == ["/bin/sh", "-c", VERIFY_GUARD, "polar-verify-guard", "/bin/sh", "-c", "pytest"]
    assert judge.calls[-1][2] is True


def test_a_cancelled_verifier_is_the_runners_doing_not_a_score(tmp_path: Path, applied: list[tuple]) -> None:
    box = Box()
    box.result = ExecResult(-1, "", "", cancelled=True)
    with pytest.raises(RuntimeError) as err:
        _verify_once(tmp_path, box, Task(id="t1", instruction="x"), b"")
    assert str(err.value) == "the verifier was cancelled" and box.stops == 1


def test_a_verifier_run_out_of_memory_or_without_a_reward_scores_0(tmp_path: Path, applied: list[tuple]) -> None:
    box = Box()
    box.result = ExecResult(-9, "", "", oom_killed=True)
    outcome, judge, _, _ = _verify_once(tmp_path, box, Task(id="t1", instruction="x"), b"")
    assert outcome == (
        S.COMPLETED,
        "the verifier was killed by the runtime's memory limit (OOM): scored 0",
        {"reward": 0.0},
    )
    assert [c[0] for c in judge.calls] == ["layout", "before", "collect"]  # never read: nothing it wrote counts

    class Silent(Judge):
        def __init__(self, task: Task) -> None:
            super().__init__(task)
            self.outcome = NoReward("the verifier wrote no reward.txt")

    runner = _runner(tmp_path / "b", runtime_object=OneBox(Box()))
    session = _session(runner)
    outcome = asyncio.run(runner._verify_once(session, Silent(TASK), tmp_path / "b" / "v", b""))
    assert outcome == (S.COMPLETED, "the verifier wrote no reward.txt: scored 0", {"reward": 0.0})


# --- RUN -------------------------------------------------------------------------------------------------------------


def _ready(runner: SessionRunner, box: Box, sample: int = 0, task: Task = TASK) -> Session:
    session = _session(runner, sample, task)
    session.sandbox = box
    session.ctx = SessionContext(session.session_id, task.id, task.id, sample, "m", "p", "r", "c", "/h", "/ws", "psk-1")
    runner._move(session, "ready")
    session.ready_at = session_mod.time.monotonic()
    return session


class Watched(Box):
    """A harness sandbox that says, while its harness runs, whether the runner counts the session as running."""

    def __init__(self, runner: SessionRunner, result: ExecResult | BaseException) -> None:
        super().__init__()
        self.runner, self.outcome = runner, result
        self.seen: list[bool] = []

    async def exec(self, command, *, env=None, cwd=None, timeout_s=None, stdin=None) -> ExecResult:
        await super().exec(command, env=env, cwd=cwd, timeout_s=timeout_s)
        self.seen.append(any(self.runner.running.values()))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _run(tmp_path: Path, result: ExecResult | BaseException, task: Task = TASK, **fields: Any):
    control = Control()
    runner = _runner(tmp_path, control, **fields)
    box = Watched(runner, result)
    session = _ready(runner, box, task=task)
    go_on = asyncio.run(runner.run(session))
    return go_on, session, box, control, runner


def test_a_harness_that_exits_0_goes_on_to_postrun(tmp_path: Path) -> None:
    task = Task(id="t1", instruction="fix the bug", agent_timeout_s=77.0)
    done = ExecResult(0, "all done", "a warning")
    go_on, session, box, control, runner = _run(
        tmp_path, done, task, env={"SHARED": "user", "EXTRA": "1"}, logs_dir=tmp_path / "logs"
    )
    assert go_on is True and session.stage == "run" and control.statuses == []
    assert box.execs == [(["agent", "--session", "run7-t1-0", "fix the bug"], "/ws", 77.0)]
    assert box.envs == [
        {"SHARED": "preset", "EXTRA": "1", "OPENAI_API_KEY": "polar:psk-1", "POLAR_INSTRUCTION": "fix the bug"}
    ]
    assert box.seen == [True] and runner.running == {"t1": []}  # running while it ran, not after
    assert (session.result.ran, runner.progress.ran, session.result.exit_code) == (True, 1, 0)
    assert session.agent_output == "all done" and box.stops == 0
    assert 0 <= session.result.timings["wait"] < 60 and 0 <= session.result.timings["run"] < 60
    log_file = tmp_path / "logs" / "sessions" / "run7-t1-0" / "harness.log"
    assert log_file.read_text() == "exit 0\n--- stdout\nall done\n--- stderr\na warning"


def test_the_rollouts_deadline_wins_over_the_tasks(tmp_path: Path) -> None:
    task = Task(id="t1", instruction="x", agent_timeout_s=600.0)
    go_on, session, box, control, _ = _run(tmp_path, ExecResult(-1, "", "", timed_out=True), task, timeout_s=1.5)
    assert box.execs[0][2] == 1.5 and go_on is False
    assert (session.result.status, session.result.reason) == (S.TIMEOUT, "the harness ran past its 1.5 s deadline")
    [(_, status, metadata)] = control.statuses
    assert (status, _labels(metadata)) == ("timeout", {"reason": "timeout", "deadline_s": 1.5})
    assert box.stops == 1 and session.stage == "done" and session.result.reward is None


def test_a_harness_that_exits_non_zero_is_the_policys_failure_with_reward_0(tmp_path: Path) -> None:
    go_on, session, box, control, _ = _run(tmp_path, ExecResult(2, "o" * 10, "e" * 2500))
    assert go_on is False
    assert (session.result.status, session.result.reason) == (S.FAILED, "the harness exited 2: " + "e" * 2000)
    assert (session.result.reward, session.result.rewards) == (0.0, {"reward": 0.0})
    [(_, status, metadata)] = control.statuses
    assert (status, _labels(metadata)) == (
        "agent_error",
        {"reason": "harness_failed", "exit_code": 2, "oom_killed": False, "limit": None},
    )
    assert box.stops == 1 and control.rewards == []  # the 0 is the runner's; no reward post
    _, quiet, _, _, _ = _run(tmp_path / "q", ExecResult(1, "only stdout", ""))
    assert quiet.result.reason == "the harness exited 1: only stdout"
    _, oom, _, control, _ = _run(tmp_path / "m", ExecResult(-9, "", "Killed", oom_killed=True, limit="memory"))
    assert oom.result.reason == "the harness exited -9 (killed by the runtime's memory limit: OOM): Killed"
    assert _labels(control.statuses[0][2]) == {
        "reason": "harness_failed",
        "exit_code": -9,
        "oom_killed": True,
        "limit": "memory",
    }


def test_a_cancelled_harness_is_masked_never_scored(tmp_path: Path) -> None:
    cancelled = ExecResult(-1, "", "", cancelled=True)
    go_on, session, _, control, _ = _run(tmp_path, cancelled)
    assert go_on is False
    assert (session.result.status, session.result.reason) == (S.ERROR, "cancelled by the runner while running")
    assert _labels(control.statuses[0][2]) == {"reason": "cancelled", "cancelled": True}

    control = Control()
    runner = _runner(tmp_path / "e", control)
    box = Watched(runner, cancelled)
    session = _ready(runner, box)

    async def stop_then_run() -> bool:
        original = box.exec

        async def exec_and_stop(*args: Any, **kwargs: Any) -> ExecResult:
            runner.stopped_groups.add("t1")  # the group's early stop came while the harness ran
            return await original(*args, **kwargs)

        box.exec = exec_and_stop  # type: ignore[method-assign]
        return await runner.run(session)

    assert asyncio.run(stop_then_run()) is False
    assert (session.result.status, session.result.reason) == (S.CANCELLED, "early stop: cancelled while running")
    assert (control.statuses[0][1], _labels(control.statuses[0][2])) == (
        "error",
        {"reason": "cancelled", "cancelled": True},
    )


def test_a_runtime_that_fails_under_the_harness_is_infrastructure(tmp_path: Path) -> None:
    go_on, session, box, control, runner = _run(tmp_path, OSError("bwrap died"))
    assert go_on is False and runner.running == {"t1": []}
    assert (session.result.status, session.result.reason) == (
        S.ERROR,
        "the runtime failed during RUN: OSError: bwrap died",
    )
    assert session.result.exit_code is None and 0 <= session.result.timings["run"] < 60
    assert (control.statuses[0][1], _labels(control.statuses[0][2])) == ("error", {"reason": "runtime_failed"})
    with pytest.raises(asyncio.CancelledError):
        _run(tmp_path / "c", asyncio.CancelledError())


def test_a_stopped_group_never_runs_its_ready_session(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control)
    box = Box()
    session = _ready(runner, box)
    runner.stopped_groups.add("t1")
    assert asyncio.run(runner.run(session)) is False
    assert (session.result.status, session.result.reason) == (
        S.CANCELLED,
        "early stop: the group had enough usable sessions before it ran",
    )
    assert box.execs == [] and box.stops == 1 and not session.result.ran and control.statuses == []


def test_early_stop_comes_once_the_group_has_as_many_usable_sessions_as_asked(tmp_path: Path) -> None:
    control = Control()
    runner = _runner(tmp_path, control, early_stop=2)
    for sample, result, stopped in [
        (0, ExecResult(-1, "", "", cancelled=True), set()),  # error: not usable
        (1, ExecResult(1, "", "x"), set()),  # failed: usable, one of two
        (2, ExecResult(-1, "", "", timed_out=True), {"t1"}),  # timeout: usable, two of two
    ]:
        session = _ready(runner, Watched(runner, result), sample)
        asyncio.run(runner.run(session))
        assert runner.stopped_groups == stopped, sample
    assert runner.progress.ran == 3
    never = _runner(tmp_path / "n", Control())
    asyncio.run(never.run(_ready(never, Watched(never, ExecResult(1, "", "")))))
    assert never.stopped_groups == set()
