"""polar_cli/eval: pass@k against hand-computed values (and not the biased 1 - (1 - c/n)^k), standard errors over
tasks, causes and masking (report.py), call statistics from rows."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

from polar_cli.eval.metrics import Estimate, aggregate, mean_se, pass_at_k, score_task
from polar_cli.eval.report import CallStats, EvalReport, build_report, call_stats, cause_of, tool_call_counts


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


def test_pass_at_k_refusal_names_the_counts() -> None:
    with pytest.raises(ValueError, match=r"^pass@k needs 0 <= c <= n and 1 <= k <= n \(n=3, c=4, k=1\)$"):
        pass_at_k(3, 4, 1)


def _stats(**fields: int | bool) -> CallStats:
    return CallStats(**fields)  # type: ignore[arg-type]


def _report() -> EvalReport:
    results = [
        _result("s0", "a", "completed", 1.0),
        _result("s1", "a", "completed", 0.0),
        _result("s2", "a", "completed", 0.0),
        {**_result("s3", "b", "failed", 0.0, "exit 1"), "sample": "3"},  # a sample number as the JSON had it
        _result("s4", "b", "error", None, "sandbox failed"),
    ]
    calls = {
        # passed: offered tools, never called one; a parse failure (counted over all sessions, not only failing ones)
        "s0": _stats(calls=2, prompt_tokens=30, response_tokens=5, parse_failures=1, offered_tools=True),
        # wrong: offered tools, never called one
        "s1": _stats(calls=1, prompt_tokens=10, response_tokens=2, offered_tools=True),
        # wrong: no tools offered, no tool call (not a protocol failure); two failed calls
        "s2": _stats(calls=3, failed_calls=2, prompt_tokens=8, response_tokens=1, length_cuts=1),
        # failed without a single call
        "s3": _stats(),
        # masked: its calls count nowhere
        "s4": _stats(calls=5, failed_calls=5, parse_failures=7, offered_tools=True),
    }
    return build_report(results, [1, 2], threshold=0.5, calls=calls)


def test_the_report_document_is_exact() -> None:
    """Every key and value of eval-report.json's body (the CLI adds settings, the rollout summary and the task
    set's hash): a reader relies on these names."""
    doc = _report().to_json()
    s0, s1, s2, s3, s4 = doc["sessions"]
    assert doc == {
        "ks": [1, 2],
        "pass_threshold": 0.5,
        "overall": {"pass@1": {"mean": pytest.approx(1 / 6), "se": pytest.approx(1 / 6), "tasks": 2},
                    "pass@2": {"mean": pytest.approx(2 / 3), "se": None, "tasks": 1}},  # b: one sample
        "tasks": [
            {"task_id": "a", "n": 3, "c": 1, "pass@1": pytest.approx(1 / 3), "pass@2": pytest.approx(2 / 3),
             "causes": {"passed": 1, "wrong": 2}},
            {"task_id": "b", "n": 1, "c": 0, "pass@1": 0.0, "pass@2": None,
             "causes": {"harness_failed": 1, "infrastructure": 1}},
        ],
        "causes": {"passed": 1, "wrong": 2, "verifier_error": 0, "harness_failed": 1, "timeout": 0,
                   "context_overflow": 0, "infrastructure": 1},
        "format": {"parse_failures": 1, "failing_sessions_with_parse_failures": 0,
                   "failing_sessions_without_tool_call": 1, "failing_sessions_without_calls": 1,
                   "length_cut_calls": 1, "context_overflow_calls": 0, "failed_calls": 2, "answered_calls": 4,
                   "tool_call_calls": 0},
        # calls per session: 2, 1, 3, 0 (the masked session left out)
        "turns_per_session": {"mean": 1.5, "se": pytest.approx(math.sqrt(5 / 3) / 2), "tasks": 4},
        "tokens_per_session": {"mean": pytest.approx(56 / 4), "se": pytest.approx(mean_se([35, 12, 9, 0]).se),
                               "tasks": 4},
        "sessions": [s0, s1, s2, s3, s4],
    }  # fmt: skip
    assert s3 == {"session_id": "s3", "task_id": "b", "sample": 3, "status": "failed", "reward": 0.0,
                  "cause": "harness_failed", "reason": "exit 1", "calls": asdict(_stats())}  # fmt: skip
    assert (s0["sample"], s0["status"], s0["reward"], s0["reason"], s0["cause"]) == (
        0,
        "completed",
        1.0,
        None,
        "passed",
    )
    assert (s4["status"], s4["reward"], s4["reason"], s4["cause"]) == (
        "error",
        None,
        "sandbox failed",
        "infrastructure",
    )
    assert [type(s["sample"]) for s in doc["sessions"]] == [int] * 5
    # Without a store: no call statistics at all.
    bare = build_report([_result("s0", "a", "completed", 1.0)], [1]).to_json()
    assert (bare["turns_per_session"], bare["tokens_per_session"], bare["sessions"][0]["calls"]) == (None, None, None)


