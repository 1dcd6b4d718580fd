"""polar_cli/eval: pass@k against hand-computed values (and not the biased 1 - (1 - c/n)^k), standard errors over
tasks, causes and masking (report.py), call statistics from rows."""

from __future__ import annotations

import math

import pytest

from polar_cli.eval.metrics import Estimate, aggregate, mean_se, pass_at_k, score_task
from polar_cli.eval.report import build_report, call_stats, cause_of, tool_call_counts


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # pass@1 = c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (3, 0, 2, 0.0),
        (3, 2, 2, 1.0),  # n - c < k: every pair holds a correct one
        (2, 1, 2, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_not_the_biased_estimator() -> None:
    """1 - (1 - c/n)^k (draws with replacement) gives 0.64 and 0.4375 here, not 0.7 and 0.5."""
    for n, c, k in [(5, 2, 2), (4, 1, 2), (2, 1, 2)]:
        assert pass_at_k(n, c, k) != pytest.approx(1 - (1 - c / n) ** k, abs=1e-6)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 4), (3, 1, 0), (0, 0, 1)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_standard_error_is_over_tasks_with_ddof_1() -> None:
    # mean 0.5; deviations 0.5, -0.5, 0: variance 0.5 / 2 = 0.25, sd 0.5, se 0.5 / sqrt(3)
    assert mean_se([1.0, 0.0, 0.5]) == Estimate(0.5, pytest.approx(0.5 / math.sqrt(3)), 3)
    assert mean_se([0.7]) == Estimate(0.7, None, 1)
    assert mean_se([]) == Estimate(None, None, 0)


def test_aggregate_averages_tasks_and_skips_those_with_too_few_samples() -> None:
    scores = [score_task("a", [True, False], [1, 2, 3]), score_task("b", [False, False, True], [1, 2, 3])]
    assert scores[0].pass_at == {1: 0.5, 2: 1.0, 3: None}
    assert scores[1].pass_at[2] == pytest.approx(1 - 1 / 3)  # 1 - C(2,2)/C(3,2)
    overall = aggregate(scores, [1, 2, 3])
    assert overall[1].mean == pytest.approx((0.5 + 1 / 3) / 2) and overall[1].tasks == 2
    assert overall[1].se == pytest.approx(abs(0.5 - 1 / 3) / 2)  # two values: sd |a-b|/sqrt(2), se sd/sqrt(2)
    assert overall[3] == Estimate(1.0, None, 1)


def _result(sid: str, task: str, status: str, reward: float | None = None, reason: str | None = None) -> dict:
    return {"session_id": sid, "task_id": task, "sample": int(sid[-1]), "status": status, "reward": reward,
            "reason": reason}  # fmt: skip


def test_causes_and_masking() -> None:
    results = [
        _result("s0", "a", "completed", 1.0),
        _result("s1", "a", "completed", 0.0),
        _result("s2", "a", "error", None, "sandbox failed"),  # masked: not in n
        _result("s3", "a", "completed", 0.0, "wrote neither /logs/verifier/reward.txt nor reward.json"),
        _result("s4", "b", "failed", 0.0, "exit 1"),
        _result("s5", "b", "timeout", 0.0),
        _result("s6", "b", "cancelled"),
    ]
    assert [cause_of(r, 1.0) for r in results] == [
        "passed", "wrong", "infrastructure", "verifier_error", "harness_failed", "timeout", "infrastructure",
    ]  # fmt: skip
    assert cause_of(_result("s0", "a", "completed", 0.5), 0.5) == "passed"
    report = build_report(results, [1, 2])
    assert [(t.task_id, t.n, t.c) for t in report.tasks] == [("a", 3, 1), ("b", 2, 0)]
    assert report.tasks[0].pass_at == {1: pytest.approx(1 / 3), 2: pytest.approx(1 - 1 / 3)}
    assert report.overall[1].mean == pytest.approx(1 / 6)
    assert report.causes == {"passed": 1, "wrong": 1, "verifier_error": 1, "harness_failed": 1, "timeout": 1,
                             "context_overflow": 0, "infrastructure": 2}  # fmt: skip
    assert report.turns is None  # no store given
    doc = report.to_json()
    assert doc["overall"]["pass@1"]["mean"] == pytest.approx(1 / 6) and doc["tasks"][1]["causes"] == {
        "harness_failed": 1, "timeout": 1, "infrastructure": 1,
    }  # fmt: skip


