"""Figures of a run, as PNG files a paper could use: trajectories, explained variance, accuracy and rewards.

    from relex.plot import plot_trajectory, plot_variance, plot_accuracy, plot_rewards
    plot_trajectory(TrajectoryStore.open("RUN/trajectory"), FitResult.load("RUN/fit"), "traj.png")
    plot_variance(FitResult.load("RUN/fit"), "variance.png")
    plot_accuracy(["RUN/eval/summary.json"], "accuracy.png")
    plot_rewards("RUN", "rewards.png")

`trajectory`: the coefficient c₁(s) = Δ_sᵀ v₁ of chosen tensors against the real step, the fitted temporal line
extended past the observed steps, the fit window shaded, and recorded steps the fit did not see drawn as held-out
points. Their projections need the Gram over *all* recorded steps, c = G[all, fit] u / σ (docs/method.md: vⱼ =
Σᵢ u_{ij} Δᵢ / σⱼ), which is computed for the plotted tensors only.

`accuracy`: one point per evaluated checkpoint with its 95% interval; the x position is its step: `STORE@S` is
the real RLVR checkpoint at S, a folder written by `relex extrapolate` is placed at the `target_step` of its
`relex.json` and grouped by its `method`, anything else is the base model at step 0.

Every figure uses the Agg backend (no display needed) and is written at `DPI` dots per inch. Axes hold degenerate
data sensibly: a fraction (accuracy, explained variance, a verifier's reward) never gets an axis or a band below 0
or above 1, steps are whole numbers, one step or one constant value gets a readable range, and value ticks are few
enough not to run together.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relex.errors import RelexError
from relex.fit.gram import GRAM, resolve_device
from relex.fit.passes import GramCollector, PassBudget, plan_pass, run_pass
from relex.util import LOG_NAME, grouped, module_type, read_log

LOG = logging.getLogger(__name__)

DPI = 150
DEFAULT_MAX_TENSORS = 6
REAL, BASE = "RLVR (real)", "base"
# series style per method: (label, colour, marker)
SERIES_STYLE = {
    BASE: ("base", "black", "*"),
    REAL: ("RLVR (real)", "tab:blue", "o"),
    "relex": ("relex (rank-r, linear)", "tab:red", "D"),
    "two-point": ("two-point", "tab:green", "s"),
    "per-param": ("per-parameter LS", "tab:purple", "^"),
    "reconstruct": ("rank-r reconstruction", "tab:orange", "v"),
    "relex-anchored": ("relex, anchored at the last step", "tab:brown", "P"),
    "plain GRPO": ("plain GRPO (final)", "tab:blue", "o"),
    "accelerate": ("relex accelerate (final)", "tab:red", "X"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _step_axis(axis, steps) -> None:
    """Whole-number ticks for an axis of optimizer steps; a single step gets one step of room on either side."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    if len(steps) and np.min(steps) == np.max(steps):
        centre = float(np.min(steps))
        (axis.axes.set_xlim if axis is axis.axes.xaxis else axis.axes.set_ylim)(centre - 1, centre + 1)


def _value_axis(axis, values, low: float | None = 0.0, high: float | None = 1.0, min_span: float = 0.1) -> None:
    """Limits and a few ticks for values bounded by [low, high] (None: unbounded on that side).

    The range covers the finite values, is at least `min_span` wide (a constant gets room around it instead of
    matplotlib's ±0.04, which puts an accuracy of 0 on a negative axis), and stays inside the bounds but for a 2%
    margin that keeps a marker on the bound whole.
    """
    from matplotlib.ticker import MaxNLocator

    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    lo, hi = (float(values.min()), float(values.max())) if len(values) else (low or 0.0, high or 1.0)
    pad = max(min_span - (hi - lo), 0.0) / 2 + 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    if low is not None and lo < low:
        lo, hi = low, hi + (low - lo)
    if high is not None and hi > high:
        lo, hi = (lo - (hi - high) if low is None else max(low, lo - (hi - high))), high
    margin = 0.02 * (hi - lo)
    (axis.axes.set_xlim if axis is axis.axes.xaxis else axis.axes.set_ylim)(lo - margin, hi + margin)
    axis.set_major_locator(MaxNLocator(nbins=5))


