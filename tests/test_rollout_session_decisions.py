"""The session runner's decisions, each against what really happens (issue 29: a wrong deadline and a wrong early-stop
count passed every test): a harness that hangs against the wall clock, early stop over sessions running at once, the
statuses and rewards posted to a real proxy's store, INIT's retries, the verifier's retries.

The harness is a plain shell command (``cmd:sh -c {instruction}``: the instruction is the script), on the local
runtime, so a session takes a fraction of a second; the proxy is a real mitmdump + polar addon (the scripted engine,
never called: the runner only registers sessions and posts their statuses and rewards)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from polar_addon.store import read_sessions
from polar_addon.store.status import SessionStatus
from polar_cli.rollout.config import RolloutConfig
from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.proxy import ControlClient, ExternalProxy, StartedProxy, start_proxy
from polar_cli.rollout.runner import plan_sessions
from polar_cli.rollout.runtimes import get_runtime
from polar_cli.rollout.session import RolloutProgress, SessionResult, SessionRunner
from polar_cli.rollout.tasks import load_tasks
from tests.support.shards import wait_for_shards

S = SessionStatus
HARNESS = "cmd:sh -c {instruction}"
# Sample 0 answers after 2 s (every other sample's harness has started by then); the others would sleep far past any
# test's time, so they must be cancelled.
SLOW_UNLESS_0 = 'if [ "$POLAR_SAMPLE" = 0 ]; then sleep 2; echo done; else sleep 30; echo late; fi'


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("decisions-proxy")
    script = root / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": "done"}]}))
    with start_proxy(
        f"scripted:{script}", str(root / "store"), confdir=root / "conf", log_dir=root,
        options={"polar_shard_seconds": "0.2"},
    ) as started:  # fmt: skip
        yield started


def _config(proxy: StartedProxy, tmp_path: Path, entries: list[dict], **fields: Any) -> RolloutConfig:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    (workspace / "README").write_text("start\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"workspace": "ws", "verify": "true", **e}) + "\n" for e in entries))
    external = ExternalProxy(
        f"http://127.0.0.1:{proxy.endpoints.forward_port}", proxy.control_token,
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}", proxy.endpoints.ca,
    )  # fmt: skip
    defaults: dict[str, Any] = {"harness": HARNESS, "runtime": "local", "trust_agent": True, "init_attempts": 1}
    return RolloutConfig(
        tasks=load_tasks(tasks),
        proxy=external,
        progress=RolloutProgress(),
        run_id=f"d{tmp_path.name[-8:]}",
        **{**defaults, **fields},
    )


def _drive(
    proxy: StartedProxy,
    config: RolloutConfig,
    work: Path,
    *,
    slots: int = 1,
    before: Any = None,
    during: Any = None,
) -> tuple[dict[tuple[str, int], SessionResult], SessionRunner]:
    """Drive every planned session (all at once, ``slots`` RUN slots); ``before(runner, control)`` runs first,
    ``during(runner, tasks)`` alongside."""

    async def main() -> tuple[list[SessionResult], SessionRunner]:
        control = ControlClient(proxy.endpoints.forward_port, proxy.control_token)
        runtime = get_runtime("local")
        runner = SessionRunner(
            config,
            get_preset(HARNESS),
            runtime,
            config.proxy.endpoints(),  # type: ignore[union-attr]
            control,
            work,
            config.run_id or "",
        )
        try:
            if before is not None:
                await before(runner, control)
            run_slots = asyncio.Semaphore(slots)
            jobs = [asyncio.create_task(runner.drive(p, run_slots)) for p in plan_sessions(config, config.run_id or "")]
            if during is not None:
                await during(runner, jobs)
            return list(await asyncio.gather(*jobs)), runner
        finally:
            await control.aclose()
            await runtime.close()

    results, runner = asyncio.run(main())
    return {(r.task_id, r.sample): r for r in results}, runner


def _stored(proxy: StartedProxy, results: dict[tuple[str, int], SessionResult]) -> dict[tuple[str, int], Any]:
    store = str(Path(proxy.log).parent / "store")
    wait_for_shards(store)
    by_id = {s.session_id: s for s in read_sessions(store)}
    return {key: by_id.get(r.session_id) for key, r in results.items()}


async def _running(runner: SessionRunner, group: str) -> None:
    """Until a session of ``group`` is in RUN (its harness started)."""
    deadline = time.monotonic() + 60
    while not runner.running.get(group):
        assert time.monotonic() < deadline, "no session reached RUN"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # the harness's process is up


# -- RUN: the deadline ------------------------------------------------------------------------------------------


def test_a_hanging_harness_ends_at_the_rollouts_deadline_not_the_tasks(proxy: StartedProxy, tmp_path: Path) -> None:
    # The task allows 600 s; --timeout 1 is the deadline that counts.
    config = _config(proxy, tmp_path, [{"id": "hang", "instruction": "sleep 20; echo late"}], timeout_s=1.0)
    started = time.monotonic()
    results, _ = _drive(proxy, config, tmp_path / "work")
    [hang] = results.values()
    assert time.monotonic() - started < 15
    assert (hang.status, hang.reward, hang.rewards, hang.ran) == (S.TIMEOUT, None, {}, True)
    assert hang.reason == "the harness ran past its 1 s deadline"
    assert 1.0 <= hang.timings["run"] < 10
    stored = _stored(proxy, results)[("hang", 0)]
    assert stored.status == "timeout" and stored.rewards == {}
    assert stored.metadata["reason"] == "timeout" and stored.metadata["deadline_s"] == 1.0
    assert config.progress.statuses == {S.TIMEOUT: 1} and config.progress.group_rewards == {"hang": []}


def test_without_a_rollout_deadline_each_tasks_own_agent_timeout_ends_it(proxy: StartedProxy, tmp_path: Path) -> None:
    entries = [
        {"id": "short", "instruction": "sleep 20", "timeouts": {"agent": 1.5}},
        {"id": "quick", "instruction": "sleep 0.2; echo done", "timeouts": {"agent": 30}},
    ]
    started = time.monotonic()
    results, _ = _drive(proxy, _config(proxy, tmp_path, entries), tmp_path / "work")
    assert time.monotonic() - started < 15
    assert results[("short", 0)].status == S.TIMEOUT
    assert results[("short", 0)].reason == "the harness ran past its 1.5 s deadline"
    assert 1.5 <= results[("short", 0)].timings["run"] < 10
    assert (results[("quick", 0)].status, results[("quick", 0)].reward) == (S.COMPLETED, 1.0)


# -- RUN: what the harness's exit means -------------------------------------------------------------------------


def test_the_harness_exit_decides_failed_or_verified(proxy: StartedProxy, tmp_path: Path) -> None:
    entries = [
        {"id": "exit3", "instruction": "echo partial; echo oops >&2; exit 3"},
        {"id": "silent", "instruction": "true"},  # exit 0, no stdout, no change: nothing to verify
        {"id": "answer", "instruction": "echo done"},  # stdout only: verified
        {"id": "wrote", "instruction": "echo 42 > answer.txt", "verify": 'test "$(cat answer.txt)" = 42'},
        {"id": "wrong", "instruction": "echo 41 > answer.txt", "verify": 'test "$(cat answer.txt)" = 42'},
        {"id": "env", "instruction": 'echo "$POLAR_INSTRUCTION|$EXTRA"'},  # the harness's environment
    ]
    config = _config(proxy, tmp_path, entries, logs_dir=tmp_path / "logs", env={"EXTRA": "given"})
    results, _ = _drive(proxy, config, tmp_path / "work")
    got = {t: (r.status, r.reward, r.rewards, r.exit_code, r.ran) for (t, _), r in results.items()}
    assert got == {
        "exit3": (S.FAILED, 0.0, {"reward": 0.0}, 3, True),
        "silent": (S.FAILED, 0.0, {"reward": 0.0}, 0, True),
        "answer": (S.COMPLETED, 1.0, {"reward": 1.0}, 0, True),
        "wrote": (S.COMPLETED, 1.0, {"reward": 1.0}, 0, True),
        "wrong": (S.COMPLETED, 0.0, {"reward": 0.0}, 0, True),
        "env": (S.COMPLETED, 1.0, {"reward": 1.0}, 0, True),
    }
    assert results[("exit3", 0)].reason == "the harness exited 3: oops\n"
    assert results[("silent", 0)].reason == "the harness produced nothing: no stdout and no change to the workspace"
    assert results[("answer", 0)].reason is None and results[("wrote", 0)].patch_bytes > 0
    stored = _stored(proxy, results)
    assert {t: s.status for (t, _), s in stored.items()} == {
        "exit3": "agent_error", "silent": "agent_error", "answer": "completed", "wrote": "completed",
        "wrong": "completed", "env": "completed",
    }  # fmt: skip
    assert stored[("exit3", 0)].metadata["reason"] == "harness_failed"
    assert stored[("exit3", 0)].metadata["exit_code"] == 3 and stored[("exit3", 0)].metadata["oom_killed"] is False
    assert stored[("exit3", 0)].metadata["limit"] is None
    assert stored[("silent", 0)].metadata["reason"] == "harness_produced_nothing"
    assert stored[("wrote", 0)].rewards == {"reward": 1.0} and stored[("exit3", 0)].rewards == {}
    assert stored[("wrote", 0)].metadata["patch_bytes"] == results[("wrote", 0)].patch_bytes
    assert all(s.metadata["rollout"] == config.run_id and s.metadata["harness"] == "cmd" for s in stored.values())
    assert {(t, s.metadata["task"], s.metadata["group"], s.metadata["sample"]) for (t, _), s in stored.items()} == {
        (t, t, t, 0) for t, _ in stored
    }
    log = (tmp_path / "logs" / "sessions" / results[("exit3", 0)].session_id / "harness.log").read_text()
    assert log == "exit 3\n--- stdout\npartial\n\n--- stderr\noops\n"
    env_log = (tmp_path / "logs" / "sessions" / results[("env", 0)].session_id / "harness.log").read_text()
    assert env_log == 'exit 0\n--- stdout\necho "$POLAR_INSTRUCTION|$EXTRA"|given\n\n--- stderr\n'

    progress = config.progress
    assert progress.statuses == {S.FAILED: 2, S.COMPLETED: 4}
    assert progress.group_rewards == {
        "exit3": [0.0], "silent": [0.0], "answer": [1.0], "wrote": [1.0], "wrong": [0.0], "env": [1.0],
    }  # fmt: skip
    assert progress.ran == 6 and progress.stages["done"] == 6 and sum(progress.stages.values()) == 6
    assert set(results[("wrote", 0)].timings) == {"init", "wait", "run", "postrun"}
    assert all(0 <= t < 60 for r in results.values() for t in r.timings.values())  # seconds, not clock readings


def test_a_reward_file_gives_every_named_reward_and_a_missing_one_scores_0(proxy: StartedProxy, tmp_path: Path) -> None:
    entries = [
        {"id": "named", "instruction": "echo done", "reward_file": "reward.json",
         "verify": """printf '{"reward": 0.25, "tests": 1}' > reward.json"""},
        {"id": "missing", "instruction": "echo done", "reward_file": "reward.txt", "verify": "true"},
    ]  # fmt: skip
    results, _ = _drive(proxy, _config(proxy, tmp_path, entries), tmp_path / "work")
    named, missing = results[("named", 0)], results[("missing", 0)]
    assert (named.status, named.reward, named.rewards, named.reason) == (
        S.COMPLETED, 0.25, {"reward": 0.25, "tests": 1.0}, None,
    )  # fmt: skip
    assert (missing.status, missing.reward, missing.rewards) == (S.COMPLETED, 0.0, {"reward": 0.0})
    assert "wrote no reward.txt" in (missing.reason or "") and missing.reason.endswith(": scored 0")
    stored = _stored(proxy, results)
    assert stored[("named", 0)].rewards == {"reward": 0.25, "tests": 1.0}
    assert "scored" not in stored[("named", 0)].metadata
    assert stored[("missing", 0)].metadata["scored"] == missing.reason
    assert stored[("missing", 0)].rewards == {"reward": 0.0}


def test_a_patch_over_the_bound_is_the_policys_failure(proxy: StartedProxy, tmp_path: Path) -> None:
    entries = [{"id": "big", "instruction": "head -c 4000 /dev/zero | tr '\\0' a > big.txt; echo done"}]
    results, _ = _drive(proxy, _config(proxy, tmp_path, entries, max_patch_bytes=1000), tmp_path / "work")
    [big] = results.values()
    assert (big.status, big.reward, big.rewards) == (S.FAILED, 0.0, {"reward": 0.0})
    assert _stored(proxy, results)[("big", 0)].metadata["reason"] == "patch_too_large"


# -- early stop ---------------------------------------------------------------------------------------------------


def test_early_stop_cancels_the_running_stragglers(proxy: StartedProxy, tmp_path: Path) -> None:
    # Both samples run at once; sample 0's completion is the group's one usable session: sample 1 is cancelled.
    config = _config(proxy, tmp_path, [{"id": "race", "instruction": SLOW_UNLESS_0}], samples=2, early_stop=1)
    started = time.monotonic()
    results, runner = _drive(proxy, config, tmp_path / "work", slots=2)
    assert time.monotonic() - started < 20
    assert (results[("race", 0)].status, results[("race", 0)].reason) == (S.COMPLETED, None)
    assert (results[("race", 1)].status, results[("race", 1)].ran) == (S.CANCELLED, True)
    assert results[("race", 1)].reason == "early stop: cancelled while running"
    assert runner.stopped_groups == {"race"} and runner.usable["race"] == 1
    stored = _stored(proxy, results)
    assert stored[("race", 1)].status == "error" and stored[("race", 1)].metadata["cancelled"] is True
    assert stored[("race", 1)].metadata["reason"] == "cancelled"
    assert config.progress.statuses == {S.COMPLETED: 1, S.CANCELLED: 1}
    assert config.progress.group_rewards == {"race": [1.0]}


def test_early_stop_cancels_a_straggler_whose_process_was_not_spawned_yet(
    proxy: StartedProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session is in RUN before its harness's process exists (here: sample 1's spawn takes 2 s); the group stops
    in that window, when the runtime has nothing to kill yet. The straggler is still cancelled once it is up, not
    left to sleep its 30 s."""
    from polar_cli.rollout.runtimes.local import LocalSandbox

    spawn = LocalSandbox.exec

    async def slow_spawn(self, command, *, env=None, **kwargs):
        if (env or {}).get("POLAR_SAMPLE") == "1":
            await asyncio.sleep(2)
        return await spawn(self, command, env=env, **kwargs)

    monkeypatch.setattr(LocalSandbox, "exec", slow_spawn)
    script = 'if [ "$POLAR_SAMPLE" = 0 ]; then echo done; else sleep 30; echo late; fi'
    config = _config(proxy, tmp_path, [{"id": "unborn", "instruction": script}], samples=2, early_stop=1)
    started = time.monotonic()
    results, runner = _drive(proxy, config, tmp_path / "work", slots=2)
    assert time.monotonic() - started < 20
    assert results[("unborn", 0)].status == S.COMPLETED
    assert (results[("unborn", 1)].status, results[("unborn", 1)].ran) == (S.CANCELLED, True)
    assert results[("unborn", 1)].reason == "early stop: cancelled while running"
    assert results[("unborn", 1)].timings["run"] < 15


