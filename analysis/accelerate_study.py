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
  3. evaluate   every checkpoint on the same held-out problems (greedy), paired  -> runs/accel/eval-cache.json
  4. tables     accuracy against GRPO steps and rollouts, steps and wall time to reach the plain run's final
                accuracy, paired intervals at equal budgets            -> results/accelerate.json, figures/accelerate.png

Numbers come only from the files the commands write; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "accel"  # defaults; --runs, --config, --name and --results point the study at another set of runs
PLAIN_CONFIG = ROOT / "analysis" / "configs" / "accelerate-plain.yaml"
RESULTS = ROOT / "analysis" / "results"
FIGURES = ROOT / "analysis" / "figures"
OBSERVE_UNTIL = 8
ONE_SHOT_TARGETS = [12, 16]  # 1.5× and 2× the observed 8 steps: the horizon the first study measured
SCORED_AT_2X = ("relex", "two-point")  # every baseline is scored at 1.5×, these two at 2× as well


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
        for target in ONE_SHOT_TARGETS if label in SCORED_AT_2X else ONE_SHOT_TARGETS[:1]:
            checkpoints[f"{label} → {target}"] = str(folder / f"step-{target}")
    a, b, target = OBSERVE_UNTIL // 2, OBSERVE_UNTIL, ONE_SHOT_TARGETS[0]
    checkpoints[f"logits {a}→{b} → {target}"] = f"logits({store_dir}@{a},{store_dir}@{b},{(target - a) / (b - a):g})"
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


# ---- 4. evaluation, cached per checkpoint so that later runs only score what is new ----------------------------------
@dataclass
class Scored:
    checkpoint: str
    correct: list

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.correct))

    def interval(self) -> tuple[float, float]:
        from relex.evaluate.metrics import bootstrap_ci

        return bootstrap_ci(self.correct)


def score_all(labels: dict[str, str], task, n: int, batch_size: int, cache_file: Path) -> dict[str, Scored]:
    """Greedy correctness of every checkpoint on the same first `n` held-out problems (cached in the runs' folder)."""
    from relex.evaluate import evaluate

    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    for label, checkpoint in labels.items():
        key = f"{checkpoint}|n={n}"
        if key not in cache:
            result = evaluate([checkpoint], task, n=n, max_new_tokens=24, batch_size=batch_size)
            cache[key] = result.checkpoints[0].greedy_correct()
            cache_file.write_text(json.dumps(cache))
            print(f"{label}: {np.mean(cache[key]):.3f}", flush=True)
    return {label: Scored(checkpoint, cache[f"{checkpoint}|n={n}"]) for label, checkpoint in labels.items()}


def paired(a: Scored, b: Scored) -> dict:
    from relex.evaluate.metrics import paired_bootstrap_diff

    diff, low, high = paired_bootstrap_diff(a.correct, b.correct)
    return {"diff": diff, "ci_low": low, "ci_high": high}


def decisions(run: Path) -> list[dict]:
    """What each decision saw and did: the segment's noise signals next to the jump it allowed or refused."""
    from relex.present import decision_kind

    out = []
    for line in (run / "jumps.jsonl").read_text().splitlines():
        j = json.loads(line)
        best = max(j["candidates"], key=lambda c: c["accuracy"]) if j["candidates"] else None
        out.append({"step": j["step"], "jumped": j["jumped"], "rollback": decision_kind(j) == "rollback", "reason": j["reason"], "signals": j["signals"],
                    "validation_before": j["validation_accuracy_before"], "validation_after": j["validation_accuracy_after"],
                    "best_candidate": best and {k: best[k] for k in ("name", "accuracy", "diff", "ci_low", "ci_high")},
                    "seconds": j["seconds"]})
    return out


