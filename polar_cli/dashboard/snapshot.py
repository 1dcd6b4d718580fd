"""What the dashboard shows, as one JSON-able snapshot of a directory (files in, a dict out; no server).

A directory is one of three kinds: a loop's ``--out`` (``loop.json``; its rollouts are ``iter-NNN/``,
``eval/iter-NNN/`` and the async loop's ``batch-NNN/``, each with its own ``shards/`` store), one rollout's report
directory (``rollout-manifest.json`` or ``rollout-progress.json``) or a store (``calls/``, ``sessions/``,
``rewards/`` shards or a live writer's ``_journal/``; its rollouts' report directories under ``rollouts/``).
Everything here is read as it is while other processes write it: a file half there or a store with no shards yet
is shown as not there yet, never an error.

Reading a store means building every session in it (for merge rates and break causes), so :class:`Snapshotter`
keeps what each store gave, keyed by its files' names, sizes and mtimes: a loop's finished iterations are read once.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_cli.eval.metrics import mean_se
from polar_cli.rollout.progress_file import PROGRESS_FILE

LOOP_FILE = "loop.json"
MANIFEST_FILE = "rollout-manifest.json"
SUMMARY_FILE = "rollout-summary.json"
STORE_DIRS = ("calls", "sessions", "rewards", "_journal")
MAX_SESSIONS = 500  # the newest, so a long loop's page stays small

Fingerprint = tuple[tuple[str, int, int], ...]


def is_store(path: Path) -> bool:
    return any((path / d).is_dir() for d in STORE_DIRS)


def detect_kind(path: Path) -> str:
    """``loop``, ``run`` or ``store``; ValueError for a directory that is none of them."""
    # A loop writes loop.json after its first iteration: until then its first rollout's progress file says it.
    if (
        (path / LOOP_FILE).is_file()
        or any(path.glob(f"iter-*/{PROGRESS_FILE}"))
        or any(path.glob(f"batch-*/{PROGRESS_FILE}"))
    ):
        return "loop"
    if (path / MANIFEST_FILE).is_file() or (path / PROGRESS_FILE).is_file():
        return "run"
    if (path / "rollouts").is_dir() or is_store(path):
        return "store"
    raise ValueError(
        f"{path} is no store (calls/, sessions/), rollout report directory ({MANIFEST_FILE}) "
        f"or loop directory ({LOOP_FILE})"
    )


def _read_json(path: Path) -> Any:
    """The file's JSON, or None while it is missing or half written (a writer without os.replace)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def report_dirs(path: Path, kind: str) -> list[Path]:
    """The rollouts' report directories ``path`` holds, in the order they ran."""
    if kind == "run":
        return [path]
    if kind == "store":
        found = list((path / "rollouts").glob("*"))
    else:
        found = [*path.glob("iter-*"), *path.glob("batch-*"), *(path / "eval").glob("iter-*")]
    return sorted((p for p in found if p.is_dir()), key=lambda p: (_mtime(p), p.name))


def run_store(report: Path) -> Path | None:
    """The store a rollout's calls went to: a loop's ``shards/`` beside its report, the store a default report
    directory (STORE/rollouts/RUN_ID) sits in, or the manifest's ``store``."""
    if (report / "shards").is_dir():
        return report / "shards"
    if report.parent.name == "rollouts" and is_store(report.parent.parent):
        return report.parent.parent
    manifest = _read_json(report / MANIFEST_FILE) or {}
    store = manifest.get("store")
    if isinstance(store, str) and store:
        # A relative --out is relative to where `polar rollout` ran, which the manifest does not say; the report
        # directory's own parents are the likeliest places.
        for base in (Path.cwd(), *report.parents):
            candidate = Path(store) if Path(store).is_absolute() else base / store
            if is_store(candidate):
                return candidate
    return None


def stores_of(path: Path, kind: str, reports: list[Path]) -> list[Path]:
    if kind == "store":
        return [path] if is_store(path) else []
    return [s for s in dict.fromkeys(run_store(r) for r in reports) if s is not None]