def test_a_failed_session_is_usable_and_counts_toward_early_stop(proxy: StartedProxy, tmp_path: Path) -> None:
    script = 'if [ "$POLAR_SAMPLE" = 0 ]; then sleep 2; exit 7; else sleep 30; fi'
    config = _config(proxy, tmp_path, [{"id": "f", "instruction": script}], samples=2, early_stop=1)
    started = time.monotonic()
    results, _ = _drive(proxy, config, tmp_path / "work", slots=2)
    assert time.monotonic() - started < 20
    assert {s: r.status for (_, s), r in results.items()} == {0: S.FAILED, 1: S.CANCELLED}


def test_early_stop_waits_for_as_many_usable_sessions_as_it_was_given(proxy: StartedProxy, tmp_path: Path) -> None:
    # early_stop=2 of 3, all running at once: the first usable session stops nothing, the second stops the third.
    script = 'if [ "$POLAR_SAMPLE" = 2 ]; then sleep 30; else sleep "$((POLAR_SAMPLE + 2))"; fi; echo done'
    config = _config(proxy, tmp_path, [{"id": "two", "instruction": script}], samples=3, early_stop=2)
    started = time.monotonic()
    results, runner = _drive(proxy, config, tmp_path / "work", slots=3)
    assert time.monotonic() - started < 20
    assert {s: r.status for (_, s), r in results.items()} == {0: S.COMPLETED, 1: S.COMPLETED, 2: S.CANCELLED}
    assert runner.usable["two"] == 2


