"""The session model's public pieces: the one status vocabulary (runner -> store), each verifier strategy's decision
on a finished verify command, and a SessionRunner driving sessions through its stages (a real mitmdump + polar addon
answering with the scripted engine, the local runtime, the openai-SDK agent of tests/support/rollout_agent.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from polar_addon.store import SESSION_STATUSES, read_sessions
from polar_addon.store.status import (
    MASKED,
    REWARDED,
    RUNNER_STATUSES,
    STORE_MASKED,
    STORED_STATUSES,
    USABLE,
    SessionStatus,
)
from polar_cli.rollout.config import RolloutConfig
from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.proxy import ControlClient, ExternalProxy, StartedProxy, start_proxy
from polar_cli.rollout.runner import plan_sessions
from polar_cli.rollout.runtimes import get_runtime
from polar_cli.rollout.runtimes.base import ExecResult
from polar_cli.rollout.session import RolloutProgress, SessionResult, SessionRunner
from polar_cli.rollout.tasks import Task, load_tasks
from polar_cli.rollout.verifiers import (
    ExitCodeVerifier,
    HarborVerifier,
    RewardFileVerifier,
    VerifyLayout,
    verifier_for,
)
from polar_cli.rollout.verify import GUARD_CLEAN, GUARD_LEFT, NoReward
from tests.support.proxy import REPO
from tests.support.shards import wait_for_shards

S = SessionStatus

# -- statuses ---------------------------------------------------------------------------------------------------


def test_each_runner_status_is_posted_under_the_stores_name() -> None:
    assert {s: s.stored for s in RUNNER_STATUSES} == {
        S.COMPLETED: "completed",
        S.FAILED: "agent_error",
        S.TIMEOUT: "timeout",
        S.ERROR: "error",
        S.CANCELLED: "error",
    }
    # What the runner posts is always a status the store takes; the store's own map to themselves.
    assert all(s.stored in STORED_STATUSES for s in RUNNER_STATUSES)
    assert all(s.stored is s for s in STORED_STATUSES)


def test_statuses_are_the_strings_stored_and_written() -> None:
    assert SESSION_STATUSES == ("running", "completed", "timeout", "error", "agent_error")
    assert all(type(s) is str for s in SESSION_STATUSES)  # the store's messages list them as before
    assert [s.value for s in RUNNER_STATUSES] == ["completed", "failed", "timeout", "error", "cancelled"]
    result = SessionResult("s", "t", "t", 0, S.FAILED)
    assert json.loads(json.dumps(asdict(result)))["status"] == "failed"
    assert f"{S.AGENT_ERROR}" == "agent_error" and S("timeout") is S.TIMEOUT


def test_usable_rewarded_and_masked() -> None:
    assert USABLE == {"completed", "failed", "timeout"}  # trained (the policy's failures with reward 0)
    assert REWARDED == {"completed", "failed"}
    assert MASKED == {"error", "cancelled"}
    assert STORE_MASKED == {"error", "running"}  # what a build never trains, read from the store
    assert USABLE | MASKED == set(RUNNER_STATUSES) and not USABLE & MASKED
    assert [s for s in S if s.usable] == [S.COMPLETED, S.FAILED, S.TIMEOUT]
    assert [s for s in S if s.rewarded] == [S.COMPLETED, S.FAILED]
    assert [s for s in S if s.masked] == [S.ERROR, S.CANCELLED]


# -- verifier strategies ----------------------------------------------------------------------------------------


def _layout(tmp_path: Path) -> VerifyLayout:
    agent = tmp_path / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    return VerifyLayout(tmp_path, agent)


def test_verifier_for_picks_by_the_tasks_kind(tmp_path: Path) -> None:
    assert type(verifier_for(Task("t", "i", verify="true"))) is ExitCodeVerifier
    assert type(verifier_for(Task("t", "i", reward_file="out/r.txt"))) is RewardFileVerifier
    assert type(verifier_for(Task("t", "i", format="harbor", tests_dir=tmp_path))) is HarborVerifier


def test_exit_code_verifier(tmp_path: Path) -> None:
    verifier, layout = ExitCodeVerifier(Task("t", "i", verify_timeout_s=7)), _layout(tmp_path)
    assert verifier.decide(ExecResult(0, "", ""), False, layout, None) == {"reward": 1.0}
    assert verifier.decide(ExecResult(1, "", ""), False, layout, None) == {"reward": 0.0}
    assert verifier.decide(ExecResult(-9, "", ""), False, layout, None) == {"reward": 0.0}
    with pytest.raises(NoReward, match="past its 7 s timeout"):
        verifier.decide(ExecResult(-1, "", "", timed_out=True), False, layout, None)


def test_the_guard_decides_before_any_strategy(tmp_path: Path) -> None:
    verifier, layout = ExitCodeVerifier(Task("t", "i")), _layout(tmp_path)
    clean = f"ok\n{GUARD_CLEAN}\n"
    assert verifier.decide(ExecResult(0, clean, ""), True, layout, None) == {"reward": 1.0}
    with pytest.raises(NoReward, match="left running"):
        verifier.decide(ExecResult(0, f"ok\n{GUARD_LEFT} 12\n", ""), True, layout, None)
    with pytest.raises(NoReward, match="did not report"):
        verifier.decide(ExecResult(0, "ok\n", ""), True, layout, None)
    # Unguarded (no pid namespace of its own), its stdout is not read for the guard's line.
    assert verifier.decide(ExecResult(0, "ok\n", ""), False, layout, None) == {"reward": 1.0}


def test_reward_file_verifier_reads_the_workspace_or_the_copy_brought_out(tmp_path: Path) -> None:
    verifier = RewardFileVerifier(Task("t", "i", reward_file="out/reward.json"))
    layout = _layout(tmp_path / "attempt")
    workspace = tmp_path / "workspace"
    (workspace / "out").mkdir(parents=True)
    (workspace / "out" / "reward.json").write_text('{"reward": 0.25, "style": 1}')
    # The exit code is not the reward when a reward file is.
    assert verifier.decide(ExecResult(1, "", ""), False, layout, workspace) == {"reward": 0.25, "style": 1.0}
    untouched = tmp_path / "untouched"
    untouched.mkdir()
    with pytest.raises(NoReward, match="wrote no out/reward.json"):
        verifier.decide(ExecResult(0, "", ""), False, layout, untouched)
    copied = layout.dir / "reward-out"  # an image's own workspace: the runtime copied the file out by its name
    copied.mkdir()
    (copied / "reward.json").write_text("0.5")
    assert verifier.decide(ExecResult(0, "", ""), False, layout, None) == {"reward": 0.5}
    (workspace / "out" / "reward.json").write_text("passed")
    with pytest.raises(NoReward, match="out/reward.json"):  # the message names the task's file
        verifier.decide(ExecResult(0, "", ""), False, layout, workspace)


def test_harbor_verifier_reads_its_logs_and_honours_json_only_when_the_tests_write_it(tmp_path: Path) -> None:
    logs = tmp_path / "logs-verifier"
    logs.mkdir()
    (logs / "reward.txt").write_text("0")
    (logs / "reward.json").write_text('{"reward": 1}')
    layout = _layout(tmp_path)
    planted = HarborVerifier(Task("t", "i", format="harbor", reward_json=False))
    assert planted.decide(ExecResult(0, "", ""), False, layout, None) == {"reward": 0.0}
    honoured = HarborVerifier(Task("t", "i", format="harbor", reward_json=True))
    assert honoured.decide(ExecResult(1, "", ""), False, layout, None) == {"reward": 1.0}
    # A reward.json the tests never write is not even opened: a link planted there changes nothing.
    (logs / "reward.json").unlink()
    (logs / "reward.json").symlink_to("/etc/passwd")
    (logs / "reward.txt").write_text("1")
    assert planted.decide(ExecResult(0, "", ""), False, layout, None) == {"reward": 1.0}
    (logs / "reward.txt").unlink()
    (logs / "reward.json").unlink()
    with pytest.raises(NoReward):
        planted.decide(ExecResult(0, "", ""), False, layout, None)


# -- the session runner -----------------------------------------------------------------------------------------

AGENT = REPO / "tests" / "support" / "rollout_agent.py"
HARNESS = f"cmd:{sys.executable} {AGENT} {{instruction}}"


@dataclass
class _Recorded(RolloutProgress):
    moves: list[tuple[str | None, str]] = field(default_factory=list)  # every stage move, in order

    def move(self, before: str | None, after: str) -> None:
        self.moves.append((before, after))
        super().move(before, after)


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("session-proxy")
    turns = [{"content": "", "tool_calls": [{"type": "function", "function": {
                 "name": "write_file", "arguments": {"path": "answer.txt", "content": "42"}}}]},
             {"content": "done"}]  # fmt: skip
    script = root / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": turns}))
    with start_proxy(
        f"scripted:{script}", str(root / "store"), confdir=root / "conf", log_dir=root,
        options={"polar_shard_seconds": "0.2"},
    ) as started:  # fmt: skip
        yield started


def test_a_session_runner_drives_each_session_through_its_stages(proxy: StartedProxy, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "README").write_text("start\n")
    tasks = tmp_path / "tasks.jsonl"
    entries = [
        {"id": "pass", "instruction": "Write the answer.", "verify": 'test "$(cat answer.txt)" = 42'},
        {"id": "fail", "instruction": "Write the answer.", "verify": 'test "$(cat answer.txt)" = 43'},
        {"id": "crash", "instruction": "MODE=crash"},
    ]
    tasks.write_text("".join(json.dumps({"workspace": "ws", "verify": "true", **e}) + "\n" for e in entries))
    external = ExternalProxy(
        f"http://127.0.0.1:{proxy.endpoints.forward_port}", proxy.control_token,
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}", proxy.endpoints.ca,
    )  # fmt: skip
    progress = _Recorded()
    config = RolloutConfig(
        tasks=load_tasks(tasks), harness=HARNESS, proxy=external, progress=progress, run_id=f"sr{tmp_path.name[-6:]}"
    )

    async def drive() -> list[SessionResult]:
        control = ControlClient(proxy.endpoints.forward_port, proxy.control_token)
        runtime = get_runtime("local")
        runner = SessionRunner(
            config, get_preset(HARNESS), runtime, external.endpoints(), control, tmp_path / "work", config.run_id
        )
        try:
            slots = asyncio.Semaphore(1)
            return [await runner.drive(p, slots) for p in plan_sessions(config, config.run_id)]
        finally:
            await control.aclose()
            await runtime.close()

    results = {r.task_id: r for r in asyncio.run(drive())}
    assert {t: (r.status, r.reward) for t, r in results.items()} == {
        "pass": (S.COMPLETED, 1.0),
        "fail": (S.COMPLETED, 0.0),
        "crash": (S.FAILED, 0.0),
    }
    assert all(r.posted and r.ran for r in results.values())
    # One session at a time (one RUN slot, each driven to its end): each one's moves, in plan order.
    verified = [("pending", "init"), ("init", "ready"), ("ready", "run"), ("run", "postrun"), ("postrun", "done")]
    ended_in_run = [("pending", "init"), ("init", "ready"), ("ready", "run"), ("run", "done")]
    assert progress.moves == verified + verified + ended_in_run
    assert progress.stages == {"pending": 0, "init": 0, "ready": 0, "run": 0, "postrun": 0, "done": 3}
    assert progress.statuses == {S.COMPLETED: 2, S.FAILED: 1}
    assert progress.group_rewards == {"pass": [1.0], "fail": [0.0], "crash": [0.0]}
    store = str(Path(proxy.log).parent / "store")
    ids = {r.session_id for r in results.values()}
    wait_for_shards(store)
    stored = {s.task_id: s.status for s in read_sessions(store) if s.session_id in ids}
    assert stored == {"pass": "completed", "fail": "completed", "crash": "agent_error"}
