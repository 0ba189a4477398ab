"""Every figure on degenerate data (all zeros, one point, one step, nearly equal values) reads at a glance.

Each plot is drawn as `relex plot` and `relex report` draw it, and the figure is inspected before it is closed:
no accuracy or reward axis (or ±std band) below 0 or above 1, whole-number step ticks, tick labels that do not
run into each other, and a note where a panel has nothing to show.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from relex import plot
from relex.errors import RelexError
from relex.synthetic import write_planted_run
from tests.conftest import cli

KINDS = ["input_layernorm.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight"]


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures the plot functions save (inspectable after they are closed)."""
    drawn = []
    save = plot._save

    def keep(fig, out):
        fig.canvas.draw()  # lay out the tick labels as the PNG has them
        fig.test_renderer = fig.canvas.get_renderer()  # closing the figure detaches its canvas
        drawn.append(fig)
        return save(fig, out)

    monkeypatch.setattr(plot, "_save", keep)
    return drawn


def write_log(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_summary(folder: Path, entries: list[tuple[str, float, float, float]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [dict(checkpoint=c, accuracy=a, ci_low=lo, ci_high=hi, n=16) for c, a, lo, hi in entries]
    (folder / "summary.json").write_text(json.dumps({"checkpoints": rows}))
    return folder / "summary.json"


def stand_in_fit(rows: list[dict], steps: int = 10):
    return types.SimpleNamespace(rows=lambda: rows, config=types.SimpleNamespace(rank=1, temporal="linear"), steps=np.arange(steps))


def tick_labels_apart(axis) -> bool:
    """The visible tick labels of `axis` do not overlap (and are not so many that they run together)."""
    renderer = axis.figure.test_renderer
    low, high = sorted(axis.get_view_interval())
    shown = [t for loc, t in zip(axis.get_majorticklocs(), axis.get_ticklabels()) if low <= loc <= high and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in shown]
    boxes.sort(key=lambda b: b.x0)
    return all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])) and len(boxes) <= 7


def visible_ticks(axis) -> list[float]:
    low, high = sorted(axis.get_view_interval())
    return [t for t in axis.get_majorticklocs() if low <= t <= high]


def test_accuracy_all_zero_has_no_negative_axis(tmp_path, figures):
    summary = write_summary(tmp_path / "eval", [("base", 0, 0, 0), ("store@10", 0, 0, 0), ("store@20", 0, 0, 0)])
    plot.plot_accuracy([summary], tmp_path / "accuracy.png")
    (ax,) = figures[-1].axes
    assert (tmp_path / "accuracy.png").is_file()
    assert ax.get_ylim()[0] > -0.01 and min(visible_ticks(ax.yaxis)) >= 0 and ax.get_ylim()[1] >= 0.05
    assert all(float(t).is_integer() for t in visible_ticks(ax.xaxis))


def test_accuracy_one_point(tmp_path, figures):
    plot.plot_accuracy([write_summary(tmp_path / "eval", [("base", 0.5, 0.3, 0.7)])], tmp_path / "accuracy.png")
    (ax,) = figures[-1].axes
    low, high = ax.get_xlim()
    assert high - low >= 2 and all(float(t).is_integer() for t in visible_ticks(ax.xaxis))
    assert 0 <= ax.get_ylim()[0] + 0.03 and ax.get_ylim()[1] <= 1.03


def test_reward_band_stays_within_zero_and_one(tmp_path, figures):
    records = [{"step": s, "reward": min(1.0, 0.1 + s / 40), "reward_std": 0.35} for s in range(1, 61)]
    plot.plot_rewards(write_log(tmp_path / "log.jsonl", records), tmp_path / "rewards.png")
    (ax,) = figures[-1].axes
    (band,) = ax.collections
    ys = np.concatenate([path.vertices[:, 1] for path in band.get_paths()])
    assert ys.min() >= 0 and ys.max() <= 1
    low, high = ax.get_ylim()
    assert low > -0.03 and high < 1.03


