"""A rollout's sessions as an evaluation report: each session's outcome and failure cause, pass@k per task and
overall (metrics.py), the calls each session made (from the trace store), as JSON and as a rich table.

Causes (one per session): ``passed`` (completed, reward >= the pass threshold), ``wrong`` (completed, the verifier
said no), ``verifier_error`` (completed with a reason: the verifier left no readable reward, ran past its timeout,
or a process outlived it; scored 0, as the rollout scores it), ``harness_failed`` (``failed``: exit non-zero, killed,
or nothing produced), ``timeout``, ``context_overflow`` (a failed or timed-out session one of whose calls the engine
refused for the context window: what ended it, from the trace store), ``infrastructure`` (``error`` /
``cancelled``: masked, left out of n). Format-level counts come from the captured calls: calls whose tool-call text
failed to parse, sessions offered tools that never made a tool call, calls cut by the token limit, calls refused for
the context window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from polar_cli.eval.metrics import Estimate, TaskScore, aggregate, mean_se, score_task

CAUSES = ("passed", "wrong", "verifier_error", "harness_failed", "timeout", "context_overflow", "infrastructure")
# The causes an overflow explains: the harness gave up (exit non-zero) or hung after the refusal. A session that
# completed went on past it (compaction) and keeps its verifier's cause.
OVERFLOW_ENDS = frozenset({"harness_failed", "timeout"})
# The error kind polar records for a call the engine refused for the context window (gateway._record_failure).
OVERFLOW_KIND = "context_length_exceeded"
MASKED_CAUSES = frozenset({"infrastructure"})


@dataclass(frozen=True)
class CallStats:
    """What one session's captured calls say."""

    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    tool_call_turns: int = 0  # calls that ended in a tool call
    parse_failures: int = 0  # tool-call texts the engine's parser could not read
    length_cuts: int = 0  # calls cut by the token limit
    context_overflows: int = 0  # calls refused for the context window
    offered_tools: bool = False  # some call carried tool definitions


@dataclass(frozen=True)
class SessionOutcome:
    session_id: str
    task_id: str
    sample: int
    status: str
    reward: float | None
    cause: str
    reason: str | None
    calls: CallStats | None = None


@dataclass
class EvalReport:
    ks: list[int]
    pass_threshold: float
    tasks: list[TaskScore]
    overall: dict[int, Estimate]
    causes: dict[str, int]
    format: dict[str, int]
    turns: Estimate | None
    tokens: Estimate | None
    sessions: list[SessionOutcome]
    causes_by_task: dict[str, dict[str, int]] = field(default_factory=dict)  # every task's: build_report's

    def to_json(self) -> dict[str, Any]:
        return {
            "ks": self.ks,
            "pass_threshold": self.pass_threshold,
            "overall": {f"pass@{k}": asdict(e) for k, e in self.overall.items()},
            "tasks": [
                {"task_id": t.task_id, "n": t.n, "c": t.c, **{f"pass@{k}": v for k, v in t.pass_at.items()},
                 "causes": self.causes_by_task[t.task_id]}
                for t in self.tasks
            ],
            "causes": self.causes,
            "format": self.format,
            "turns_per_session": asdict(self.turns) if self.turns else None,
            "tokens_per_session": asdict(self.tokens) if self.tokens else None,
            "sessions": [asdict(s) for s in self.sessions],
        }  # fmt: skip


def cause_of(result: Mapping[str, Any], threshold: float) -> str:
    """The failure cause (or ``passed``) of one rollout session result (``rollout-summary.json``'s entries)."""
    status = result.get("status")
    if status == "completed":
        reward = result.get("reward")
        if result.get("reason"):
            return "verifier_error"
        return "passed" if reward is not None and reward >= threshold else "wrong"
    if status == "failed":
        return "harness_failed"
    if status == "timeout":
        return "timeout"
    return "infrastructure"


def session_cause(result: Mapping[str, Any], threshold: float, calls: CallStats | None) -> str:
    """:func:`cause_of`, with ``context_overflow`` where the session's calls (the trace store's) say a refused
    context window ended it."""
    cause = cause_of(result, threshold)
    if cause in OVERFLOW_ENDS and calls is not None and calls.context_overflows:
        return "context_overflow"
    return cause


