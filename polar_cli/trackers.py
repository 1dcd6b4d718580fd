"""Experiment trackers (`--report-to`): TensorBoard, Weights & Biases, trackio.

`polar train` hands the names to TRL (its own callbacks log the trainer's metrics); `polar loop` logs one point per
iteration (or async step) through one :class:`TrackerWriter` per name: reward mean ± SE, held-out pass@1, staleness,
push latency and busy fractions, the iteration as the step. Every backend writes locally (TensorBoard event files,
wandb's run directory, offline with ``WANDB_MODE=offline``, trackio's local database) under one logging directory.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# name -> (the module TRL's callback imports, the pip requirement; the versions pinned in constraints.txt).
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard==2.21.0"),
    "wandb": ("wandb", "wandb==0.31.0"),
    "trackio": ("trackio", "trackio==0.43.0"),
}


class TrackerError(ValueError):
    """An unknown tracker, or one whose package is not installed (said before anything runs)."""


def parse_report_to(values: Sequence[str]) -> list[str]:
    """``--report-to`` as given (repeatable, each a comma list, as TRL's ``report_to``) -> the trackers, in order,
    once each; ``none`` (alone) or nothing -> []."""
    names: list[str] = []
    for value in values:
        for name in (n.strip().lower() for n in value.split(",")):
            if name and name not in names:
                names.append(name)
    if "none" in names:
        if len(names) > 1:
            raise TrackerError(f"--report-to none cannot be combined with {', '.join(n for n in names if n != 'none')}")
        return []
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise TrackerError(f"--report-to: unknown tracker {', '.join(unknown)} (one of none, {', '.join(TRACKERS)})")
    return names


def check_installed(names: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """Refuse a tracker whose package is missing, with the command that installs it (not a traceback mid-run), and
    wandb online without credentials (it would stop at a login prompt or fail after the first rollout)."""
    environ = os.environ if environ is None else environ
    if "wandb" in names and environ.get("WANDB_MODE") not in ("offline", "disabled", "dryrun"):
        if not environ.get("WANDB_API_KEY") and not _netrc_has(Path(environ.get("HOME", "~")).expanduser()):
            raise TrackerError(
                "--report-to wandb logs online and no wandb credentials are set: set WANDB_MODE=offline (the run is "
                "written locally; `wandb sync` uploads it later), or WANDB_API_KEY (or `wandb login`)"
            )
    missing = [TRACKERS[n][1] for n in names if importlib.util.find_spec(TRACKERS[n][0]) is None]
    if missing:
        raise TrackerError(
            f"--report-to needs {' '.join(missing)}: pip install -c constraints.txt {' '.join(missing)} "
            "(or the pip extra: pip install -e '.[trackers]')"
        )


def _netrc_has(home: Path, host: str = "api.wandb.ai") -> bool:
    import netrc

    try:
        return netrc.netrc(str(home / ".netrc")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def tracker_env(names: Sequence[str], logging_dir: Path, run_name: str, project: str) -> dict[str, str]:
    """The environment TRL's callbacks (and this module's writers) read: TensorBoard event files in
    ``logging_dir/run_name``, wandb's run directory under ``logging_dir/wandb``, trackio's database in
    ``logging_dir/trackio``. A WANDB_DIR or TRACKIO_DIR the user set is kept (one database across runs)."""
    env: dict[str, str] = {}
    if "tensorboard" in names:
        env["TENSORBOARD_LOGGING_DIR"] = str(logging_dir / run_name)
    if "wandb" in names:
        env["WANDB_DIR"] = os.environ.get("WANDB_DIR", str(logging_dir))
        env["WANDB_PROJECT"] = os.environ.get("WANDB_PROJECT", project)
    if "trackio" in names:
        env["TRACKIO_DIR"] = os.environ.get("TRACKIO_DIR", str(logging_dir / "trackio"))
    return env


# -- the writers ------------------------------------------------------------------------------------------------------


class TrackerWriter(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a live view (and a killed loop) sees every finished iteration

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, directory: Path, project: str, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(directory), config=dict(config), reinit="create_new")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioWriter:
    def __init__(self, project: str, name: str, config: Mapping[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=name, config=dict(config), embed=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def open_writers(
    names: Sequence[str], logging_dir: Path, run_name: str, project: str, config: Mapping[str, Any]
) -> list[TrackerWriter]:
    """One writer per tracker for the loop's own points (run ``run_name``), under :func:`tracker_env`'s places."""
    env = tracker_env(names, logging_dir, run_name, project)
    writers: list[TrackerWriter] = []
    for name in names:
        if name == "tensorboard":
            writers.append(TensorBoardWriter(Path(env["TENSORBOARD_LOGGING_DIR"])))
        elif name == "wandb":
            writers.append(WandbWriter(Path(env["WANDB_DIR"]), env["WANDB_PROJECT"], run_name, config))
        else:
            os.environ["TRACKIO_DIR"] = env["TRACKIO_DIR"]  # trackio reads it when first imported
            writers.append(TrackioWriter(project, run_name, config))
    return writers


# -- the loop's points ------------------------------------------------------------------------------------------------


@dataclass
class LoopPoint:
    step: int  # the iteration (synchronous loop) or the training step (--async); the last: the measuring rollout
    metrics: dict[str, float] = field(default_factory=dict)
    complete: bool = True  # every figure it will ever have is known (later phases add none)


def _put(metrics: dict[str, float], name: str, value: float | None) -> None:
    if value is not None and math.isfinite(value):
        metrics[name] = float(value)


def loop_points(state: Mapping[str, Any], iterations: int) -> list[LoopPoint]:
    """loop.json -> one point per iteration (synchronous) or per training step plus the measuring batch (async)."""
    if state.get("mode") == "async":
        return _async_points(state, iterations)
    evals = {e["iteration"]: e for e in state.get("evals", [])}
    points = []
    for r in state.get("iterations", []):
        i, m = r["iteration"], {}
        train = r.get("train") or {}
        _put(m, "loop/reward_mean", r["reward_mean"])
        _put(m, "loop/reward_se", r["reward_se"])
        m["loop/rewarded"] = float(r["rewarded"])
        m["loop/rollout_s"] = float(r["rollout_s"])
        _put(m, "loop/train_s", train.get("seconds"))
        _put(m, "loop/push_s", r.get("push_s"))
        e = evals.get(i)
        if e is not None:
            _put(m, "loop/heldout_pass@1", e["pass@1"])
            _put(m, "loop/heldout_pass@1_se", e["pass@1_se"])
            _put(m, "loop/eval_s", e["seconds"])
        # The synchronous loop does one thing at a time: each phase's share of the iteration's wall time.
        phases = {"rollout": m["loop/rollout_s"], "trainer": m.get("loop/train_s", 0.0)}
        total = sum(phases.values()) + m.get("loop/eval_s", 0.0) + m.get("loop/push_s", 0.0)
        if total > 0:
            for phase, seconds in phases.items():
                m[f"loop/{phase}_busy"] = seconds / total
        m["loop/staleness"] = 0.0  # each training takes the rollout of the policy it trains
        points.append(LoopPoint(i, m, complete=bool(train) or i >= iterations - 1))
    return points


def _async_points(state: Mapping[str, Any], iterations: int) -> list[LoopPoint]:
    batches = {b["index"]: b for b in state.get("batches", [])}
    pushes = {p["version"]: p for p in state.get("pushes", [])}
    points = []
    for s in state.get("steps", []):
        m: dict[str, float] = {}
        trained = [batches[b] for b in s["batches"] if b in batches]
        mean, se, n = pooled([(b["reward_mean"], b["reward_se"], b["rewarded"]) for b in trained])
        _put(m, "loop/reward_mean", mean)
        _put(m, "loop/reward_se", se)
        m["loop/rewarded"] = float(n)
        if trained:
            m["loop/staleness"] = float(max(s["version"] - b["version"] for b in trained))
        m["loop/groups_dropped"] = float(s["groups_dropped"])
        m["loop/train_s"] = float(s["ended_at"] - s["started_at"])
        m["loop/rollout_busy"] = float(s["rollout_util"])
        m["loop/trainer_busy"] = float(s["trainer_util"])
        push = pushes.get(s["version"] + 1) if s["status"] == "trained" else None
        if push is not None:
            m["loop/push_s"] = float(push["drain_s"])  # checkpoint made -> the engine serves it
            m["loop/reload_s"] = float(push["reload_s"])
        points.append(LoopPoint(s["step"], m, complete=s["status"] != "trained" or push is not None))
    final = [b for b in state.get("batches", []) if b.get("final")]
    if final and len(points) >= iterations - 1:
        m = {}
        _put(m, "loop/reward_mean", final[-1]["reward_mean"])
        _put(m, "loop/reward_se", final[-1]["reward_se"])
        m["loop/rewarded"] = float(final[-1]["rewarded"])
        points.append(LoopPoint(len(points), m))
    return points


def pooled(groups: Sequence[tuple[float | None, float | None, int]]) -> tuple[float | None, float | None, int]:
    """Means ± SEs of several batches (n rewards each) as one: the n-weighted mean and its SE."""
    parts = [(mu, se or 0.0, n) for mu, se, n in groups if mu is not None and n > 0]
    total = sum(n for _, _, n in parts)
    if not total:
        return None, None, 0
    mean = sum(mu * n for mu, _, n in parts) / total
    return mean, math.sqrt(sum((se * n) ** 2 for _, se, n in parts)) / total, total


class LoopTracker:
    """Logs each loop point once, in step order (wandb refuses a step lower than one it has), when it is complete;
    points already in loop.json when the command started were logged by the run that made them (a resume)."""

    def __init__(self, writers: Sequence[TrackerWriter], state: Mapping[str, Any], iterations: int) -> None:
        self.writers, self.iterations = list(writers), iterations
        self.next = sum(1 for _ in _complete_prefix(loop_points(state, iterations)))

    def update(self, state: Mapping[str, Any], final: bool = False) -> None:
        points = loop_points(state, self.iterations)
        for point in points[self.next :]:
            if not (point.complete or final):
                break
            for writer in self.writers:
                writer.log(point.metrics, point.step)
            self.next += 1

    def close(self, state: Mapping[str, Any]) -> None:
        try:
            self.update(state, final=True)
        finally:
            for writer in self.writers:
                writer.close()


def _complete_prefix(points: Sequence[LoopPoint]) -> Sequence[LoopPoint]:
    n = next((k for k, p in enumerate(points) if not p.complete), len(points))
    return points[:n]
