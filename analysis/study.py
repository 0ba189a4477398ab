"""Reproduce the study of analysis/README.md with relex's own command line, from the RLVR run to the tables.

    .venv/bin/python analysis/study.py            # the whole study (hours on 2 CPU cores)
    .venv/bin/python analysis/study.py --short    # fewer steps and problems: a check that everything runs

Stages (each skipped when its output exists, so an interrupted study resumes):
  1. train        relex train --config analysis/configs/smollm2-chain-sum.yaml            -> runs/study/
  2. low rank     relex fit at 10/20/40/100% of the run (ranks 1, 2, 4)                   -> fits/, low_rank.csv
  3. backtest     relex backtest from 10/20/40%, ranks 1/2/4, two-point, per-param       -> backtest-*.json
  4. extrapolate  relex extrapolate: RELEX (rank 1/2/4, windows 10/20/40%), two-point and per-param to 1×, 2×
                  and 5× the run length; rank-r reconstructions of the last step          -> checkpoints/
  5. evaluate     relex eval of the real final checkpoint (first: every difference is against it), the base,
                  real intermediate steps and every prediction, on the same held-out problems   -> eval/
  6. horizon      relex sweep from the first 20% to targets 1.2×–3.8× past it, on a validation split  -> sweep/
  7. figures      relex plot trajectory/variance/accuracy/rewards                          -> analysis/figures/
  8. tables       analysis/results/*.csv and results.json, printed as Markdown

Numbers come only from the files these commands write; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEX = str(ROOT / ".venv" / "bin" / "relex")
CONFIG = ROOT / "analysis" / "configs" / "smollm2-chain-sum.yaml"
FRACTIONS = (0.1, 0.2, 0.4)
HORIZONS = (1, 2, 5)


def relex(*args, log: Path | None = None) -> float:
    """Run one relex command; returns its wall time in seconds."""
    command = [RELEX, *map(str, args)]
    print("$", " ".join(command[1:]).replace(str(ROOT) + "/", ""), flush=True)
    started = time.time()
    with open(log, "a") if log else open("/dev/null", "w") as sink:
        subprocess.run(command, check=True, stdout=sink if log else None, stderr=subprocess.STDOUT if log else None)
    return time.time() - started


class Study:
    def __init__(self, run: Path, results: Path, figures: Path, eval_n: int, batch_size: int):
        self.run, self.results, self.figures = run, results, figures
        self.store = run / "trajectory"
        self.eval_n, self.batch_size = eval_n, batch_size
        self.timings: dict[str, float] = {}
        for folder in (results, figures, run / "fits", run / "checkpoints"):
            folder.mkdir(parents=True, exist_ok=True)

    @property
    def steps(self) -> list[int]:
        return [entry["step"] for entry in json.loads((self.store / "manifest.json").read_text())["steps"]]

    def cutoff(self, fraction: float) -> int:
        """The last recorded step within the first `fraction` of the run."""
        last = self.steps[-1]
        return max(s for s in self.steps if s <= max(fraction * last, self.steps[2]))

    # ---- stages ------------------------------------------------------------------------------------------------
    def train(self, max_steps: int | None) -> None:
        if (self.store / "manifest.json").is_file() and (self.run / "log.jsonl").is_file():
            return
        extra = ["--max-steps", max_steps] if max_steps else []
        self.timings["train"] = relex("train", "--config", CONFIG, "--out", self.run, "--no-progress", *extra, log=self.run.parent / "study-train.log")

    def fit(self, fraction: float, rank: int) -> Path:
        until = self.cutoff(fraction) if fraction < 1 else self.steps[-1]
        out = self.run / "fits" / f"until{until}-rank{rank}"
        if not (out / "fit.json").is_file():
            reuse = ["--gram-from", self.fit(fraction, 1)] if rank > 1 else []  # other ranks: the same Gram
            self.timings[f"fit {out.name}"] = relex("fit", self.store, "--out", out, "--rank", rank, "--observe-until", until, "--overwrite", *reuse)
        return out

    def backtest(self, fraction: float, rank: int) -> Path:
        until = self.cutoff(fraction)
        out = self.results / f"backtest-until{until}-rank{rank}.json"
        methods = "relex,two-point,per-param" if rank == 1 else "relex"
        if not out.is_file():
            relex("backtest", self.store, "--observe-until", until, "--rank", rank, "--methods", methods, "--out", out,
                  "--gram-from", self.fit(1.0, 1))
        return out

    def extrapolate(self, name: str, fit: Path | None, targets: list[int], *options) -> dict[int, Path]:
        out = self.run / "checkpoints" / name
        wanted = {t: out / f"step-{t}" for t in targets}
        if not all((p / "relex.json").is_file() for p in wanted.values()):
            args = ["extrapolate", self.store, "--targets", ",".join(map(str, targets)), "--out", out, "--overwrite", *options]
            if fit is not None:
                args += ["--fit", fit]
            self.timings[f"extrapolate {name}"] = relex(*args)
        return wanted

    def evaluate(self, checkpoints: dict[str, str]) -> dict:
        out = self.run / "eval"
        if not (out / "summary.json").is_file():
            self.timings["eval"] = relex(
                "eval", *checkpoints.values(), "--task-file", CONFIG, "--n", self.eval_n, "--max-new-tokens", 32,
                "--batch-size", self.batch_size, "--out", out, "--overwrite",
            )
        return json.loads((out / "summary.json").read_text())


def low_rank_table(study: Study) -> list[dict]:
    rows = []
    for fraction in (*FRACTIONS, 1.0):
        until = study.cutoff(fraction) if fraction < 1 else study.steps[-1]
        for rank in (1, 2, 4):
            if rank > len([s for s in study.steps if s <= until]):
                continue  # a rank needs at least as many observed steps
            fit = study.fit(fraction, rank)
            for row in csv.DictReader(open(fit / "summary_by_module_type.csv")):
                if row["module_type"] == "all" or rank == 1:
                    rows.append({"fraction": fraction, "observe_until": json.loads((fit / "fit.json").read_text())["steps"][-1], "rank": rank, **row})
    return rows


def backtest_table(study: Study) -> list[dict]:
    rows = []
    for fraction in FRACTIONS:
        for rank in (1, 2, 4):
            if rank > len([s for s in study.steps if s <= study.cutoff(fraction)]):
                continue
            result = json.loads(study.backtest(fraction, rank).read_text())
            last = str(result["later_steps"][-1])
            for method, by_step in result["relative_error"].items():
                label = method if method != "relex" else f"relex-r{rank}"
                rows.append({
                    "fraction": fraction, "observe_until": result["observed_steps"][-1], "method": label,
                    "target": int(last), "relative_error": by_step[last]["all"],
                    "drift_cosine_median": result["drift_cosine_median"],
                })
    return rows


def reconstruction_table(study: Study) -> list[dict]:
    """Weight-space error of the rank-r projection of observed steps, ‖P_r Δ_m − Δ_m‖/‖Δ_m‖, from a FIT's Gram."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from relex.fit import FitResult

    rows = []
    for rank in (1, 2, 4):
        fit = FitResult.load(study.fit(1.0, rank))
        for step in (study.cutoff(0.2), study.cutoff(0.4), study.steps[-1]):
            m = study.steps.index(step)
            err = truth = 0.0
            for name, gram in fit.grams.items():
                u = fit.tensors[name].u
                residual = np.eye(len(gram))[m] - u @ u[m]
                err += float(residual @ gram @ residual)
                truth += float(gram[m, m])
            rows.append({"rank": rank, "step": step, "relative_error": (err / truth) ** 0.5})
    return rows