def test_without_early_stop_every_session_runs(proxy: StartedProxy, tmp_path: Path) -> None:
    config = _config(proxy, tmp_path, [{"id": "all", "instruction": "echo done"}], samples=2)
    results, runner = _drive(proxy, config, tmp_path / "work", slots=1)
    assert [r.status for r in results.values()] == [S.COMPLETED, S.COMPLETED] and not runner.stopped_groups


def test_a_group_stopped_before_init_never_starts(proxy: StartedProxy, tmp_path: Path) -> None:
    config = _config(proxy, tmp_path, [{"id": "g", "instruction": "echo done"}], early_stop=1)

    async def stop(runner: SessionRunner, control: ControlClient) -> None:
        runner.stop_group("g")

    results, _ = _drive(proxy, config, tmp_path / "work", before=stop)
    [g] = results.values()
    assert (g.status, g.ran, g.init_attempts, g.posted) == (S.CANCELLED, False, 0, False)
    assert g.reason == "early stop: the group had enough usable sessions before it ran"
    assert _stored(proxy, results)[("g", 0)] is None


def _after_init(proxy: StartedProxy, config: RolloutConfig, work: Path, between: Any) -> SessionResult:
    """One session through INIT, then ``between(runner, session)``, then RUN (and POSTRUN if RUN says so)."""

    async def main() -> SessionResult:
        control = ControlClient(proxy.endpoints.forward_port, proxy.control_token)
        runtime = get_runtime("local")
        runner = SessionRunner(config, get_preset(HARNESS), runtime, config.proxy.endpoints(), control, work, "x")
        try:
            [planned] = plan_sessions(config, config.run_id or "")
            session = runner.open(planned)
            assert await runner.init(session)
            runner.ready(session)
            await between(runner, session)
            if await runner.run(session):
                await runner.postrun(session)
            assert session.sandbox is None and session.stage == "done"
            return session.result
        finally:
            await control.aclose()
            await runtime.close()

    return asyncio.run(main())


