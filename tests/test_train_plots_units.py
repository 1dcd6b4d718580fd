"""The training and loop curves (train/plots.py): which records become which series, and the figures drawn from
them (panels, axes, markers, error bars, the saved image's size), read back from the matplotlib figure itself."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import orjson
import pytest
from matplotlib.container import ErrorbarContainer

from polar_cli.train import plots

# A panel of one series draws no legend entries: matplotlib's note about it is expected.
pytestmark = pytest.mark.filterwarnings("ignore:No artists with labels found")


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the plot functions close, kept open for inspection (and closed after the test)."""
    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    monkeypatch.undo()
    for fig in kept:
        plt.close(fig)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def write_metrics(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in records) + b"\n\n   \n")
    return path


# -- read_metrics and the loop's series -------------------------------------------------------------------------------


def test_read_metrics_takes_every_json_line_and_skips_blank_ones(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n\n  \n{"step": 2, "reward": 1.0}\n')
    assert plots.read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "reward": 1.0}]


def test_loop_points_keep_pass_at_1_and_the_widest_k_in_iteration_order() -> None:
    records = [
        {"iteration": 0, "reward_mean": 0.25, "reward_se": 0.1},
        {"iteration": 1, "reward_mean": 0.5, "reward_se": None},  # one rewarded session: no SE, drawn as 0
        {"iteration": 2, "reward_mean": None},  # nothing rewarded: no point
    ]
    evals = [
        {"iteration": 3, "overall": {"pass@1": {"mean": 0.4, "se": 0.05}, "pass@2": {"mean": 0.5, "se": 0.1},
                                     "pass@4": {"mean": 0.6, "se": None}}},
        {"iteration": 1, "overall": {"pass@1": {"mean": 0.2, "se": 0.02}, "pass@2": {"mean": 0.3, "se": 0.03},
                                     "pass@4": {"mean": None, "se": None}}},
        {"iteration": 2},  # an eval entry without figures (its rollout failed whole)
    ]  # fmt: skip
    assert plots.loop_points(records, evals) == {
        "train reward": [(0, 0.25, 0.1), (1, 0.5, 0.0)],
        "held-out pass@1": [(1, 0.2, 0.02), (3, 0.4, 0.05)],
        "held-out pass@4": [(3, 0.6, 0.0)],
    }


def test_loop_points_with_pass_at_1_only_and_no_evals() -> None:
    evals = [{"iteration": 0, "overall": {"pass@1": {"mean": 1.0, "se": 0.0}}}]
    assert plots.loop_points([], evals) == {"train reward": [], "held-out pass@1": [(0, 1.0, 0.0)]}
    assert plots.loop_points([{"iteration": 0, "reward_mean": 0.0}], []) == {"train reward": [(0, 0.0, 0.0)]}


# -- the training curves ---------------------------------------------------------------------------------------------


def test_plot_curves_draws_four_panels_of_the_training_records(tmp_path: Path, figures: list[Any]) -> None:
    metrics = write_metrics(
        tmp_path / "metrics.jsonl",
        [
            {"step": 1, "loss": 0.5, "reward": 0.25, "clip_ratio/region_mean": 0.1, "is_ratio/mean": 1.0,
             "is_ratio/min": 0.9, "is_ratio/max": 1.2},
            {"step": 2, "loss": 0.4, "reward": None, "is_ratio/truncated_frac": 0.05},
            {"step": 3, "is_ratio/mean": 7.0},  # no loss and no reward: not a training step's record
            {"step": 4, "reward": 0.75, "loss": 0.3, "clip_ratio/region_mean": 0.2},
            {"step": 5, "reward": 1.0},  # a reward without a loss is still a training record
        ],
    )  # fmt: skip
    out = tmp_path / "curves.png"
    assert plots.plot_curves(metrics, out) == out
    assert png_size(out) == (1000, 700)  # 10 x 7 inches at 100 dpi
    (fig,) = figures
    # Constrained layout: the panels' titles and tick labels do not overlap their neighbours.
    assert type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["reward", "loss", "clip fraction", "importance ratio"]
    assert [ax.get_xlabel() for ax in axes] == ["step"] * 4
    assert [ax.get_ylabel() for ax in axes] == [
        "reward (session mean)", "loss", "fraction of trainable tokens", "pi_theta / pi_behavior"
    ]  # fmt: skip

    def lines(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
        return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}

    assert lines(axes[0]) == {"reward": ([1, 4, 5], [0.25, 0.75, 1.0])}
    assert lines(axes[1]) == {"loss": ([1, 2, 4], [0.5, 0.4, 0.3])}
    assert lines(axes[2]) == {"clip_ratio/region_mean": ([1, 4], [0.1, 0.2]), "is_ratio/truncated_frac": ([2], [0.05])}
    assert lines(axes[3]) == {"is_ratio/mean": ([1], [1.0]), "is_ratio/min": ([1], [0.9]), "is_ratio/max": ([1], [1.2])}
    line = axes[1].get_lines()[0]
    assert line.get_marker() == "o" and line.get_markersize() == 3
    # A legend only where a panel has several series.
    assert axes[0].get_legend() is None and axes[1].get_legend() is None
    assert [t.get_text() for t in axes[2].get_legend().get_texts()] == [
        "clip_ratio/region_mean", "is_ratio/truncated_frac"
    ]  # fmt: skip
    legend = axes[3].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["is_ratio/mean", "is_ratio/min", "is_ratio/max"]
    assert legend.get_texts()[0].get_fontsize() == 8
    grid = axes[0].xaxis.get_gridlines()[0]
    assert grid.get_visible() and grid.get_alpha() == 0.3