def checkpoints_to_evaluate(study: Study, horizons: tuple[int, ...]) -> dict[str, str]:
    last = study.steps[-1]
    targets = [h * last for h in horizons]
    until20 = study.cutoff(0.2)
    ckpts = {f"real@{last}": f"{study.store}@{last}", "base": "smollm2-135m-instruct"}
    for fraction in (0.2, 0.4):
        step = study.cutoff(fraction)
        ckpts[f"real@{step}"] = f"{study.store}@{step}"
    for target, path in study.extrapolate("relex-r1-until%d" % until20, study.fit(0.2, 1), targets).items():
        ckpts[f"relex r1 ≤{until20} →{target}"] = str(path)
    for target, path in study.extrapolate("two-point-until%d" % until20, None, targets, "--method", "two-point", "--observe-until", until20).items():
        ckpts[f"two-point ≤{until20} →{target}"] = str(path)
    for target, path in study.extrapolate("per-param-until%d" % until20, None, [last], "--method", "per-param", "--observe-until", until20).items():
        ckpts[f"per-param ≤{until20} →{target}"] = str(path)
    for rank in (2, 4):
        for target, path in study.extrapolate(f"relex-r{rank}-until{until20}", study.fit(0.2, rank), [last]).items():
            ckpts[f"relex r{rank} ≤{until20} →{target}"] = str(path)
    for fraction in (0.1, 0.4):
        until = study.cutoff(fraction)
        for target, path in study.extrapolate(f"relex-r1-until{until}", study.fit(fraction, 1), [last]).items():
            ckpts[f"relex r1 ≤{until} →{target}"] = str(path)
    for rank in (1, 4):
        for target, path in study.extrapolate(f"reconstruct-r{rank}", study.fit(1.0, rank), [last], "--method", "reconstruct").items():
            ckpts[f"reconstruct r{rank} @{target}"] = str(path)
    return ckpts