def test_a_workspace_the_agent_removed_is_its_failure_not_a_masked_error(proxy: StartedProxy, tmp_path: Path) -> None:
    # As on a runtime that downloads the workspace (oci): the download finds none (extract_contained also drops a
    # workspace the agent replaced by a link, tests/security/test_archive_attacks.py). An error would be masked:
    # a policy could hide any bad outcome that way.
    config = _config(proxy, tmp_path, [{"id": "gone", "instruction": 'rm -rf "$PWD"; echo done'}])

    async def download_it(runner: SessionRunner, session: Any) -> None:
        session.sandbox.host_workspace = None

    result = _after_init(proxy, config, tmp_path / "work", download_it)
    assert (result.status, result.reward, result.rewards) == (S.FAILED, 0.0, {"reward": 0.0})
    assert result.reason is not None and result.reason.startswith("the workspace was gone after the run: ")
    stored = _stored(proxy, {("gone", 0): result})[("gone", 0)]
    assert stored.status == "agent_error" and stored.metadata["reason"] == "workspace_gone"


def test_a_group_stopped_after_init_never_runs(proxy: StartedProxy, tmp_path: Path) -> None:
    config = _config(proxy, tmp_path, [{"id": "h", "instruction": "echo done"}], early_stop=1)

    async def stop(runner: SessionRunner, session: Any) -> None:
        runner.stop_group("h")

    result = _after_init(proxy, config, tmp_path / "work", stop)
    assert (result.status, result.ran, result.exit_code) == (S.CANCELLED, False, None)
    assert result.reason == "early stop: the group had enough usable sessions before it ran"
    assert config.progress.ran == 0 and config.progress.statuses == {S.CANCELLED: 1}