@pytest.mark.parametrize(("steps", "marker"), [(29, "o"), (30, "None")])
def test_plot_curves_marks_points_only_while_there_are_few(
    steps: int, marker: str, tmp_path: Path, figures: list[Any]
) -> None:
    metrics = write_metrics(tmp_path / "m.jsonl", [{"step": s, "loss": 1.0 / (s + 1)} for s in range(steps)])
    plots.plot_curves(metrics, tmp_path / "c.png")
    (line,) = figures[0].axes[1].get_lines()
    assert len(line.get_xdata()) == steps and line.get_marker() == marker


# -- the loop's curves -----------------------------------------------------------------------------------------------


def test_plot_loop_curves_draws_each_series_with_its_error_bars(tmp_path: Path, figures: list[Any]) -> None:
    records = [{"iteration": 0, "reward_mean": 0.25, "reward_se": 0.1}, {"iteration": 1, "reward_mean": 0.5}]
    evals = [{"iteration": 1, "overall": {"pass@1": {"mean": 0.2, "se": 0.05}, "pass@8": {"mean": 0.6, "se": 0.1}}}]
    out = tmp_path / "loop.png"
    assert plots.plot_loop_curves(records, evals, out) == out
    assert png_size(out) == (700, 450)
    (fig,) = figures
    assert type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"
    (ax,) = fig.axes
    assert ax.get_title() == "polar loop"
    assert ax.get_xlabel() == "iteration (the policy its rollout sampled)" and ax.get_ylabel() == "mean ± SE"
    bars = {c.get_label(): c for c in ax.containers if isinstance(c, ErrorbarContainer)}
    assert list(bars) == ["train reward", "held-out pass@1", "held-out pass@8"]
    styles = {name: c.lines[0].get_linestyle() for name, c in bars.items()}
    assert styles == {"train reward": "-", "held-out pass@1": "-", "held-out pass@8": "--"}
    train = bars["train reward"]
    assert list(train.lines[0].get_xdata()) == [0, 1] and list(train.lines[0].get_ydata()) == [0.25, 0.5]
    assert train.lines[0].get_marker() == "o" and train.lines[0].get_markersize() == 4
    # Each bar spans mean ± SE; a missing SE draws a bar of length 0.
    (segments,) = [col.get_segments() for col in train.lines[2]]
    assert [(s[0][1], s[1][1]) for s in segments] == [pytest.approx((0.15, 0.35)), (0.5, 0.5)]
    caps = train.lines[1]
    assert caps and caps[0].get_markersize() == 6  # capsize 3: a cap 2 x 3 points wide
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(bars)
    assert ax.get_legend().get_texts()[0].get_fontsize() == 8
    assert all(float(t).is_integer() for t in ax.xaxis.get_major_locator().tick_values(0, 1))
    grid = ax.xaxis.get_gridlines()[0]
    assert grid.get_visible() and grid.get_alpha() == 0.3


def test_plot_loop_curves_skips_an_empty_series(tmp_path: Path, figures: list[Any]) -> None:
    evals = [{"iteration": 0, "overall": {"pass@1": {"mean": 0.5, "se": 0.1}}}]
    plots.plot_loop_curves([], evals, tmp_path / "loop.png")
    (ax,) = figures[0].axes
    assert [c.get_label() for c in ax.containers] == ["held-out pass@1"]
