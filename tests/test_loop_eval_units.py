"""`polar loop --eval`'s own decisions (polar_cli.rollout.loop_eval): where an evaluation goes, when one is due, the k
it reports, how its sessions are scored and what loop.json keeps of it. No rollout: reports built in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_cli.eval.metrics import Estimate, TaskScore
from polar_cli.eval.report import CallStats, EvalReport
from polar_cli.rollout import loop_eval
from polar_cli.rollout.loop_eval import eval_dir, eval_due, eval_ks, loop_entry, score


def test_an_evaluation_goes_under_eval_outside_every_iteration_directory(tmp_path: Path) -> None:
    assert eval_dir(tmp_path, 0) == tmp_path / "eval" / "iter-000"
    assert eval_dir(tmp_path, 42) == tmp_path / "eval" / "iter-042"
    assert eval_dir(tmp_path, 1234) == tmp_path / "eval" / "iter-1234"
    assert (loop_eval.EVAL_DIR, loop_eval.EVAL_REPORT) == ("eval", "eval-report.json")


def test_every_one_evaluates_each_iteration_and_below_one_is_refused_in_its_words() -> None:
    assert all(eval_due(i, 5, 1) for i in range(5))
    with pytest.raises(ValueError) as refused:
        eval_due(3, 5, 0)
    assert str(refused.value) == "--eval-every must be at least 1, not 0"
    with pytest.raises(ValueError, match="not -2$"):
        eval_due(0, 5, -2)


def test_only_the_base_the_multiples_and_the_last_iteration_are_due() -> None:
    assert [i for i in range(10) if eval_due(i, 10, 4)] == [0, 4, 8, 9]
    assert [i for i in range(9) if eval_due(i, 9, 4)] == [0, 4, 8]  # the last is a multiple: once
    assert [i for i in range(2) if eval_due(i, 2, 5)] == [0, 1]
    assert not eval_due(1, 3, 2) and eval_due(2, 3, 2)


def test_the_ks_are_one_and_the_samples_once_each_in_order() -> None:
    assert eval_ks(1) == [1]
    assert eval_ks(2) == [1, 2]
    assert eval_ks(8) == [1, 8]


def _results() -> list[dict[str, Any]]:
    return [
        {"session_id": "a0", "task_id": "a", "sample": 0, "status": "completed", "reward": 0.6, "reason": None},
        {"session_id": "a1", "task_id": "a", "sample": 1, "status": "completed", "reward": 1.0, "reason": None},
        {"session_id": "b0", "task_id": "b", "sample": 0, "status": "failed", "reward": 0.0, "reason": None},
        {"session_id": "b1", "task_id": "b", "sample": 1, "status": "error", "reward": None, "reason": "boom"},
    ]


def test_score_without_a_store_reads_no_call_statistics_and_reports_pass_at_1_and_k(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_: Any) -> dict[str, CallStats]:
        raise AssertionError("no store: the calls are not read")

    monkeypatch.setattr(loop_eval, "read_call_stats", never)
    for store in (None, tmp_path / "missing", tmp_path / "a-file"):
        if store is not None and store.name == "a-file":
            store.write_text("")
        report = score(_results(), 2, 1.0, store)
        assert report.ks == [1, 2] and report.pass_threshold == 1.0
        assert [s.calls for s in report.sessions] == [None] * 4


def test_score_passes_the_threshold_through(tmp_path: Path) -> None:
    strict = score(_results(), 2, 1.0, None)
    lenient = score(_results(), 2, 0.5, None)
    # a: 0.6 and 1.0; b: 0.0 and a masked error. Strict: a 1/2, b 0/1; lenient: a 2/2, b 0/1.
    assert strict.overall[1].mean == pytest.approx(0.25) and lenient.overall[1].mean == pytest.approx(0.5)
    assert (lenient.pass_threshold, strict.pass_threshold) == (0.5, 1.0)


def test_score_reads_the_call_statistics_of_exactly_these_sessions_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, list[str]]] = []

    def read(store: str, ids: list[str]) -> dict[str, CallStats]:
        asked.append((store, ids))
        return {"a0": CallStats(calls=3, prompt_tokens=10)}

    monkeypatch.setattr(loop_eval, "read_call_stats", read)
    report = score(_results(), 2, 1.0, tmp_path)
    assert asked == [(str(tmp_path), ["a0", "a1", "b0", "b1"])]
    assert isinstance(asked[0][0], str)
    assert [s.calls for s in report.sessions] == [CallStats(calls=3, prompt_tokens=10), None, None, None]


@pytest.mark.parametrize("error", [OSError("gone"), ValueError("not a store")])
def test_an_unreadable_store_keeps_the_figures_without_the_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def read(*_: Any) -> dict[str, CallStats]:
        raise error

    monkeypatch.setattr(loop_eval, "read_call_stats", read)
    report = score(_results(), 2, 1.0, tmp_path)
    assert [s.calls for s in report.sessions] == [None] * 4
    assert report.overall[1].mean == pytest.approx(0.25)


def test_another_error_of_the_store_is_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read(*_: Any) -> dict[str, CallStats]:
        raise KeyError("session_id")

    monkeypatch.setattr(loop_eval, "read_call_stats", read)
    with pytest.raises(KeyError):
        score(_results(), 2, 1.0, tmp_path)


def _report(overall: dict[int, Estimate], tasks: list[TaskScore], sessions: int) -> EvalReport:
    return EvalReport(
        ks=sorted(overall),
        pass_threshold=1.0,
        tasks=tasks,
        overall=overall,
        causes={"passed": 1, "wrong": 2},
        format={"tool_calls": 4},
        turns=None,
        tokens=None,
        sessions=[object()] * sessions,  # type: ignore[list-item]  # only counted
    )


def test_a_loop_entry_counts_scored_tasks_and_sessions_and_keeps_every_figure() -> None:
    report = _report(
        {1: Estimate(0.25, 0.125, 3), 4: Estimate(0.5, None, 1)},
        [TaskScore("a", 4, 1), TaskScore("b", 0, 0), TaskScore("c", 3, 0)],
        sessions=9,
    )
    assert loop_entry(report, 7, "ckpt-7", 6, 12.5) == {
        "iteration": 7,
        "policy": "ckpt-7",
        "version": 6,
        "pass@1": 0.25,
        "pass@1_se": 0.125,
        "overall": {
            "pass@1": {"mean": 0.25, "se": 0.125, "tasks": 3},
            "pass@4": {"mean": 0.5, "se": None, "tasks": 1},
        },
        "tasks": 3,
        "scored_tasks": 2,
        "sessions": 9,
        "scored_sessions": 7,
        "causes": {"passed": 1, "wrong": 2},
        "format": {"tool_calls": 4},
        "seconds": 12.5,
    }


def test_a_report_without_pass_at_1_has_no_pass_at_1_in_its_entry() -> None:
    entry = loop_entry(_report({4: Estimate(0.5, 0.1, 2)}, [TaskScore("a", 1, 1)], sessions=1), 0, "base", 0, 0.0)
    assert (entry["pass@1"], entry["pass@1_se"]) == (None, None)
    assert entry["overall"] == {"pass@4": {"mean": 0.5, "se": 0.1, "tasks": 2}}
    assert (entry["scored_tasks"], entry["scored_sessions"]) == (1, 1)