def test_a_runtime_that_fails_under_the_harness_is_an_error_not_retried(proxy: StartedProxy, tmp_path: Path) -> None:
    config = _config(proxy, tmp_path, [{"id": "rt", "instruction": "echo done"}], init_attempts=2)

    async def break_runtime(runner: SessionRunner, session: Any) -> None:
        await session.sandbox.stop()  # its next exec raises RuntimeUnavailable

    result = _after_init(proxy, config, tmp_path / "work", break_runtime)
    assert (result.status, result.ran, result.init_attempts, result.exit_code) == (S.ERROR, True, 1, None)
    assert result.reason == "the runtime failed during RUN: RuntimeUnavailable: the sandbox is stopped"
    assert set(result.timings) == {"init", "wait", "run"}
    stored = _stored(proxy, {("rt", 0): result})[("rt", 0)]
    assert stored.status == "error" and stored.metadata["reason"] == "runtime_failed"


def test_the_stores_error_makes_a_session_unusable_for_early_stop(proxy: StartedProxy, tmp_path: Path) -> None:
    """The proxy ends the first running session as error (as when its engine is taken out): its completed post is
    answered error, so the runner says error too, takes its reward out of the group's, and does not cancel the
    other session, which is the usable one."""
    config = _config(proxy, tmp_path, [{"id": "e", "instruction": "sleep 1; echo done"}], samples=2, early_stop=1)
    ended: list[str] = []

    async def end_first(runner: SessionRunner, jobs: list) -> None:
        await _running(runner, "e")
        ended.append(runner.running["e"][0].session_id)
        await runner.control.status(ended[0], "error", {"error": "engine taken out"})

    results, runner = _drive(proxy, config, tmp_path / "work", during=end_first)
    first = next(r for r in results.values() if r.session_id == ended[0])
    other = next(r for r in results.values() if r.session_id != ended[0])
    assert (first.status, first.posted, first.ran) == (S.ERROR, True, True)
    assert first.reason.startswith("ended as error by the proxy before the runner's completed")
    assert (other.status, other.reward) == (S.COMPLETED, 1.0)
    assert runner.usable["e"] == 1 and runner.stopped_groups == {"e"}
    progress = config.progress
    assert progress.statuses == {S.ERROR: 1, S.COMPLETED: 1} and progress.group_rewards == {"e": [1.0]}
    assert [sid for sid, _ in progress.errors] == [first.session_id]