def store_fingerprint(store: Path) -> Fingerprint:
    """Every file of the store's shard and journal directories: (path, size, mtime ns). Shards appear whole (a
    hidden name, then a rename), so a changed listing is the only sign that there is more to read."""
    out: list[tuple[str, int, int]] = []
    for sub in STORE_DIRS:
        for root, _dirs, files in os.walk(store / sub):
            for name in files:
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue  # renamed or removed between the listing and the stat
                out.append((os.path.join(root, name), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def fingerprint(path: Path) -> Fingerprint:
    """What changes when the snapshot would: the state and report files and the stores' listings."""
    try:
        kind = detect_kind(path)
    except ValueError:  # nothing there yet: the first file to appear is the change
        return tuple(sorted((str(p), 0, 0) for p in path.glob("*")))
    reports = report_dirs(path, kind)
    files = [path / LOOP_FILE] + [r / n for r in reports for n in (PROGRESS_FILE, SUMMARY_FILE, MANIFEST_FILE)]
    out: list[tuple[str, int, int]] = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append((str(f), st.st_size, st.st_mtime_ns))
    for store in stores_of(path, kind, reports):
        out.extend(store_fingerprint(store))
    return tuple(out)


def _finite(value: Any) -> float | None:
    return value if isinstance(value, int | float) and math.isfinite(value) else None


def _estimate(values: list[float]) -> dict[str, Any]:
    values = [v for v in values if _finite(v) is not None]
    e = mean_se(values)
    return {"mean": _finite(e.mean), "se": _finite(e.se), "n": len(values)}


def run_snapshot(report: Path, root: Path) -> dict[str, Any]:
    """One rollout: its live counters (or, once it has ended, its summary's), group rewards with SE, errors."""
    progress = _read_json(report / PROGRESS_FILE)
    progress = progress if isinstance(progress, dict) else {}
    summary = _read_json(report / SUMMARY_FILE)
    summary = summary if isinstance(summary, dict) else None
    statuses = dict(progress.get("statuses") or {})
    groups = {str(g): list(r) for g, r in (progress.get("group_rewards") or {}).items() if isinstance(r, list)}
    if summary:
        statuses = dict(summary.get("statuses") or statuses)
        groups = {str(g): list(v.get("rewards") or []) for g, v in (summary.get("groups") or {}).items()}
    rewards = [r for values in groups.values() for r in values]
    return {
        "name": str(report.relative_to(root)) if report != root else report.name,
        "total": progress.get("total"),
        "stages": progress.get("stages") or {},
        # A summary counts every status, zeros included; the live file only those seen. Zeros are no sessions.
        "statuses": {str(k): v for k, v in statuses.items() if v},
        "sessions_per_minute": _finite(progress.get("sessions_per_minute")),
        "errors": progress.get("errors") or [],
        "running": bool(progress) and not progress.get("final") and summary is None,
        "updated_at": progress.get("updated_at"),
        "reward": _estimate(rewards),
        "groups": {g: _estimate(values) for g, values in sorted(groups.items())},
    }


def loop_snapshot(path: Path) -> dict[str, Any]:
    """A loop's iterations (reward mean ± SE, push and train outcome) and held-out evals (pass@k ± SE)."""
    state = _read_json(path / LOOP_FILE)
    state = state if isinstance(state, dict) else {}
    iterations = [
        {"iteration": it.get("iteration"), "reward_mean": _finite(it.get("reward_mean")),
         "reward_se": _finite(it.get("reward_se")), "push_s": _finite(it.get("push_s")),
         "train": (it.get("train") or {}).get("status") if isinstance(it.get("train"), dict) else None}
        for it in state.get("iterations") or [] if isinstance(it, dict)
    ]  # fmt: skip
    evals = [
        {"iteration": ev.get("iteration"),
         "pass": {str(k): {"mean": _finite(v.get("mean")), "se": _finite(v.get("se"))}
                  for k, v in (ev.get("overall") or {}).items() if isinstance(v, dict)}}
        for ev in state.get("evals") or [] if isinstance(ev, dict)
    ]  # fmt: skip
    return {"iterations": iterations, "evals": evals}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class StoreView:
    """What one store contributes to a snapshot."""

    sessions: list[dict[str, Any]] = field(default_factory=list)
    builds: list[tuple[str, Any]] = field(default_factory=list)  # (harness, BuildStats) per session
    calls: int = 0  # ok calls
    latencies: list[float] = field(default_factory=list)  # engine seconds of the ok calls that timed it
    tokens: int = 0  # sampled tokens over the ok calls


def read_store(store: str) -> StoreView:
    """The store's sessions (newest first), each session's build stats and its ok calls' engine figures."""
    import pyarrow.compute as pc

    from polar_addon.store import CALLS, iter_records, read_sessions, read_table
    from polar_cli.build import iter_session_builds
    from polar_cli.build.inputs import session_infos

    view = StoreView()
    rows = sorted(read_sessions(store), key=lambda r: r.started_at or 0.0, reverse=True)[:MAX_SESSIONS]
    view.sessions = [
        {"session_id": r.session_id, "task_id": r.task_id, "group_id": r.group_id, "status": r.status,
         "reward": _finite(r.reward if r.reward is not None else next(iter(r.rewards.values()), None)),
         "harness": r.harness, "calls": r.calls, "failed_calls": r.failed_calls,
         "response_tokens": r.response_tokens, "started_at": r.started_at, "ended_at": r.ended_at,
         "reason": r.metadata.get("reason") if isinstance(r.metadata, dict) else None, "store": store}
        for r in rows
    ]  # fmt: skip
    view.builds = [(b.harness, b.stats) for b in iter_session_builds(iter_records(store), session_infos(store))]
    table = read_table(store, CALLS, columns=["status", "engine_latency_s", "response_ids"])
    table = table.filter(pc.equal(table["status"], "ok"))
    view.calls = table.num_rows
    view.latencies = [v for v in table["engine_latency_s"].to_pylist() if _finite(v) is not None]
    view.tokens = pc.sum(pc.list_value_length(table["response_ids"])).as_py() or 0
    return view


def harness_stats(views: list[StoreView]) -> dict[str, Any]:
    """Per harness, as `polar stats` counts it: sessions, calls, merge rate and every break's cause."""
    from polar_cli.build import BuildReport

    report = BuildReport()
    for view in views:
        for harness, stats in view.builds:
            report.add(harness, stats)
    return {
        harness: {"sessions": s.sessions, "calls": s.calls, "merge_rate": s.merge_rate, "breaks": dict(s.breaks)}
        for harness, s in sorted(report.by_harness.items())
    }


def engine_stats(views: list[StoreView]) -> dict[str, Any]:
    """Engine latency p50/p95 over the ok calls, and tokens/s: sampled tokens over the engine's time for them (over
    the calls it timed only, when some were not)."""
    latencies = [v for view in views for v in view.latencies]
    tokens = sum(view.tokens for view in views)
    seconds = sum(latencies)
    timed_all = all(len(view.latencies) == view.calls for view in views)
    return {
        "calls": sum(view.calls for view in views),
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p95_s": _percentile(latencies, 0.95),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 and timed_all else None,
    }


def _totals(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Sessions by stage and by status over every rollout shown."""
    stages: dict[str, int] = {}
    statuses: dict[str, int] = {}
    for run in runs:
        for k, v in (run["stages"] or {}).items():
            stages[str(k)] = stages.get(str(k), 0) + (v if isinstance(v, int) else 0)
        for k, v in (run["statuses"] or {}).items():
            statuses[str(k)] = statuses.get(str(k), 0) + (v if isinstance(v, int) else 0)
    return {"stages": stages, "statuses": statuses}


class Snapshotter:
    """Snapshots of one directory, each store read again only once its files have changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stores: dict[str, tuple[Fingerprint, StoreView]] = {}
        self.session_stores: dict[str, str] = {}  # session id -> the store holding it, for its trace page

    def _view(self, store: Path) -> tuple[StoreView | None, str | None]:
        key = str(store)
        print_ = store_fingerprint(store)
        cached = self._stores.get(key)
        if cached is not None and cached[0] == print_:
            return cached[1], None
        try:
            view = read_store(key)
        except (OSError, ValueError) as exc:  # pyarrow's errors are both; a shard the writer is still replacing
            return (cached[1] if cached else None), f"{key}: {exc}"
        self._stores[key] = (print_, view)
        return view, None

    def snapshot(self) -> dict[str, Any]:
        """The whole page's data for the directory (a loop, run or store)."""
        path = self.path
        try:
            kind = detect_kind(path)
        except ValueError as exc:  # started before the rollout: an empty page that fills once it begins
            return {"kind": None, "path": str(path), "runs": [], "totals": _totals([]), "loop": None,
                    "sessions": [], "harnesses": {}, "engine": None, "problems": [str(exc)]}  # fmt: skip
        reports = report_dirs(path, kind)
        views: list[StoreView] = []
        problems: list[str] = []
        for store in stores_of(path, kind, reports):
            view, problem = self._view(store)
            if view is not None:
                views.append(view)
            if problem:
                problems.append(problem)
        sessions = sorted((row for view in views for row in view.sessions), key=lambda r: -(r["started_at"] or 0.0))
        sessions = sessions[:MAX_SESSIONS]
        self.session_stores = {row["session_id"]: row["store"] for row in sessions}
        runs = [run_snapshot(r, path) for r in reports]
        return {
            "kind": kind,
            "path": str(path),
            "runs": runs,
            "totals": _totals(runs),
            "loop": loop_snapshot(path) if kind == "loop" else None,
            "sessions": sessions,
            "harnesses": harness_stats(views),
            "engine": engine_stats(views) if views else None,
            "problems": problems,
        }


def snapshot(path: Path) -> dict[str, Any]:
    """One snapshot of ``path``, nothing kept."""
    return Snapshotter(path).snapshot()
