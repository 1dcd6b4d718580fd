"""Training curves from metrics.jsonl (reward, loss, clip fraction, importance ratio), and the loop's curves
from loop.json (train reward and held-out pass@k per iteration)."""

from __future__ import annotations

from pathlib import Path

import orjson

PANELS = (
    ("reward", ["reward"], "reward (session mean)"),
    ("loss", ["loss"], "loss"),
    ("clip fraction", ["clip_ratio/region_mean", "is_ratio/truncated_frac"], "fraction of trainable tokens"),
    ("importance ratio", ["is_ratio/mean", "is_ratio/min", "is_ratio/max"], "pi_theta / pi_behavior"),
)


def read_metrics(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, out_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_path) if "loss" in r or "reward" in r]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (title, keys, ylabel) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def loop_points(records: list[dict], evals: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """(iteration, mean, SE) series of a loop: the rollout's reward on the training tasks, and held-out pass@1
    and pass@k (the largest k) of the evaluated iterations (loop.json's ``iterations`` and ``evals``)."""
    series: dict[str, list[tuple[int, float, float]]] = {"train reward": []}
    for r in records:
        if r.get("reward_mean") is not None:
            series["train reward"].append((r["iteration"], r["reward_mean"], r.get("reward_se") or 0.0))
    for e in sorted(evals, key=lambda e: e["iteration"]):
        for name, value in e.get("overall", {}).items():
            if value.get("mean") is not None:
                series.setdefault(f"held-out {name}", []).append((e["iteration"], value["mean"], value["se"] or 0.0))
    ks = sorted((int(n.removeprefix("held-out pass@")) for n in series if n.startswith("held-out ")), reverse=True)
    # pass@1 and the widest pass@k; the ones between would crowd the panel.
    keep = {"train reward", *(f"held-out pass@{k}" for k in ks[:1] + [1])}
    return {n: v for n, v in series.items() if n in keep}


def plot_loop_curves(records: list[dict], evals: list[dict], out_path: Path) -> Path:
    """One panel over the loop's iterations (iteration i: the policy after i trainings): the train reward and the
    held-out pass@1 (and pass@k), each mean ± SE as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for name, points in loop_points(records, evals).items():
        if not points:
            continue
        xs, ys, ses = zip(*points, strict=True)
        style = "--" if name.startswith("held-out pass@") and name != "held-out pass@1" else "-"
        ax.errorbar(xs, ys, yerr=ses, linestyle=style, marker="o", markersize=4, capsize=3, label=name)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("polar loop")
    ax.set_xlabel("iteration (the policy its rollout sampled)")
    ax.set_ylabel("mean ± SE")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