def _few_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(nbins=5)


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, bbox_inches="tight")
    _pyplot().close(fig)
    LOG.info("wrote %s", out)
    return out


# ---- trajectory ---------------------------------------------------------------------------------------------------
def layer_index(name: str) -> int | None:
    """The first numeric part of a tensor name (`model.layers.7.mlp...` -> 7), None when there is none."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def representative_tensors(names: list[str], module_types: list[str] | None = None, limit: int = DEFAULT_MAX_TENSORS) -> list[str]:
    """One tensor per module type of the middle layer; with `module_types`, one per asked type (middle layer first)."""
    known = sorted({module_type(n) for n in names})
    unknown = [t for t in module_types or [] if t not in known]
    if unknown:
        raise RelexError(f"module type(s) {', '.join(unknown)} not in the fit; valid: {', '.join(known)}")
    layers = sorted({i for i in map(layer_index, names) if i is not None})
    middle = layers[len(layers) // 2] if layers else None
    chosen: dict[str, str] = {}
    for name in sorted(names, key=lambda n: (layer_index(n) != middle, n)):
        kind = module_type(name)
        wanted = kind in module_types if module_types is not None else layer_index(name) == middle
        if wanted and kind not in chosen:
            chosen[kind] = name
    return list(chosen.values())[:limit]


def check_tensor_names(asked: list[str], fitted: list[str]) -> list[str]:
    missing = [n for n in asked if n not in fitted]
    if missing:
        sample = ", ".join(sorted(fitted)[:6])
        raise RelexError(f"tensor(s) {', '.join(missing)} not in the fit ({len(fitted)} tensors, e.g. {sample})")
    return asked


@dataclass
class CoefficientSeries:
    """The rank-1 coefficient of one tensor at every recorded step, and which steps the fit saw."""

    name: str
    steps: np.ndarray  # all recorded steps
    coefficient: np.ndarray  # c₁(s) at each of them
    observed: np.ndarray  # bool: the fit saw this step
    in_window: np.ndarray  # bool: the temporal model saw this step
    explained_variance: float
    r2: float


def fit_step_indices(store_steps: list[int], fit_steps: np.ndarray) -> np.ndarray:
    position = {s: i for i, s in enumerate(store_steps)}
    missing = [int(s) for s in fit_steps if int(s) not in position]
    if missing:
        raise RelexError(f"the fit observed step(s) {missing[:5]} that the store does not hold; was it made from this store?")
    return np.array([position[int(s)] for s in fit_steps])


def coefficient_series(store, fit, names: list[str]) -> list[CoefficientSeries]:
    """c₁ at every recorded step: G[all, fit] u₁ / σ₁, from one Gram pass over all steps for the plotted tensors."""
    steps = store.steps
    fit_index = fit_step_indices(steps, fit.steps)
    live = []
    for name in names:
        if fit.tensors[name].is_zero:
            LOG.warning("tensor %s: its trajectory is all zero; nothing to plot", name)
        else:
            live.append(name)
    reader = store.reader(steps, direct=store.reads_direct(fit.config.io))
    grams = GramCollector()
    budget = PassBudget(chunk_elements=fit.config.chunk_elements)
    run_pass(reader, plan_pass(reader, live, grams=live, budget=budget, device=resolve_device(fit.config.device)), [grams], GRAM)
    return [_projection(name, gram, fit, steps, fit_index) for name, gram in grams.grams.items()]


def _projection(name: str, gram: np.ndarray, fit, steps: list[int], fit_index: np.ndarray) -> CoefficientSeries:
    """One tensor's series: its coefficient at every recorded step from its Gram over all of them."""
    tensor = fit.tensors[name]
    coefficient = gram[:, fit_index] @ tensor.u[:, 0] / tensor.sigma[0]
    observed = np.isin(np.arange(len(steps)), fit_index)
    in_window = np.isin(np.arange(len(steps)), fit_index[tensor.window])
    r2 = tensor.r2[0] if tensor.r2 else float("nan")
    return CoefficientSeries(name, np.asarray(steps), coefficient, observed, in_window, tensor.explained_variance(fit.config.rank), r2)


