"""Training curves from metrics.jsonl: reward, loss, clip fraction, importance ratio."""

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