def build_report(
    results: Iterable[Mapping[str, Any]],
    ks: Sequence[int],
    threshold: float = 1.0,
    calls: Mapping[str, CallStats] | None = None,
) -> EvalReport:
    """The report of a rollout's session results; ``calls``: session id -> its call statistics (None: no store)."""
    outcomes = []
    for r in results:
        stats = (calls or {}).get(r["session_id"])
        cause = session_cause(r, threshold, stats)
        outcomes.append(SessionOutcome(r["session_id"], r["task_id"], int(r["sample"]), str(r["status"]),
                                       r.get("reward"), cause, r.get("reason"), stats))  # fmt: skip
    by_task: dict[str, list[bool]] = {}
    causes_by_task: dict[str, Counter] = {}
    for o in outcomes:
        causes_by_task.setdefault(o.task_id, Counter())[o.cause] += 1
        scored = by_task.setdefault(o.task_id, [])
        if o.cause not in MASKED_CAUSES:  # infrastructure is no sample of the policy
            scored.append(o.cause == "passed")
    scores = [score_task(t, v, ks) for t, v in by_task.items()]
    counted = Counter(o.cause for o in outcomes)
    stats = [o.calls for o in outcomes if o.calls is not None and o.cause not in MASKED_CAUSES]
    failing = [o.calls for o in outcomes if o.calls is not None and o.cause not in ("passed", *MASKED_CAUSES)]
    fmt = {
        "parse_failures": sum(s.parse_failures for s in stats),
        "failing_sessions_with_parse_failures": sum(1 for s in failing if s.parse_failures),
        "failing_sessions_without_tool_call": sum(1 for s in failing if s.offered_tools and not s.tool_call_turns),
        "failing_sessions_without_calls": sum(1 for s in failing if not s.calls),
        "length_cut_calls": sum(s.length_cuts for s in stats),
        "context_overflow_calls": sum(s.context_overflows for s in stats),
        "failed_calls": sum(s.failed_calls for s in stats),
        **tool_call_counts(stats),
    }
    return EvalReport(
        ks=list(ks),
        pass_threshold=threshold,
        tasks=scores,
        overall=aggregate(scores, ks),
        causes={c: counted.get(c, 0) for c in CAUSES},
        format=fmt,
        turns=mean_se([float(s.calls) for s in stats]) if calls is not None else None,
        tokens=mean_se([float(s.prompt_tokens + s.response_tokens) for s in stats]) if calls is not None else None,
        sessions=outcomes,
        causes_by_task={t: dict(c) for t, c in causes_by_task.items()},
    )


def tool_call_counts(stats: Iterable[CallStats]) -> dict[str, int]:
    """The answered calls and how many of them ended in a tool call: the share of turns that speak the harness's
    tool protocol (what a protocol-learning run watches)."""
    stats = list(stats)
    return {
        "answered_calls": sum(s.calls - s.failed_calls for s in stats),
        "tool_call_calls": sum(s.tool_call_turns for s in stats),
    }


def call_stats(rows: Iterable[Mapping[str, Any]]) -> dict[str, CallStats]:
    """Per session, from call rows (session_id, status, error, finish_reason, parse_failures, prompt_len,
    response_len, tools_json)."""
    acc: dict[str, dict[str, Any]] = {}
    for row in rows:
        a = acc.setdefault(row["session_id"], Counter())
        a["calls"] += 1
        if row.get("status") != "ok":
            a["failed_calls"] += 1
            # "400 context_length_exceeded: prompt_tokens=N window=M: ..." (the kind is the error's second word)
            a["context_overflows"] += OVERFLOW_KIND in str(row.get("error") or "").split(":", 1)[0].split()
            continue
        a["prompt_tokens"] += int(row.get("prompt_len") or 0)
        a["response_tokens"] += int(row.get("response_len") or 0)
        a["tool_call_turns"] += row.get("finish_reason") == "tool_calls"
        a["parse_failures"] += int(row.get("parse_failures") or 0)
        a["length_cuts"] += row.get("finish_reason") == "length"
        a["offered_tools"] |= bool(row.get("tools_json") not in (None, "", "null", "[]"))
    return {sid: CallStats(**{k: (bool(v) if k == "offered_tools" else int(v)) for k, v in a.items()})
            for sid, a in acc.items()}  # fmt: skip


def read_call_stats(store: str, session_ids: Iterable[str]) -> dict[str, CallStats]:
    """:func:`call_stats` of the sessions' calls in the trace store ``store``."""
    import pyarrow.compute as pc

    from polar_addon.store.reader import read_table

    columns = [
        "session_id",
        "status",
        "error",
        "finish_reason",
        "parse_failures",
        "prompt_len",
        "response_ids",
        "tools_json",
    ]
    table = read_table(store, columns=columns, session_ids=list(session_ids))
    table = table.append_column("response_len", pc.list_value_length(table.column("response_ids")))
    return call_stats(table.drop_columns(["response_ids"]).to_pylist())


def render(report: EvalReport) -> Any:
    """A rich table: one row per task (n, c, pass@k, causes) and the overall row (pass@k +- SE)."""
    from rich.table import Table

    table = Table(title="polar eval")
    table.add_column("task")
    table.add_column("n", justify="right")
    table.add_column("c", justify="right")
    for k in report.ks:
        table.add_column(f"pass@{k}", justify="right")
    table.add_column("causes")
    for t in report.tasks:
        causes = ", ".join(f"{c} {n}" for c, n in sorted(report.causes_by_task[t.task_id].items()))
        table.add_row(t.task_id, str(t.n), str(t.c), *(_num(t.pass_at.get(k)) for k in report.ks), causes)
    table.add_section()
    overall = [report.overall[k] for k in report.ks]
    n = sum(t.n for t in report.tasks)
    c = sum(t.c for t in report.tasks)
    causes = ", ".join(f"{c_} {v}" for c_, v in report.causes.items() if v)
    table.add_row(f"all ({len(report.tasks)} tasks)", str(n), str(c), *(_estimate(e) for e in overall), causes)
    return table


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _estimate(e: Estimate) -> str:
    if e.mean is None:
        return "-"
    return f"{e.mean:.3f}" + (f" ± {e.se:.3f}" if e.se is not None else "")