def _short(name: str) -> str:
    return name.removeprefix("model.").removesuffix(".weight")


def _draw_coefficients(ax, series: CoefficientSeries, fit, extend_to: float) -> None:
    tensor = fit.tensors[series.name]
    window_steps = series.steps[series.in_window]
    ax.axvspan(window_steps.min(), window_steps.max(), color="tab:blue", alpha=0.08, label="fit window")
    grid = np.linspace(0, extend_to, 200)
    ax.plot(grid, fit.model.predict(tensor.temporal[0], grid), color="tab:red", lw=1.5, label=f"fitted {fit.config.temporal} model")
    seen, window = series.observed, series.in_window
    ax.plot(series.steps[window], series.coefficient[window], "o", color="tab:blue", ms=4, label="observed (in window)")
    if np.any(seen & ~window):
        ax.plot(series.steps[seen & ~window], series.coefficient[seen & ~window], "o", color="tab:gray", ms=4, label="observed (outside window)")
    if np.any(~seen):
        ax.plot(series.steps[~seen], series.coefficient[~seen], "o", mfc="none", color="tab:orange", ms=5, label="held out (not fitted)")
    r2 = f"{series.r2:.3f}" if np.isfinite(series.r2) else "–"
    ax.set_title(f"{_short(series.name)}\nEV(r={fit.config.rank}) {series.explained_variance:.3f}, R² {r2}", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("c₁(s) = Δₛᵀ v₁")
    _step_axis(ax.xaxis, series.steps)
    ax.yaxis.set_major_locator(_few_ticks())
    ax.grid(alpha=0.3)


def plot_trajectory(
    store, fit, out: str | Path, *, tensors: list[str] | None = None, module_types: list[str] | None = None,
    max_tensors: int = DEFAULT_MAX_TENSORS, extend_to: float | None = None,
) -> Path:
    """The rank-1 coefficient against the step for a few tensors, with the fitted line and held-out steps."""
    fitted = [n for n, t in fit.tensors.items() if not t.is_zero]
    if not fitted:
        raise RelexError("every tensor of the fit has an all-zero trajectory; there is nothing to plot")
    names = check_tensor_names(tensors, list(fit.tensors)) if tensors else representative_tensors(fitted, module_types, max_tensors)
    series = coefficient_series(store, fit, names[:max_tensors])
    if not series:
        raise RelexError(f"tensor(s) {', '.join(names)}: all-zero trajectories; choose others with --tensors")
    last = float(max(store.steps[-1], fit.steps[-1]))
    extend_to = extend_to or last * 1.15
    plt = _pyplot()
    cols = min(3, len(series))
    rows = -(-len(series) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.0, 4.2 * cols), 3.4 * rows), squeeze=False)  # title, legend fit
    for ax, one in zip(axes.flat, series):
        _draw_coefficients(ax, one, fit, extend_to)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    handles, labels = _merged_legend(axes.flat)
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.suptitle(f"Rank-1 trajectory coefficient, fit on steps {fit.steps[0]}..{fit.steps[-1]} of {store.steps[0]}..{store.steps[-1]}")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, out)


def _merged_legend(axes) -> tuple[list, list[str]]:
    merged: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            merged.setdefault(label, handle)
    return list(merged.values()), list(merged)


# ---- explained variance -------------------------------------------------------------------------------------------
def _grouped(rows: list[dict], key: str) -> dict[str, list[float]]:
    return grouped((row["module_type"], row[key]) for row in rows if row["rank"] and np.isfinite(row[key]))


def _horizontal() -> dict:
    import matplotlib

    major, minor = (int(p) for p in matplotlib.__version__.split(".")[:2])
    return {"orientation": "horizontal"} if (major, minor) >= (3, 10) else {"vert": False}