# -- cancels and interruptions --------------------------------------------------------------------------------------


def test_the_runners_own_cancel_of_a_running_harness_is_an_error(proxy: StartedProxy, tmp_path: Path) -> None:
    config = _config(proxy, tmp_path, [{"id": "c", "instruction": "sleep 30"}])

    async def cancel(runner: SessionRunner, jobs: list) -> None:
        await _running(runner, "c")
        await runner.running["c"][0].sandbox.cancel()

    results, runner = _drive(proxy, config, tmp_path / "work", during=cancel)
    [c] = results.values()
    assert (c.status, c.reason, c.ran) == (S.ERROR, "cancelled by the runner while running", True)
    assert not runner.stopped_groups and runner.usable["c"] == 0
    stored = _stored(proxy, results)[("c", 0)]
    assert stored.status == "error" and stored.metadata["cancelled"] is True


def test_an_interrupted_session_ends_cancelled_and_is_posted(proxy: StartedProxy, tmp_path: Path) -> None:
    config = _config(proxy, tmp_path, [{"id": "i", "instruction": "sleep 30"}])

    async def interrupt(runner: SessionRunner, jobs: list) -> None:
        await _running(runner, "i")
        jobs[0].cancel()

    results, _ = _drive(proxy, config, tmp_path / "work", during=interrupt)
    [i] = results.values()
    assert (i.status, i.reason, i.ran) == (S.CANCELLED, "interrupted by cancelled in RUN", True)
    stored = _stored(proxy, results)[("i", 0)]
    assert stored.status == "error"
    assert {k: stored.metadata[k] for k in ("reason", "cancelled", "signal", "stage")} == {
        "reason": "interrupted", "cancelled": True, "signal": "cancelled", "stage": "run",
    }  # fmt: skip