def test_call_statistics_count_every_call() -> None:
    """Counts add up over a session's calls (none is taken for the last one), missing lengths are 0, and a tools
    list that is empty in any spelling offers none."""
    rows = [
        {"session_id": "s", "status": "ok", "finish_reason": "tool_calls", "prompt_len": None, "response_len": None,
         "tools_json": '[{"type": "function"}]'},
        {"session_id": "s", "status": "ok", "finish_reason": "tool_calls", "prompt_len": 7, "response_len": 3,
         "tools_json": "[]"},
        {"session_id": "s", "status": "ok", "finish_reason": "length", "prompt_len": 9, "response_len": 4},
        {"session_id": "s", "status": "ok", "finish_reason": "length", "prompt_len": 1, "response_len": 1,
         "tools_json": "null"},
        {"session_id": "s", "status": "failed", "error": "502 api_error: engine error"},
        {"session_id": "s", "status": "failed", "error": None},
        *({"session_id": f"t{i}", "status": "ok", "finish_reason": "stop", "tools_json": tools}
          for i, tools in enumerate([None, "", "null", "[]"])),
    ]  # fmt: skip
    stats = call_stats(rows)
    expected = CallStats(calls=6, failed_calls=2, prompt_tokens=17, response_tokens=8, tool_call_turns=2,
                         parse_failures=0, length_cuts=2, context_overflows=0, offered_tools=True)  # fmt: skip
    assert stats["s"] == expected
    assert stats["s"].offered_tools is True and type(stats["s"].calls) is int
    assert [stats[f"t{i}"].offered_tools for i in range(4)] == [False] * 4
    assert [stats[f"t{i}"].prompt_tokens for i in range(4)] == [0] * 4


def test_read_call_stats_reads_the_store(tmp_path) -> None:
    """The same statistics from a real trace store, for the sessions asked for only."""
    import asyncio

    from polar_addon.capture import CaptureRecord, new_record_id, record_failed
    from polar_addon.identity import Identity
    from polar_addon.store import TraceStore
    from polar_cli.eval.report import read_call_stats

    def ok(session: str, finish: str, prompt: int, response: int, tools: str, parse_failures: int | None = None):
        return CaptureRecord(
            record_id=new_record_id(), session_id=session, seq=-1, api="openai_chat", status="ok",
            prompt_ids=list(range(prompt)), response_ids=list(range(response)), logprobs=[-0.5] * response,
            finish_reason=finish, tools_json=tools, parse_failures=parse_failures,
        )  # fmt: skip

    def failed(session: str, error: str):
        return record_failed(identity=Identity(session_id=session, source="header"), seq=-1, api="openai_chat",
                             request=None, error=error, harness=None, started_at=0.0)  # fmt: skip

    records = [
        ok("a", "tool_calls", 12, 3, '[{"type": "function"}]', 1),
        ok("a", "length", 20, 5, '[{"type": "function"}]'),
        failed("a", "400 context_length_exceeded: prompt_tokens=40 window=32: the prompt is too long"),
        ok("b", "stop", 4, 2, "[]"),
        ok("other", "stop", 100, 100, "[]"),
    ]

    async def write() -> None:
        store = TraceStore(str(tmp_path))
        for record in records:
            await store.append(record)
        await store.aclose()

    asyncio.run(write())
    got = read_call_stats(str(tmp_path), ["a", "b"])
    assert got == {
        "a": CallStats(calls=3, failed_calls=1, prompt_tokens=32, response_tokens=8, tool_call_turns=1,
                       parse_failures=1, length_cuts=1, context_overflows=1, offered_tools=True),
        "b": CallStats(calls=1, prompt_tokens=4, response_tokens=2),
    }  # fmt: skip


def test_the_table_shows_each_task_and_the_overall_estimate() -> None:
    from rich.console import Console

    from polar_cli.eval.report import render

    def text(report: EvalReport) -> list[str]:
        console = Console(record=True, width=200, color_system=None)
        console.print(render(report))
        return [" ".join(line.translate(BOX).split()) for line in console.export_text().splitlines()]

    lines = text(_report())
    assert [c.justify for c in render(_report()).columns] == ["left", *["right"] * 4, "left"]  # numbers to the right
    header = next(line for line in lines if line.startswith("task"))
    assert header == "task n c pass@1 pass@2 causes"
    assert "a 3 1 0.333 0.667 passed 1, wrong 2" in lines
    assert "b 1 0 0.000 - harness_failed 1, infrastructure 1" in lines  # no pass@2 from one sample
    # pass@2 over task a alone: a mean without an SE
    assert "all (2 tasks) 4 1 0.167 ± 0.167 0.667 passed 1, wrong 2, harness_failed 1, infrastructure 1" in lines
    assert lines[0] == "polar eval"
    assert "all (1 tasks) 0 0 - infrastructure 1" in text(build_report([_result("s0", "a", "error", None)], [1]))


BOX = str.maketrans(dict.fromkeys("│┃", " "))
