"""The runner's own decisions as plain functions (no proxy, no harness): which sessions a rollout plans, what it
refuses before starting any, and what its result says about each group's rewards and masked sessions (what the
loop trains on and reports). The end-to-end runs are in test_rollout_runner.py."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from polar_addon.store.status import SessionStatus
from polar_cli.rollout.config import RolloutConfig
from polar_cli.rollout.proxy import ExternalProxy
from polar_cli.rollout.runner import (
    RolloutResult,
    budget,
    check_config,
    check_runtime,
    plan_sessions,
    rollout_run_id,
    session_ids,
)
from polar_cli.rollout.runtimes import get_runtime
from polar_cli.rollout.session import SessionResult
from polar_cli.rollout.tasks import Task

S = SessionStatus


def _session(group: str, status: SessionStatus, reward: float | None = None, ran: bool = True) -> SessionResult:
    return SessionResult(f"{group}-{status}-{reward}", "t", group, 0, status, reward=reward, ran=ran)


def _result(*sessions: SessionResult, seconds: float = 120.0) -> RolloutResult:
    return RolloutResult("run", list(sessions), started_at=1000.0, ended_at=1000.0 + seconds, store="STORE")


def test_group_rewards_take_only_rewarded_sessions_with_a_reward() -> None:
    result = _result(
        _session("a", S.COMPLETED, 1.0),
        _session("a", S.FAILED, 0.0),
        _session("a", S.TIMEOUT, 0.5),  # a timeout is usable but carries no outcome reward
        _session("a", S.ERROR, 1.0),  # infrastructure: never a reward, whatever it holds
        _session("b", S.COMPLETED, None),
        _session("c", S.CANCELLED),
    )
    assert result.group_rewards() == {"a": [1.0, 0.0], "b": [], "c": []}


def test_group_masked_counts_error_and_cancelled_out_of_every_session() -> None:
    result = _result(
        _session("a", S.COMPLETED, 1.0),
        _session("a", S.ERROR),
        _session("a", S.CANCELLED),
        _session("a", S.TIMEOUT),
        _session("b", S.FAILED, 0.0),
    )
    assert result.group_masked() == {"a": (2, 4), "b": (0, 1)}


def test_counts_list_every_runner_status_zeros_included() -> None:
    result = _result(_session("a", S.COMPLETED, 1.0), _session("a", S.COMPLETED, 0.0), _session("b", S.ERROR))
    counts = result.counts()
    assert counts["completed"] == 2 and counts["error"] == 1
    assert set(counts) == {str(s) for s in ("completed", "failed", "timeout", "error", "cancelled")}
    assert all(counts[s] == 0 for s in ("failed", "timeout", "cancelled"))


@pytest.mark.parametrize(
    ("statuses", "failed"),
    [
        ((S.ERROR, S.CANCELLED), True),
        ((), True),
        ((S.ERROR, S.TIMEOUT), False),
        ((S.ERROR, S.FAILED), False),
        ((S.COMPLETED,), False),
    ],
)
def test_all_failed_means_no_usable_session(statuses: tuple[SessionStatus, ...], failed: bool) -> None:
    assert _result(*(_session("a", s) for s in statuses)).all_failed is failed


def test_summary_figures() -> None:
    result = _result(
        _session("a", S.COMPLETED, 1.0),
        _session("a", S.FAILED, 0.0),
        _session("a", S.ERROR, ran=False),
        _session("b", S.COMPLETED, 0.5),
        _session("b", S.CANCELLED, 1.0, ran=False),  # a reward it holds is not an outcome: not in the mean
        seconds=120.0,
    )
    result.context_window, result.max_output_tokens, result.interrupted = 4096, 512, "SIGINT"
    summary = result.summary()
    assert summary["run_id"] == "run" and summary["store"] == "STORE" and summary["sessions"] == 5
    assert (summary["context_window"], summary["max_output_tokens"], summary["interrupted"]) == (4096, 512, "SIGINT")
    assert summary["reward_mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3
    assert summary["mask_rate"] == pytest.approx(0.4)
    assert summary["groups"] == {
        "a": {"rewards": [1.0, 0.0], "mean": 0.5, "sessions": 3, "masked": 1, "mask_rate": pytest.approx(1 / 3)},
        "b": {"rewards": [0.5], "mean": 0.5, "sessions": 2, "masked": 1, "mask_rate": 0.5},
    }
    assert summary["sessions_per_minute"] == pytest.approx(1.5)  # 3 sessions ran in 2 minutes
    assert summary["seconds"] == 120.0
    assert summary["statuses"] == result.counts()
    assert [s["status"] for s in summary["session_results"]] == [
        "completed", "failed", "error", "completed", "cancelled",
    ]  # fmt: skip
    short = _result(_session("a", S.COMPLETED, 1.0), seconds=0.5).summary()
    assert short["sessions_per_minute"] == pytest.approx(120.0)  # one session in half a second


def test_summary_of_nothing_rewarded() -> None:
    summary = _result(_session("a", S.ERROR), seconds=0.0).summary()
    assert summary["reward_mean"] is None
    assert summary["groups"]["a"]["mean"] is None and summary["groups"]["a"]["rewards"] == []
    assert summary["mask_rate"] == 1.0
    assert summary["sessions_per_minute"] > 0  # a zero-length run does not divide by zero
    assert _result(seconds=60.0).summary()["mask_rate"] is None


def _tasks(*ids: str) -> list[Task]:
    return [Task(id=i, instruction=f"do {i}") for i in ids]


def test_session_ids_hash_the_task_id_and_number_the_samples() -> None:
    tasks = _tasks("a/b c", "x")
    ids = session_ids(tasks, 2, "r7")
    digest = hashlib.sha256(b"a/b c").hexdigest()[:10]
    assert [(t.id, s, sid) for t, s, sid in ids][:2] == [("a/b c", 0, f"r7-{digest}-0"), ("a/b c", 1, f"r7-{digest}-1")]
    assert [t.id for t, _, _ in ids] == ["a/b c", "a/b c", "x", "x"]
    assert len({sid for _, _, sid in ids}) == 4


def _config(**kw: object) -> RolloutConfig:
    base: dict[str, object] = {
        "tasks": _tasks("t1", "t2", "t3", "t4"),
        "harness": "cmd:true",
        "engine": "e",
        "out": "o",
    }
    return RolloutConfig(**(base | kw))  # type: ignore[arg-type]


def test_plan_sessions_keeps_the_task_order_without_a_seed_and_shuffles_with_one() -> None:
    plain = plan_sessions(_config(samples=2), "r")
    assert [p.task.id for p in plain] == ["t1", "t1", "t2", "t2", "t3", "t3", "t4", "t4"]
    assert [p.sample for p in plain] == [0, 1] * 4
    assert [p.session_id for p in plain] == [sid for _, _, sid in session_ids(_tasks("t1", "t2", "t3", "t4"), 2, "r")]
    assert [p.index for p in plain] == list(range(8))  # the start order
    shuffled = plan_sessions(_config(samples=1, seed=3), "r")
    expected = _tasks("t1", "t2", "t3", "t4")
    import random

    random.Random(3).shuffle(expected)
    assert [p.task.id for p in shuffled] == [t.id for t in expected] != ["t1", "t2", "t3", "t4"]


def test_run_id_is_the_given_one_else_from_the_seed() -> None:
    assert rollout_run_id(_config(run_id="mine", seed=5)) == "mine"
    assert rollout_run_id(_config(seed=5)) == "r5"


GIVE_ONE = r"give an engine \(the runner starts a proxy\) or a running proxy, not both$"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tasks": []}, "no tasks$"),
        ({"samples": 0}, "samples must be at least 1$"),
        ({"concurrency": 0}, "concurrency must be at least 1$"),
        ({"init_attempts": 0}, "init attempts must be at least 1$"),
        ({"verify_attempts": 0}, "verify attempts must be at least 1$"),
        ({"ready": -1}, "ready must be 0 or more$"),
        ({"samples": 2, "early_stop": 0}, r"early_stop must be between 1 and samples \(2\)"),
        ({"samples": 2, "early_stop": 3}, r"early_stop must be between 1 and samples \(2\)"),
        ({"timeout_s": 0}, "timeout must be positive$"),
        ({"context_window": 0}, "context window must be at least 1"),
        ({"max_output_tokens": 0}, "max output tokens must be at least 1"),
        (
            {"context_window": 100, "max_output_tokens": 100},
            r"max output tokens must be below the context window \(the prompt needs room\)$",
        ),
        ({"engine": None}, GIVE_ONE),
        ({"proxy": ExternalProxy("http://127.0.0.1:1", "tok")}, GIVE_ONE),
        ({"out": None}, r"a started proxy needs a store \(out\)$"),
    ],
)
def test_check_config_refuses(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        check_config(_config(**change))


def test_check_config_accepts_the_boundaries() -> None:
    check_config(_config(samples=2, early_stop=2, ready=0, concurrency=1, timeout_s=0.1, init_attempts=1))
    check_config(_config(verify_attempts=1))
    check_config(_config(samples=2, early_stop=1, context_window=100, max_output_tokens=99))
    check_config(_config(context_window=1, max_output_tokens=None))
    check_config(_config(engine=None, out=None, proxy=ExternalProxy("http://127.0.0.1:1", "tok")))


def test_harbor_tasks_are_refused_on_a_runtime_that_cannot_place_their_directories(tmp_path: Path) -> None:
    harbor = [Task(id=f"h{i}", instruction="x", format="harbor") for i in range(5)]
    local = get_runtime("local")
    with pytest.raises(ValueError, match=r"Harbor tasks \(h0, h1, h2, \.\.\.\) need /tests and /logs") as refused:
        check_runtime([*_tasks("plain"), *harbor], local)
    assert str(refused.value).endswith("the local runtime cannot place: use --runtime bwrap or --runtime oci")
    for n in (3, 4):  # "..." only past three names
        with pytest.raises(ValueError) as refused:
            check_runtime(harbor[:n], local)
        assert ("..." in str(refused.value)) is (n > 3)
    check_runtime(_tasks("plain"), local)  # no Harbor task: any runtime
    check_runtime(harbor, get_runtime("bwrap"))


def test_budget_reads_the_window_the_engine_serves(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 3000}')
    assert asyncio.run(budget(_config(engine=f"local:{model}"))) == (3000, None)
    assert asyncio.run(budget(_config(engine=f"local:{model}?max_len=1000"))) == (1000, None)


def test_budget_is_what_was_given_else_the_proxy_options_cap() -> None:
    given = _config(context_window=2048, max_output_tokens=256, proxy_options={"polar_max_tokens": "99"})
    assert asyncio.run(budget(given)) == (2048, 256)
    capped = _config(context_window=2048, proxy_options={"polar_max_tokens": "99"})
    assert asyncio.run(budget(capped)) == (2048, 99)
    assert asyncio.run(budget(_config(context_window=2048, proxy_options={"polar_max_tokens": "0"}))) == (2048, None)
    assert asyncio.run(budget(_config(context_window=2048))) == (2048, None)
    external = _config(engine=None, out=None, proxy=ExternalProxy("http://127.0.0.1:1", "tok"))
    assert asyncio.run(budget(external)) == (None, None)  # a running proxy: nothing to read here