# -- INIT and POSTRUN retries -----------------------------------------------------------------------------------


def test_init_retries_a_failing_setup_then_ends_as_error(proxy: StartedProxy, tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    entries = [
        {"id": "broken", "instruction": "echo done", "setup": "echo no disk >&2; exit 3"},
        {"id": "flaky", "instruction": "echo done", "setup": f"if mkdir {marker} 2>/dev/null; then exit 1; fi"},
    ]
    results, _ = _drive(proxy, _config(proxy, tmp_path, entries, init_attempts=2), tmp_path / "work")
    broken, flaky = results[("broken", 0)], results[("flaky", 0)]
    assert (broken.status, broken.ran, broken.init_attempts) == (S.ERROR, False, 2)
    assert broken.reason == "INIT failed 2 times; last: INIT attempt 2: RuntimeError: setup exited 3: no disk\n"
    assert (flaky.status, flaky.reward, flaky.init_attempts) == (S.COMPLETED, 1.0, 2)
    stored = _stored(proxy, results)
    assert stored[("broken", 0)].status == "error" and stored[("broken", 0)].metadata["reason"] == "init_failed"


def test_a_verifier_sandbox_that_never_comes_up_is_retried_then_an_error(proxy: StartedProxy, tmp_path: Path) -> None:
    # The setup passes in INIT (it makes the marker) and fails in every verifier's sandbox.
    marker = tmp_path / "set-up"
    entries = [
        {"id": "v", "instruction": "echo done", "setup": f"mkdir {marker} 2>/dev/null || {{ echo again >&2; exit 4; }}"}
    ]
    results, _ = _drive(proxy, _config(proxy, tmp_path, entries, verify_attempts=2), tmp_path / "work")
    [v] = results.values()
    assert (v.status, v.reward, v.rewards) == (S.ERROR, None, {})
    assert v.reason == (
        "POSTRUN: RuntimeError: verification failed 2 times; last: setup exited 4 in the verifier's sandbox: again\n"
    )
    stored = _stored(proxy, results)[("v", 0)]
    assert stored.status == "error" and stored.metadata["reason"] == "verifier_failed" and stored.rewards == {}