def _box_strip(ax, groups: dict[str, list[float]], xlabel: str, low: float | None, high: float | None, empty: str) -> None:
    """One box and its points per group along x, within [low, high]; `empty` is written when no group has a value."""
    labels = list(groups)
    ax.boxplot([groups[k] for k in labels], widths=0.6, showfliers=False, **_horizontal())
    rng = np.random.default_rng(0)
    for i, label in enumerate(labels, start=1):
        values = np.asarray(groups[label])
        ax.plot(values, i + rng.uniform(-0.15, 0.15, len(values)), ".", color="tab:blue", alpha=0.6, ms=4)
    ax.set_yticks(range(1, len(labels) + 1), [_short(k) for k in labels], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    values = [v for k in labels for v in groups[k]]
    _value_axis(ax.xaxis, values, low, high, min_span=0.02)
    if not values:
        ax.set_xticks([])
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="gray")
    if not ax.yaxis_inverted():  # read top to bottom in name order (the axes share y: invert once)
        ax.invert_yaxis()


def plot_variance(fit, out: str | Path) -> Path:
    """Box and strip plots of the rank-r explained variance and of the temporal R² per module type."""
    rows = fit.rows()
    explained, r2 = _grouped(rows, "explained_variance"), _grouped(rows, "r2_direction1")
    if not explained:
        raise RelexError("every tensor of the fit has an all-zero trajectory; there is no variance to plot")
    plt = _pyplot()
    height = 1.5 + 0.32 * len(explained)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, height), sharey=True)
    _box_strip(left, explained, f"explained variance of rank {fit.config.rank}", 0.0, 1.0, "")
    _box_strip(
        right, {k: r2.get(k, []) for k in explained}, f"R² of the {fit.config.temporal} model (direction 1)", None, 1.0,
        "no R²: too few observed steps",
    )
    left.set_ylabel("module type")
    fig.suptitle(f"Per-tensor fit over {_plural(len(fit.steps), 'observed step')} ({_plural(len(rows), 'tensor')})")
    fig.tight_layout()
    return _save(fig, out)


# ---- accuracy -----------------------------------------------------------------------------------------------------
@dataclass
class AccuracyPoint:
    checkpoint: str
    series: str
    step: int
    accuracy: float
    ci_low: float
    ci_high: float
    n: int
    observed_until: int | None = None  # last step a relex fit saw, when known


def checkpoint_position(label: str, search: list[Path]) -> tuple[str, int, int | None]:
    """(series, step, last observed step) of an evaluated checkpoint, from `STORE@S` or its `relex.json`."""
    folder, at, step = label.rpartition("@")
    if at and step.isdigit():
        return REAL, int(step), None
    for root in search:
        provenance = root / label / "relex.json"
        if provenance.is_file():
            info = json.loads(provenance.read_text())
            series = REAL if info.get("method") == "observed" else info.get("method", "relex")
            observed = info.get("window_steps") or info.get("observed_steps") or [None]
            return series, int(info["target_step"]), observed[-1]
    return BASE, 0, None


def read_accuracy_points(summary_paths: list[str | Path]) -> list[AccuracyPoint]:
    points = []
    for path in map(Path, summary_paths):
        if not path.is_file():
            raise RelexError(f"{path}: no such evaluation summary (relex eval writes OUT/summary.json)")
        summary = json.loads(path.read_text())
        if "checkpoints" not in summary:
            raise RelexError(f"{path}: not a relex eval summary (no `checkpoints` list)")
        search = [Path.cwd(), *path.resolve().parents]  # labels are paths as given to relex eval
        for entry in summary["checkpoints"]:
            series, step, until = checkpoint_position(entry["checkpoint"], search)
            points.append(AccuracyPoint(entry["checkpoint"], series, step, entry["accuracy"], entry["ci_low"], entry["ci_high"], entry["n"], until))
    return points


def _draw_series(ax, series: str, points: list[AccuracyPoint], dodge: float = 0.0) -> None:
    label, colour, marker = SERIES_STYLE.get(series, (series, None, "o"))
    points = sorted(points, key=lambda p: p.step)
    x = np.array([p.step for p in points]) + dodge
    y = np.array([p.accuracy for p in points])
    err = np.array([[p.accuracy - p.ci_low for p in points], [p.ci_high - p.accuracy for p in points]])
    line = "-" if series == REAL else "--" if series != BASE else "none"
    ax.errorbar(x, y, yerr=np.maximum(err, 0), fmt=marker, linestyle=line, color=colour, capsize=3, ms=7 if series == BASE else 5, label=label, clip_on=False)