@pytest.mark.parametrize("records", [
    [{"step": s, "reward": 0.0, "reward_std": 0.0} for s in range(1, 31)],  # all zero
    [{"step": 7, "reward": 0.25, "reward_std": 0.4}],  # one step
    [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.5}],  # no std, constant
])
def test_rewards_degenerate(tmp_path, figures, records):
    plot.plot_rewards(write_log(tmp_path / "log.jsonl", records), tmp_path / "rewards.png")
    (ax,) = figures[-1].axes
    assert (tmp_path / "rewards.png").is_file()
    assert ax.get_ylim()[0] > -0.03 and min(visible_ticks(ax.yaxis)) >= 0
    assert all(float(t).is_integer() for t in visible_ticks(ax.xaxis)) and np.ptp(ax.get_xlim()) >= 1
    assert tick_labels_apart(ax.xaxis)


def test_variance_close_values_have_readable_ticks(tmp_path, figures):
    # R² within 0.002 of each other: matplotlib alone labels every 0.00025 and the labels run together
    rows = [dict(module_type=k, rank=1, explained_variance=0.95 + 0.001 * i, r2_direction1=0.9575 + 0.002 * i / 29)
            for i in range(30) for k in KINDS]
    plot.plot_variance(stand_in_fit(rows), tmp_path / "variance.png")
    left, right = figures[-1].axes
    assert tick_labels_apart(left.xaxis) and tick_labels_apart(right.xaxis)
    assert left.get_xlim()[1] <= 1.01  # explained variance never above 1


@pytest.mark.parametrize("rows, steps", [
    ([dict(module_type=k, rank=1, explained_variance=0.0, r2_direction1=0.0) for k in KINDS], 10),  # all zero
    ([dict(module_type="mlp.up_proj.weight", rank=1, explained_variance=1.0, r2_direction1=float("nan"))], 1),  # one
])
def test_variance_degenerate(tmp_path, figures, rows, steps):
    plot.plot_variance(stand_in_fit(rows, steps), tmp_path / "variance.png")
    left, right = figures[-1].axes
    assert -0.01 < left.get_xlim()[0] and left.get_xlim()[1] <= 1.01
    assert tick_labels_apart(left.xaxis) and tick_labels_apart(right.xaxis)
    if steps == 1:
        assert "no R²" in " ".join(t.get_text() for t in right.texts)
        assert figures[-1]._suptitle.get_text() == "Per-tensor fit over 1 observed step (1 tensor)"


def test_trajectory_on_two_steps_and_all_zero(tmp_path, tiny_base, figures):
    write_planted_run(tiny_base, tmp_path / "run", [10, 20], noise=0.0)
    assert cli("ingest", tmp_path / "run", "--base", tiny_base, "--out", tmp_path / "store") == 0
    assert cli("fit", tmp_path / "store", "--out", tmp_path / "fit") == 0
    assert cli("plot", "trajectory", tmp_path / "store", "--fit", tmp_path / "fit", "--max", "1", "--out", tmp_path / "one.png") == 0
    (ax,) = [a for a in figures[-1].axes if a.get_visible()]
    assert all(float(t).is_integer() for t in visible_ticks(ax.xaxis)) and tick_labels_apart(ax.yaxis.axes.xaxis)
    assert len(ax.yaxis.get_ticklabels()) <= 7

    from relex.fit import FitResult
    from relex.store import TrajectoryStore

    write_planted_run(tiny_base, tmp_path / "still", [10, 20], noise=0.0, slope=0.0, intercept=0.0)
    assert cli("ingest", tmp_path / "still", "--base", tiny_base, "--out", tmp_path / "zero") == 0
    assert cli("fit", tmp_path / "zero", "--out", tmp_path / "zero-fit") == 0
    fit = FitResult.load(tmp_path / "zero-fit")
    with pytest.raises(RelexError, match="all-zero trajectory; there is nothing to plot"):  # `relex report` says so in place
        plot.plot_trajectory(TrajectoryStore.open(tmp_path / "zero"), fit, tmp_path / "zero.png")
    with pytest.raises(RelexError, match="no variance to plot"):
        plot.plot_variance(fit, tmp_path / "zero-variance.png")
