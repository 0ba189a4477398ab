"""The accelerate study of analysis/README.md ("Making extrapolation pay"): plain GRPO against relex accelerate.

    .venv/bin/relex train --config analysis/configs/accelerate-plain.yaml             # runs/accel/plain (24 steps)
    .venv/bin/relex accelerate --config analysis/configs/accelerate-jump.yaml         # runs/accel/jump-keep (12)
    .venv/bin/relex accelerate --config analysis/configs/accelerate-jump-reset.yaml   # runs/accel/jump-reset (12)
    .venv/bin/python analysis/accelerate_study.py [--n 300]                           # this: noise, one-shot, eval

Stages (the runs above first; each stage uses whatever steps the runs have recorded so far):
  1. noise      from the plain run's Gram matrices: cosine of consecutive single-step updates, of consecutive
                4-step segments, and the path efficiency ‖Δ_T‖ / Σ‖Δ_k − Δ_(k-1)‖         -> results/accelerate-noise.json
  2. one-shot   from the plain run's first 8 steps, within the measured horizon (12 = 1.5×, 16 = 2×): relex,
                relex-anchored, relex with λ = 0.5, relex keeping the norm layers, two-point, θ₀ + α·Δ₁ (two-point
                anchored at step 1), and logits extrapolation of steps 4 → 8                   -> runs/accel/oneshot/
  3. evaluate   every checkpoint on the same held-out problems (greedy), paired            -> runs/accel/eval/
  4. tables     accuracy against GRPO steps and rollouts, steps and wall time to reach the plain run's final
                accuracy, paired intervals at equal budgets            -> results/accelerate.json, figures/accelerate.png

Numbers come only from the files the commands write; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "accel"
RESULTS = ROOT / "analysis" / "results"
FIGURES = ROOT / "analysis" / "figures"
OBSERVE_UNTIL = 8
ONE_SHOT_TARGETS = [12, 16]


# ---- 1. noise -------------------------------------------------------------------------------------------------------
def noise(store_dir: Path, segment: int = 4) -> dict:
    """Single-step and segment update geometry of a run recorded at every step, from the summed Gram matrices."""
    from relex.fit import FitConfig, fit_store
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    steps = store.steps
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"{store_dir}: noise needs every step recorded from 1; it has {steps}")
    fit = fit_store(store, FitConfig(device="cpu"))
    gram = sum(fit.grams.values())  # Gram of the whole model's deltas (T × T)
    t = len(steps)
    lift = np.zeros((t + 1, t))  # Δ_0 = 0 prepended
    lift[1:] = np.eye(t)
    full = lift @ gram @ lift.T

    def cosines(points: list[int]) -> list[float]:
        moves = np.zeros((len(points) - 1, t + 1))
        for i, (a, b) in enumerate(zip(points[:-1], points[1:])):
            moves[i, b], moves[i, a] = 1.0, -1.0
        g = moves @ full @ moves.T
        return [float(g[i, i + 1] / np.sqrt(g[i, i] * g[i + 1, i + 1])) for i in range(len(points) - 2)]

    single = cosines(list(range(t + 1)))
    segments = cosines(list(range(0, t + 1, segment)))
    update_norms = [float(np.sqrt(full[k, k] - 2 * full[k, k - 1] + full[k - 1, k - 1])) for k in range(1, t + 1)]
    return {
        "steps": steps,
        "consecutive_update_cosine": single,
        "consecutive_update_cosine_median": float(np.median(single)),
        f"consecutive_{segment}_step_segment_cosine": segments,
        "path_efficiency": float(np.sqrt(full[t, t]) / sum(update_norms)),
        "rank1_explained_variance_median": float(np.median([f.explained_variance(1) for f in fit.tensors.values()])),
    }


# ---- 2. one-shot baselines --------------------------------------------------------------------------------------------
def one_shot(store_dir: Path, out: Path) -> dict[str, str]:
    """label -> checkpoint (a folder, or a logits(...) spec) for every one-shot baseline."""
    from relex.extrapolate import ExtrapolateConfig, extrapolate_store
    from relex.fit import FitConfig, fit_store
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    fit_config = FitConfig(observe_until=OBSERVE_UNTIL, device="cpu")
    fit = fit_store(store, fit_config)
    variants = [  # (label, folder, extrapolate options)
        ("relex", "relex", dict(method="relex")),
        ("relex-anchored", "relex-anchored", dict(method="relex-anchored")),
        ("relex λ=0.5", "relex-scale0.5", dict(method="relex", scale=0.5)),
        ("relex, norms kept", "relex-keep-norms", dict(method="relex", keep=("*norm.weight",))),
        ("two-point", "two-point", dict(method="two-point")),
        ("θ₀ + α·Δ₁", "first-update", dict(method="two-point", anchors=(0, 1))),
    ]
    checkpoints = {}
    for label, name, options in variants:
        folder = out / name
        if not all((folder / f"step-{t}" / "config.json").is_file() for t in ONE_SHOT_TARGETS):
            config = ExtrapolateConfig(targets=ONE_SHOT_TARGETS, fit=fit_config, overwrite=True, **options)
            extrapolate_store(store, folder, config, fit if options["method"].startswith("relex") else None)
        for target in ONE_SHOT_TARGETS:
            checkpoints[f"{label} → {target}"] = str(folder / f"step-{target}")
    a, b = OBSERVE_UNTIL // 2, OBSERVE_UNTIL
    for target in ONE_SHOT_TARGETS:
        alpha = (target - a) / (b - a)
        checkpoints[f"logits {a}→{b} → {target}"] = f"logits({store_dir}@{a},{store_dir}@{b},{alpha:g})"
    return checkpoints


# ---- 3. the runs' checkpoints -------------------------------------------------------------------------------------------
def plain_points(store_dir: Path, every: int = 4) -> dict[int, str]:
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    points = {0: str(store.base_dir)}
    points.update({s: f"{store_dir}@{s}" for s in store.steps if s % every == 0})
    return points


def accelerated_points(run: Path) -> dict[int, str]:
    """GRPO step -> the weights the run continued from after its decision there (a segment's base), and the final."""
    from relex.store import TrajectoryStore

    points = {}
    for folder in sorted((run / "segments").glob("[0-9][0-9][0-9]")):
        created = TrajectoryStore.open(folder).manifest["created_by"]
        if created["segment_start_step"] > 0:
            points[created["segment_start_step"]] = str(TrajectoryStore.open(folder).base_dir)
    if (run / "final" / "config.json").is_file():
        summary = json.loads((run / "accelerate-summary.json").read_text())
        points[summary["grpo_steps"]] = str(run / "final")
    return points


def wall_seconds(run: Path) -> dict[int, float]:
    """GRPO step -> wall seconds spent up to it (GRPO steps, and every decision made at or before it)."""
    lines = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    decisions = {}
    if (run / "jumps.jsonl").is_file():
        for line in (run / "jumps.jsonl").read_text().splitlines():
            j = json.loads(line)
            decisions[j["step"]] = sum(j["seconds"].values())
    total, out = 0.0, {0: 0.0}
    for line in lines:
        total += line["step_seconds"] + decisions.get(line["step"], 0.0)
        out[line["step"]] = total
    return out


# ---- 4. tables ------------------------------------------------------------------------------------------------------------
def paired(a, b) -> dict:
    from relex.evaluate.metrics import paired_bootstrap_diff

    diff, low, high = paired_bootstrap_diff(a.greedy_correct(), b.greedy_correct())
    return {"diff": diff, "ci_low": low, "ci_high": high}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="held-out problems per checkpoint")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--skip-noise", action="store_true")
    args = parser.parse_args()
    from relex.evaluate import evaluate
    from relex.train import load_config

    RESULTS.mkdir(parents=True, exist_ok=True)
    plain_store = RUNS / "plain" / "trajectory"
    if not args.skip_noise:
        measured = noise(plain_store)
        (RESULTS / "accelerate-noise.json").write_text(json.dumps(measured, indent=1) + "\n")
        print("noise:", {k: v for k, v in measured.items() if not isinstance(v, list)})
    runs = {"plain": plain_points(plain_store)}
    for run in sorted(p for p in RUNS.glob("jump-*") if (p / "jumps.jsonl").is_file()):
        runs[run.name] = accelerated_points(run)
    baselines = one_shot(plain_store, RUNS / "oneshot")
    labels: dict[str, str] = {}
    plain_final = max(runs["plain"])
    labels[f"plain@{plain_final}"] = runs["plain"][plain_final]
    for name, points in runs.items():
        for step, checkpoint in sorted(points.items()):
            labels.setdefault(f"{name}@{step}", checkpoint)
    labels.update(baselines)
    task = load_config(ROOT / "analysis" / "configs" / "accelerate-plain.yaml").task
    result = evaluate(list(labels.values()), task, n=args.n, max_new_tokens=24, batch_size=args.batch_size,
                      out_dir=RUNS / "eval", overwrite=True)
    by_label = dict(zip(labels, result.checkpoints))
    final = by_label[f"plain@{plain_final}"]
    table = {label: {"accuracy": r.accuracy, "ci_low": r.ci_low, "ci_high": r.ci_high, "vs_plain_final": paired(r, final)}
             for label, r in by_label.items()}
    curves = {}
    for name, points in runs.items():
        walls = wall_seconds(RUNS / name) if (RUNS / name / "log.jsonl").is_file() else {}
        curves[name] = [{"grpo_step": s, "rollouts": s * 64, "accuracy": by_label[f"{name}@{s}"].accuracy,
                         "wall_seconds": walls.get(s)} for s in sorted(points)]
    reach = {}
    for name, curve in curves.items():
        hit = next((p for p in curve if p["accuracy"] >= final.accuracy), None)
        plain_wall = wall_seconds(RUNS / "plain").get(plain_final)
        reach[name] = None if hit is None else {
            "grpo_steps": hit["grpo_step"], "step_ratio": plain_final / hit["grpo_step"] if hit["grpo_step"] else None,
            "wall_seconds": hit["wall_seconds"], "wall_ratio": (hit["wall_seconds"] / plain_wall) if hit["wall_seconds"] and plain_wall else None,
            "vs_plain_final": table[f"{name}@{hit['grpo_step']}"]["vs_plain_final"],
        }
    equal_budget = {}
    for name, points in runs.items():
        for step in points:
            if name != "plain" and step in runs["plain"]:
                equal_budget[f"{name}@{step} − plain@{step}"] = paired(by_label[f"{name}@{step}"], by_label[f"plain@{step}"])
    out = {"n": args.n, "plain_final_step": plain_final, "plain_final_accuracy": final.accuracy, "checkpoints": table,
           "curves": curves, "reach_plain_final": reach, "equal_budget": equal_budget}
    (RESULTS / "accelerate.json").write_text(json.dumps(out, indent=1) + "\n")
    figure(curves, table, final.accuracy, plain_final)
    print(json.dumps({"reach_plain_final": reach, "equal_budget": equal_budget}, indent=1))
    for label, row in table.items():
        d = row["vs_plain_final"]
        print(f"| {label} | {row['accuracy']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}] | {d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] |")


def figure(curves: dict, table: dict, final_accuracy: float, plain_final: int) -> None:
    from relex.plot import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"plain": "tab:blue", "jump-keep": "tab:red", "jump-reset": "tab:orange"}
    for name, curve in curves.items():
        for ax, key in zip(axes, ("grpo_step", "rollouts")):
            xs = [p[key] for p in curve]
            ys = [p["accuracy"] for p in curve]
            lows = [table[f"{name}@{p['grpo_step']}"]["ci_low"] for p in curve]
            highs = [table[f"{name}@{p['grpo_step']}"]["ci_high"] for p in curve]
            ax.plot(xs, ys, "-o", ms=4, color=colors.get(name), label=name)
            ax.fill_between(xs, lows, highs, color=colors.get(name), alpha=0.12)
    for ax, label in zip(axes, ("GRPO steps", "rollouts generated")):
        ax.axhline(final_accuracy, ls=":", color="grey", lw=1, label=f"plain final (step {plain_final})")
        ax.set(xlabel=label, ylabel="held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    _save(fig, FIGURES / "accelerate.png")


if __name__ == "__main__":
    main()