def accuracy_table(summary: dict, labels: dict[str, str]) -> list[dict]:
    by_path = {v: k for k, v in labels.items()}
    rows = []
    for result in summary["checkpoints"]:
        diff = result.get("diff_vs_first") or {}
        rows.append({
            "checkpoint": by_path.get(result["checkpoint"], result["checkpoint"]),
            "accuracy": result["accuracy"], "ci_low": result["ci_low"], "ci_high": result["ci_high"],
            "diff_vs_real_final": diff.get("diff"), "diff_ci_low": diff.get("ci_low"), "diff_ci_high": diff.get("ci_high"),
            "mean_tokens": result["mean_tokens"], "truncated": result["truncated"], "n": result["n"],
        })
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="12 steps and 64 problems: checks the pipeline, not the science")
    parser.add_argument("--run", default=None, help="run folder (default runs/study, or runs/study-short)")
    parser.add_argument("--eval-n", type=int, default=None, help="held-out problems per checkpoint (default 500)")
    args = parser.parse_args()
    run = Path(args.run or ROOT / "runs" / ("study-short" if args.short else "study"))
    results = ROOT / "analysis" / ("results-short" if args.short else "results")
    figures = ROOT / "analysis" / ("figures-short" if args.short else "figures")
    study = Study(run, results, figures, args.eval_n or (64 if args.short else 500), batch_size=64)
    study.train(12 if args.short else None)

    low_rank = low_rank_table(study)
    write_csv(results / "low_rank.csv", low_rank)
    backtests = backtest_table(study)
    write_csv(results / "backtest.csv", backtests)
    write_csv(results / "reconstruction.csv", reconstruction_table(study))
    labels = checkpoints_to_evaluate(study, HORIZONS)
    summary = study.evaluate(labels)
    accuracy = accuracy_table(summary, labels)
    write_csv(results / "accuracy.csv", accuracy)

    until20 = study.cutoff(0.2)
    sweep = study.run / "sweep"
    if not (sweep / "sweep.json").is_file():
        relex("sweep", study.store, "--observe-until", until20, "--targets", "14,16,18,20,24,30,40" if not args.short else "8,10",
              "--task-file", CONFIG, "--n", 200 if not args.short else 32, "--max-new-tokens", 32, "--batch-size", 64,
              "--out", sweep, "--overwrite")
    (results / "sweep.json").write_text((sweep / "sweep.json").read_text())
    relex("plot", "accuracy", sweep / "validation" / "summary.json", "--out", figures / "horizon.png",
          "--title", f"Extrapolating from steps ≤ {until20}: validation accuracy against the target step")
    relex("plot", "trajectory", study.store, "--fit", study.fit(0.2, 1), "--out", figures / "trajectory.png", "--extend-to", 2 * study.steps[-1])
    relex("plot", "variance", study.fit(0.2, 1), "--out", figures / "variance.png")
    relex("plot", "accuracy", study.run / "eval" / "summary.json", "--out", figures / "accuracy.png")
    relex("plot", "rewards", study.run, "--out", figures / "rewards.png")

    log = [json.loads(line) for line in open(study.run / "log.jsonl")]
    step_seconds = [r["step_seconds"] for r in log]
    cost = {
        "steps": len(log), "observed_until": until20,
        "mean_step_seconds": sum(step_seconds) / len(step_seconds),
        "seconds_of_steps_after_observed": sum(r["step_seconds"] for r in log if r["step"] > until20),
        "store_bytes": sum(f.stat().st_size for f in study.store.rglob("*") if f.is_file()),
        "timings": study.timings,
    }
    (results / "results.json").write_text(json.dumps({"cost": cost, "accuracy": accuracy, "backtest": backtests, "low_rank": low_rank}, indent=1) + "\n")
    print(markdown(accuracy, ["checkpoint", "accuracy", "ci_low", "ci_high", "diff_vs_real_final", "diff_ci_low", "diff_ci_high", "mean_tokens"]))
    print(markdown(backtests, ["fraction", "observe_until", "method", "target", "relative_error", "drift_cosine_median"]))
    print(json.dumps(cost, indent=1))


if __name__ == "__main__":
    sys.exit(main())
