"""`polar loop --eval`: the held-out tasks evaluated on the policy of an iteration, read as `polar eval` reads them.

Before the first iteration's rollout (the base) and after every ``--eval-every``-th iteration's weight push, the
held-out tasks run through the same harness, runtime and engine as the loop's rollouts (``--eval-samples`` sessions
each, on the policy that iteration samples from), into ``OUT/eval/iter-NNN/`` (``shards/``, ``logs/``,
``rollout-summary.json``, ``eval-report.json``). That directory is not under ``OUT/iter-NNN/``, whose ``shards/`` are
the only input of that iteration's ``polar train``: an eval session is never trained on. The sessions are scored by
``polar eval``'s own code (:func:`polar_cli.eval.report.build_report`: the unbiased pass@k, standard errors over
tasks, failure causes), and :func:`loop_entry` keeps the figures loop.json records per evaluated iteration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from polar_cli.eval.report import EvalReport, build_report, read_call_stats

EVAL_DIR = "eval"
EVAL_REPORT = "eval-report.json"


def eval_dir(out: Path, i: int) -> Path:
    """Where iteration ``i``'s held-out evaluation goes: outside every ``iter-NNN/``, so no training reads it."""
    return out / EVAL_DIR / f"iter-{i:03d}"


def eval_due(i: int, iterations: int, every: int) -> bool:
    """Whether iteration ``i``'s policy is evaluated: the base (0), every ``every``-th, and the last (the policy the
    loop ends with, which its last rollout measures)."""
    if every < 1:
        raise ValueError(f"--eval-every must be at least 1, not {every}")
    return i % every == 0 or i == iterations - 1


def eval_ks(samples: int) -> list[int]:
    """The k of pass@k an evaluation of ``samples`` sessions per task reports: 1 and ``samples``."""
    return sorted({1, samples})


def score(results: Sequence[Mapping[str, Any]], samples: int, threshold: float, store: Path | None) -> EvalReport:
    """The held-out rollout's session results as `polar eval`'s report (call statistics from ``store`` if any)."""
    calls = None
    if store is not None and store.is_dir():
        try:
            calls = read_call_stats(str(store), [r["session_id"] for r in results])
        except (OSError, ValueError):
            calls = None  # the figures stay; only the per-session calls and tokens are missing
    return build_report(results, eval_ks(samples), threshold, calls)


def loop_entry(report: EvalReport, iteration: int, policy: str, version: int, seconds: float) -> dict[str, Any]:
    """What loop.json keeps of one evaluation: pass@1 ± SE, pass@k, how many tasks and sessions, the causes."""
    overall = {f"pass@{k}": asdict(e) for k, e in report.overall.items()}
    pass1 = report.overall.get(1)
    return {
        "iteration": iteration,
        "policy": policy,
        "version": version,
        "pass@1": None if pass1 is None else pass1.mean,
        "pass@1_se": None if pass1 is None else pass1.se,
        "overall": overall,
        "tasks": len(report.tasks),
        "scored_tasks": sum(1 for t in report.tasks if t.n),
        "sessions": len(report.sessions),
        "scored_sessions": sum(t.n for t in report.tasks),
        "causes": report.causes,
        "format": report.format,
        "seconds": seconds,
    }