def test_call_statistics_and_format_causes() -> None:
    rows = [
        {"session_id": "s1", "status": "ok", "finish_reason": "stop", "parse_failures": 1, "prompt_len": 100,
         "response_len": 10, "tools_json": '[{"type": "function"}]'},
        {"session_id": "s1", "status": "ok", "finish_reason": "length", "parse_failures": None, "prompt_len": 120,
         "response_len": 5, "tools_json": '[{"type": "function"}]'},
        {"session_id": "s1", "status": "error", "finish_reason": None, "parse_failures": None, "prompt_len": 0,
         "response_len": 0, "tools_json": None},
        {"session_id": "s0", "status": "ok", "finish_reason": "tool_calls", "parse_failures": 0, "prompt_len": 50,
         "response_len": 7, "tools_json": '[{"type": "function"}]'},
    ]  # fmt: skip
    stats = call_stats(rows)
    s1 = stats["s1"]
    assert (s1.calls, s1.failed_calls, s1.prompt_tokens, s1.response_tokens) == (3, 1, 220, 15)
    assert (s1.tool_call_turns, s1.parse_failures, s1.length_cuts, s1.offered_tools) == (0, 1, 1, True)
    report = build_report(
        [_result("s0", "a", "completed", 1.0), _result("s1", "a", "completed", 0.0)], [1], calls=stats
    )
    assert report.format["failing_sessions_without_tool_call"] == 1
    assert report.format["failing_sessions_with_parse_failures"] == 1 and report.format["length_cut_calls"] == 1
    # 3 answered calls (the failed one is not), 1 of them a tool call: the protocol's share of turns
    assert (report.format["answered_calls"], report.format["tool_call_calls"]) == (3, 1)
    assert tool_call_counts([]) == {"answered_calls": 0, "tool_call_calls": 0}
    assert report.turns == Estimate(2.0, pytest.approx(1.0), 2)  # 1 and 3 calls
    assert report.tokens is not None and report.tokens.mean == pytest.approx((57 + 235) / 2)


def test_a_refused_context_window_is_the_cause_of_the_session_it_ended() -> None:
    """A failed or timed-out session with a call refused for the context window failed by overflow; a session that
    completed after one (the harness compacted) keeps its verifier's cause; other refusals are not overflows."""
    overflow = "400 context_length_exceeded: prompt_tokens=33000 window=32768: the prompt is too long"

    def calls(sid: str, *errors: str | None) -> list[dict]:
        return [{"session_id": sid, "status": "ok" if e is None else "failed", "error": e, "finish_reason": "stop",
                 "prompt_len": 10, "response_len": 2, "tools_json": None} for e in errors]  # fmt: skip

    rows = [
        *calls("s0", None, overflow),  # then the harness exited 1
        *calls("s1", None, overflow, overflow),  # then it hung to the deadline
        *calls("s2", None, overflow, None),  # compacted, finished, wrong
        *calls("s3", None, "400 invalid_request: context_length_exceeded is not a field"),  # another refusal
        *calls("s4", None),
    ]
    stats = call_stats(rows)
    assert [stats[f"s{i}"].context_overflows for i in range(5)] == [1, 2, 1, 0, 0]
    results = [
        _result("s0", "a", "failed", 0.0, "exit 1"),
        _result("s1", "a", "timeout", 0.0),
        _result("s2", "a", "completed", 0.0),
        _result("s3", "b", "failed", 0.0, "exit 1"),
        _result("s4", "b", "timeout", 0.0),
    ]
    report = build_report(results, [1], calls=stats)
    assert [o.cause for o in report.sessions] == ["context_overflow", "context_overflow", "wrong", "harness_failed",
                                                  "timeout"]  # fmt: skip
    assert report.causes["context_overflow"] == 2 and report.format["context_overflow_calls"] == 4
    # Not masked: an overflow is the policy's session ending badly, a sample in n.
    assert [(t.task_id, t.n, t.c) for t in report.tasks] == [("a", 3, 0), ("b", 2, 0)]
    assert build_report(results, [1]).causes["context_overflow"] == 0  # no store: the rollout's causes only


def test_polar_eval_refuses_a_k_above_the_samples_before_any_session(tmp_path) -> None:
    from typer.testing import CliRunner

    from polar_cli.app import app

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t", "instruction": "x", "verify": "true"}\n')
    args = ["eval", str(tasks), "--harness", "cmd:true", "--samples", "2", "--k", "3", "--engine", "scripted:x"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "store")])
    assert result.exit_code == 2 and "--k" in result.output and "1 <= k <= --samples (2)" in result.output
    assert not (tmp_path / "store").exists()