def plot_accuracy(summary_paths: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Accuracy against step per series (base, real RLVR, each extrapolation method), with 95% intervals."""
    points = read_accuracy_points(summary_paths)
    if not points:
        raise RelexError(f"{', '.join(map(str, summary_paths))}: no evaluated checkpoint")
    groups: dict[str, list[AccuracyPoint]] = {}
    for p in points:
        groups.setdefault(p.series, []).append(p)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    order = sorted(groups, key=lambda s: (s != BASE, s != REAL, s))
    shift = 0.008 * max(p.step for p in points)  # side by side, so intervals at the same step stay readable
    for index, series in enumerate(order):
        _draw_series(ax, series, groups[series], dodge=(index - (len(order) - 1) / 2) * shift)
    _step_axis(ax.xaxis, [p.step for p in points])
    _value_axis(ax.yaxis, [v for p in points for v in (p.accuracy, p.ci_low, p.ci_high)])  # 0 ≤ accuracy ≤ 1
    until = max((p.observed_until for p in points if p.observed_until is not None), default=None)
    if until is not None:
        ax.axvline(until, color="gray", ls=":", lw=1)
        ax.annotate("last step the fit saw", (until, ax.get_ylim()[1]), fontsize=7, color="gray", ha="left", va="top", rotation=90)
    n = sorted({p.n for p in points})
    ax.set_xlabel("optimizer step (target step for extrapolated checkpoints)")
    ax.set_ylabel(f"accuracy (greedy pass@1, n={'/'.join(map(str, n))})")
    ax.set_title(title or "Held-out accuracy with 95% bootstrap intervals")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out)


# ---- rewards ------------------------------------------------------------------------------------------------------
def reward_records(run_dir: str | Path) -> list[dict]:
    """The lines of `RUN/log.jsonl` (or the file itself) that have a step and a reward, in step order."""
    path = Path(run_dir)
    path = path / LOG_NAME if path.is_dir() else path
    if not path.is_file():
        raise RelexError(f"{path}: no training log (relex train writes RUN/{LOG_NAME})")
    return sorted((r for r in read_log(path) if "step" in r and "reward" in r), key=lambda r: r["step"])


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - window, 0)
    return (sums[index] - sums[start]) / (index - start)


def plot_rewards(run_dir: str | Path, out: str | Path, window: int | None = None) -> Path:
    """Mean training reward per step, ± its standard deviation over the group, and a moving average."""
    records = reward_records(run_dir)
    if not records:
        raise RelexError(f"{run_dir}: the training log has no record with `step` and `reward`")
    steps = np.array([r["step"] for r in records], dtype=float)
    reward = np.array([r["reward"] for r in records], dtype=float)
    std = np.array([r.get("reward_std", np.nan) for r in records], dtype=float)
    window = window or max(1, len(records) // 10)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    score = bool(reward.min() >= 0 and reward.max() <= 1)  # a verifier's score: the band stays inside [0, 1]
    low, high = reward - np.nan_to_num(std), reward + np.nan_to_num(std)
    if score:
        low, high = np.clip(low, 0, 1), np.clip(high, 0, 1)
    if np.isfinite(std).any():
        band = "± reward std" + (" (within [0, 1])" if score else "")
        if len(steps) > 1:
            ax.fill_between(steps, low, high, color="tab:blue", alpha=0.15, label=band)
        else:  # a band needs two steps; one step gets an error bar
            ax.errorbar(steps, reward, yerr=[reward - low, high - reward], fmt="none", color="tab:blue", alpha=0.4, capsize=4, label=band)
    ax.plot(steps, reward, ".-", color="tab:blue", lw=0.8, ms=3 if len(steps) > 1 else 6, label="mean reward", clip_on=False)
    if window > 1:
        ax.plot(steps, moving_average(reward, window), color="tab:red", lw=2, label=f"moving average ({window} steps)")
    _step_axis(ax.xaxis, steps)
    if score:
        _value_axis(ax.yaxis, np.concatenate([low, high, reward]))
    else:
        ax.yaxis.set_major_locator(_few_ticks())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (verifier score)")
    ax.set_title(f"Training reward, {_plural(len(records), 'step')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out)
