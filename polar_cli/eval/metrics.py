"""pass@k, its standard error and the aggregation over tasks (pure).

pass@k is the unbiased estimator of Chen et al. 2021 (the HumanEval paper, eq. 1): with n samples of a task, c of
them correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, the chance that k samples drawn without replacement from the n
hold at least one correct one; computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)`` (the paper's numerically stable
form). Not ``1 - (1 - c/n)^k``, which is biased (it draws with replacement and underestimates pass@k). A task's
pass@k needs ``n >= k``; the overall value is the mean over the tasks that have one, and its standard error is over
tasks (sample standard deviation / sqrt(tasks)): the spread that matters when the task set is a sample of problems.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``n`` samples, ``c`` correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class Estimate:
    """A mean over tasks and its standard error (None with fewer than two tasks)."""

    mean: float | None
    se: float | None
    tasks: int


def mean_se(values: Sequence[float]) -> Estimate:
    """The mean of ``values`` and its standard error (sample standard deviation, ddof 1, over sqrt(len))."""
    m = len(values)
    if m == 0:
        return Estimate(None, None, 0)
    mean = sum(values) / m
    if m < 2:
        return Estimate(mean, None, 1)
    variance = sum((v - mean) ** 2 for v in values) / (m - 1)
    return Estimate(mean, math.sqrt(variance / m), m)


@dataclass(frozen=True)
class TaskScore:
    """One task: ``n`` scored samples (masked ones excluded), ``c`` correct, pass@k per k (None when n < k)."""

    task_id: str
    n: int
    c: int
    pass_at: dict[int, float | None] = field(default_factory=dict)


def score_task(task_id: str, outcomes: Iterable[bool], ks: Sequence[int]) -> TaskScore:
    """A task's pass@k for each k from its samples' outcomes (True: correct)."""
    results = list(outcomes)
    n, c = len(results), sum(results)
    return TaskScore(task_id, n, c, {k: pass_at_k(n, c, k) if 1 <= k <= n else None for k in ks})


def aggregate(scores: Sequence[TaskScore], ks: Sequence[int]) -> dict[int, Estimate]:
    """pass@k over tasks, per k: the mean of the tasks' pass@k (those with n >= k) and its standard error."""
    return {k: mean_se([v for s in scores if (v := s.pass_at.get(k)) is not None]) for k in ks}