# ---- 5. tables --------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="held-out problems per checkpoint")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--skip-noise", action="store_true")
    parser.add_argument("--only-plain", action="store_true", help="score the plain run and the one-shot baselines only")
    parser.add_argument("--skip-one-shot", action="store_true", help="no one-shot baselines (a replicate of the loop runs)")
    parser.add_argument("--runs", type=Path, default=RUNS, help="folder holding plain/ and jump-*/ (default runs/accel)")
    parser.add_argument("--config", type=Path, default=PLAIN_CONFIG, help="the plain run's config (task, batch)")
    parser.add_argument("--name", default="accelerate", help="results/NAME.json, NAME-noise.json, figures/NAME.png")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    args = parser.parse_args()
    from relex.train import load_config

    runs_dir, results, study = args.runs, args.results, args.name
    config = load_config(args.config)
    grpo = config.grpo
    per_step = grpo.get("per_device_train_batch_size", 8) * grpo.get("gradient_accumulation_steps", 1)
    results.mkdir(parents=True, exist_ok=True)
    plain_store = runs_dir / "plain" / "trajectory"
    if not args.skip_noise:
        measured = noise(plain_store)
        (results / f"{study}-noise.json").write_text(json.dumps(measured, indent=1) + "\n")
        print("noise:", {k: v for k, v in measured.items() if not isinstance(v, list)}, flush=True)
    runs = {"plain": plain_points(plain_store)}
    if not args.only_plain:
        for run in sorted(p for p in runs_dir.glob("jump-*") if (p / "jumps.jsonl").is_file()):
            runs[run.name] = accelerated_points(run)
    labels = {f"{name}@{step}": checkpoint for name, points in runs.items() for step, checkpoint in sorted(points.items())}
    if not args.skip_one_shot:
        labels.update(one_shot(plain_store, runs_dir / "oneshot"))
    scored = score_all(labels, config.task, args.n, args.batch_size, runs_dir / "eval-cache.json")
    if args.only_plain:
        return
    plain_final = max(runs["plain"])
    final = scored[f"plain@{plain_final}"]
    table = {}
    for label, r in scored.items():
        low, high = r.interval()
        table[label] = {"accuracy": r.accuracy, "ci_low": low, "ci_high": high, "vs_plain_final": paired(r, final)}
    plain_wall = wall_seconds(runs_dir / "plain")
    curves, reach = {}, {}
    for name, points in runs.items():
        walls = wall_seconds(runs_dir / name)
        curves[name] = [{"grpo_step": s, "rollouts": s * per_step, "accuracy": scored[f"{name}@{s}"].accuracy,
                         "wall_seconds": walls.get(s)} for s in sorted(points)]
        hit = next((p for p in curves[name] if p["accuracy"] >= final.accuracy), None)
        reach[name] = None if hit is None else {
            "grpo_steps": hit["grpo_step"], "rollouts": hit["rollouts"],
            "step_ratio": plain_final / hit["grpo_step"] if hit["grpo_step"] else None,
            "wall_seconds": hit["wall_seconds"], "plain_wall_seconds": plain_wall.get(plain_final),
            "wall_ratio": hit["wall_seconds"] / plain_wall[plain_final] if hit["wall_seconds"] is not None else None,
            "vs_plain_final": table[f"{name}@{hit['grpo_step']}"]["vs_plain_final"],
        }
    equal_budget = {f"{name}@{s} − plain@{s}": paired(scored[f"{name}@{s}"], scored[f"plain@{s}"])
                    for name, points in runs.items() if name != "plain" for s in points if s in runs["plain"]}
    out = {"n": args.n, "rollouts_per_step": per_step, "plain_final_step": plain_final, "plain_final_accuracy": final.accuracy, "checkpoints": table,
           "curves": curves, "reach_plain_final": reach, "equal_budget": equal_budget,
           "decisions": {run: decisions(runs_dir / run) for run in runs if run != "plain"}}
    (results / f"{study}.json").write_text(json.dumps(out, indent=1) + "\n")
    jumped = {run: {d["step"] for d in out["decisions"][run] if d["jumped"] and not d["rollback"]} for run in out["decisions"]}
    rolled = {run: {d["step"] for d in out["decisions"][run] if d["rollback"]} for run in out["decisions"]}
    figure(curves, table, final.accuracy, plain_final, args.figures / f"{study}.png", jumped, rolled)
    print(json.dumps({"reach_plain_final": reach, "equal_budget": equal_budget}, indent=1))
    for label, row in table.items():
        d = row["vs_plain_final"]
        print(f"| {label} | {row['accuracy']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}] | {d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] |")


def figure(curves: dict, table: dict, final_accuracy: float, plain_final: int, path: Path,
           jumped: dict[str, set[int]] | None = None, rolled: dict[str, set[int]] | None = None) -> None:
    """Held-out accuracy against GRPO steps and rollouts, one curve per run; a star where a run had just jumped, a
    cross where it had just rolled back to the weights its segment started from."""
    from relex.plot import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    named = {"plain": "tab:blue", "jump-keep": "tab:red", "jump-reset": "tab:orange", "jump-m2": "tab:green"}
    spare = iter(c for c in ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
                 if c not in {named[n] for n in curves if n in named})
    colors = {name: named.get(name) or next(spare) for name in curves}
    jumped, rolled = jumped or {}, rolled or {}
    for name, curve in curves.items():
        for ax, key in zip(axes, ("grpo_step", "rollouts")):
            xs = [p[key] for p in curve]
            ys = [p["accuracy"] for p in curve]
            lows = [table[f"{name}@{p['grpo_step']}"]["ci_low"] for p in curve]
            highs = [table[f"{name}@{p['grpo_step']}"]["ci_high"] for p in curve]
            ax.plot(xs, ys, "-o", ms=4, color=colors.get(name), label=name)
            ax.fill_between(xs, lows, highs, color=colors.get(name), alpha=0.12)
            for marks, marker, did in ((jumped, "*", "jumped"), (rolled, "X", "rolled back")):
                points = [(x, y) for x, y, p in zip(xs, ys, curve) if p["grpo_step"] in marks.get(name, ())]
                if points:
                    ax.plot(*zip(*points), marker, ms=11 if marker == "*" else 8, color=colors.get(name),
                            label=f"{name}: {did}" if key == "grpo_step" else None)
    for ax, label in zip(axes, ("GRPO steps", "rollouts generated")):
        ax.axhline(final_accuracy, ls=":", color="grey", lw=1, label=f"plain final (step {plain_final})")
        ax.set(xlabel=label, ylabel="held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    _save(fig, path)


if __name__ == "__main__":
    main()
