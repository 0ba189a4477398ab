"""`relex report RUN`: one Markdown file that tells a run's story top to bottom, with its figures beside it.

It uses whatever of this layout exists in the run folder (what `relex train` and `relex demo` write), and says
for each missing part which command makes it:

    RUN/config.yaml          the resolved training config                      (relex train)
    RUN/log.jsonl            one JSON line per optimizer step                  (relex train)
    RUN/summary.json         seconds per step, recording overhead, store size  (relex train)
    RUN/trajectory/          the trajectory store                              (relex train, relex ingest)
    RUN/fit/                 the rank-r fit                                    (relex fit RUN/trajectory --out RUN/fit)
    RUN/backtest.json        the backtest                                      (relex backtest ... --out RUN/backtest.json)
    RUN/eval/summary.json    the evaluation                                    (relex eval ... --out RUN/eval)

The report goes to RUN/report.md unless told otherwise, and its figures to `figures/` beside the report
(RUN/figures/ by default), linked by relative paths: rewards.png, variance.png, trajectory.png, accuracy.png.
Its tables are the ones the commands print (relex.present: the fit's, the backtest's, the jump decisions), written
as Markdown.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from relex.accelerate.figures import plot_jumps
from relex.accelerate.loop import JUMPS_LOG, read_jumps
from relex.errors import RelexError
from relex.fit import FitResult
from relex.io.atomic import write_text_atomic
from relex.plot import plot_accuracy, plot_rewards, plot_trajectory, plot_variance, read_accuracy_points, reward_records
from relex.present import DASH, Table, backtest_tables, fit_table, interval, jumps_table, markdown, number, step
from relex.store import TrajectoryStore, is_store

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLayout:
    """Where each part of a run lives (see the module docstring)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def log(self) -> Path:
        return self.root / "log.jsonl"

    @property
    def train_summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def store(self) -> Path:
        return self.root / "trajectory"

    @property
    def fit(self) -> Path:
        return self.root / "fit"

    @property
    def backtest(self) -> Path:
        return self.root / "backtest.json"

    @property
    def eval_summary(self) -> Path:
        return self.root / "eval" / "summary.json"


# ---- Markdown -----------------------------------------------------------------------------------------------------
def table_lines(table: Table) -> list[str]:
    return [markdown(table), ""]


def missing(what: str, path: Path, command: str) -> list[str]:
    return [f"_No {what}: expected `{path}`; make it with `{command}`._", ""]


class Figures:
    """Draws figures into a folder and returns Markdown links relative to the report."""

    def __init__(self, report: Path):
        self.report_dir = report.parent
        self.folder = self.report_dir / "figures"
        self.written: list[Path] = []

    def add(self, name: str, caption: str, draw) -> list[str]:
        path = self.folder / name
        try:
            draw(path)
        except RelexError as error:  # e.g. a run whose trajectory is all zero: say so where the figure would be
            LOG.warning("figure %s not drawn: %s", name, error)
            return [f"_Figure {name} not drawn: {error}._", ""]
        if not path.is_file():
            raise RuntimeError(f"figure {path} was not written")
        self.written.append(path)
        return [f"![{caption}]({os.path.relpath(path, self.report_dir)})", ""]


# ---- sections -----------------------------------------------------------------------------------------------------
def accelerated_runs(root: Path) -> list[Path]:
    """RUN itself when `relex accelerate` made it, else its subfolders that it made (the demo's plain/, accelerated/)."""
    if (root / JUMPS_LOG).is_file():
        return [root]
    return sorted(p.parent for p in root.glob(f"*/{JUMPS_LOG}"))


def accelerate_section(run: RunLayout, figures: Figures) -> list[str]:
    """Train → jump → train: every decision with its candidates' validation scores, and the jumps figure."""
    runs = accelerated_runs(run.root)
    if not runs:
        return []
    lines = ["## Accelerated training (relex accelerate)", ""]
    lines += figures.add("jumps.png", "validation accuracy against GRPO steps, jumps marked", lambda p: plot_jumps(runs, p))
    for folder in runs:
        jumps = read_jumps(folder)
        summary_path = folder / "accelerate-summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        lines += [f"### `{folder.name}`", ""]
        if summary:
            seconds = summary.get("seconds", {})
            jumps_made, rollbacks = summary.get("jumps"), summary.get("rollbacks", 0)
            lines.append(f"{summary.get('grpo_steps')} GRPO steps, {jumps_made} jump{'' if jumps_made == 1 else 's'} and "
                         f"{rollbacks} rollback{'' if rollbacks == 1 else 's'} in {summary.get('decisions')} decisions; "
                         f"the final weights stand for step {step(summary.get('virtual_steps'))}. Wall time "
                         f"{number(seconds.get('wall'), 1)} s: GRPO {number(seconds.get('grpo'), 1)} s, fit {number(seconds.get('fit'), 1)} s, "
                         f"candidates {number(seconds.get('candidates'), 1)} s, validation {number(seconds.get('validation'), 1)} s.")
            lines.append("")
        lines += table_lines(jumps_table(jumps))
    return lines


def config_section(run: RunLayout) -> list[str]:
    lines = ["## Configuration", ""]
    if not run.config.is_file():
        return lines + missing("training config", run.config, "relex train --config FILE --out RUN")
    return lines + ["```yaml", run.config.read_text().rstrip(), "```", ""]


def rewards_section(run: RunLayout, figures: Figures) -> list[str]:
    lines = ["## Training rewards", ""]
    records = reward_records(run.log) if run.log.is_file() else []
    if not records:
        return lines + missing("training log", run.log, "relex train --config FILE --out RUN")
    lines += figures.add("rewards.png", "training reward per step", lambda p: plot_rewards(run.log, p))
    first, last = records[0], records[-1]
    lines.append(f"{len(records)} optimizer steps; mean reward {number(first['reward'])} at step {first['step']}, "
                 f"{number(last['reward'])} at step {last['step']}.")
    if run.train_summary.is_file():
        summary = json.loads(run.train_summary.read_text())
        per_step, overhead = summary.get("seconds_per_step"), summary.get("record_seconds_over_step_seconds")
        lines.append(f"{number(per_step)} s per step; recording the deltas took {number(overhead)} of a step; "
                     f"the store holds {len(summary.get('recorded_steps', []))} steps in {summary.get('store_bytes', 0) / 2**20:.1f} MiB.")
    return lines + [""]


def fit_section(run: RunLayout, figures: Figures) -> list[str]:
    lines = ["## Trajectory fit", ""]
    if not (run.fit / "fit.json").is_file():
        return lines + missing("fit", run.fit, f"relex fit {run.store} --out {run.fit} --observe-until S")
    fit = FitResult.load(run.fit)
    lines += [f"EV is the share of the trajectory's energy in the first {fit.config.rank} direction(s); R² is how well the "
              "temporal model follows the first coefficient.", ""]
    lines += table_lines(fit_table(fit))
    lines += figures.add("variance.png", "explained variance and R² by module type", lambda p: plot_variance(fit, p))
    if is_store(run.store):
        store = TrajectoryStore.open(run.store)
        lines += ["Rank-1 coefficient of a few tensors against the step; open circles are recorded steps the fit did not see.", ""]
        lines += figures.add("trajectory.png", "trajectory coefficients", lambda p: plot_trajectory(store, fit, p))
    return lines


def backtest_section(run: RunLayout) -> list[str]:
    lines = ["## Backtest", ""]
    if not run.backtest.is_file():
        return lines + missing("backtest", run.backtest, f"relex backtest {run.store} --observe-until S --out {run.backtest}")
    by_step, by_type = backtest_tables(json.loads(run.backtest.read_text()))
    lines += ["Each method is fitted on the observed steps and predicts every later recorded step (lower is better).", ""]
    return lines + table_lines(by_step) + table_lines(by_type)


def short_label(label: str, root: Path) -> str:
    """A checkpoint label relative to the run folder when it lies inside it (`STORE@S` keeps its `@S`)."""
    folder, at, number_ = label.rpartition("@")
    path = Path(folder if at else label)
    try:
        short = path.resolve().relative_to(root.resolve())
    except ValueError:
        return label
    return f"{short}{at}{number_}" if at else str(short)


def eval_section(run: RunLayout, figures: Figures) -> list[str]:
    lines = ["## Evaluation", ""]
    if not run.eval_summary.is_file():
        return lines + missing("evaluation", run.eval_summary, f"relex eval CKPT... --task NAME --out {run.eval_summary.parent}")
    summary = json.loads(run.eval_summary.read_text())
    points = {p.checkpoint: p for p in read_accuracy_points([run.eval_summary])}
    first = summary["checkpoints"][0]["checkpoint"]
    settings = summary.get("settings", {})
    lines += [f"Task `{summary['task']['name']}` (verifier `{summary['task']['verifier']}`), greedy decoding, "
              f"at most {settings.get('max_new_tokens')} new tokens; intervals are 95% bootstrap intervals, and Δ is "
              f"the paired difference with `{short_label(first, run.root)}` on the same problems.", ""]
    rows = []
    for entry in summary["checkpoints"]:
        point = points[entry["checkpoint"]]
        diff = entry.get("diff_vs_first")
        rows.append([
            short_label(entry["checkpoint"], run.root), point.series, point.step, entry["n"],
            interval(entry["accuracy"], entry["ci_low"], entry["ci_high"]),
            DASH if not diff else interval(diff["diff"], diff["ci_low"], diff["ci_high"], signed=True),
            number(entry.get("mean_tokens"), 1),
        ])
    columns = ["checkpoint", "series", "step", "n", "accuracy [95% CI]", "Δ vs first [95% CI]", "tokens"]
    lines += table_lines(Table("", columns, rows))
    return lines + figures.add("accuracy.png", "accuracy against step", lambda p: plot_accuracy([run.eval_summary], p))


# ---- the report ---------------------------------------------------------------------------------------------------
def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the Markdown report of `run_dir` (default RUN/report.md) and its figures; returns its path."""
    run = RunLayout(Path(run_dir))
    if not run.root.is_dir():
        raise RelexError(f"{run.root}: no such run folder")
    out = Path(out) if out is not None else run.root / "report.md"
    figures = Figures(out)
    parts = [f"# relex report: {run.root.resolve().name}", "", f"Run folder `{run.root}`. Sections without their inputs say which command makes them.", ""]
    accelerated = accelerated_runs(run.root)
    if not accelerated or accelerated == [run.root]:  # a run folder; a demo's folder holds its runs instead
        parts += config_section(run)
    parts += accelerate_section(run, figures)
    if not accelerated:  # the single trajectory of relex train; accelerate fits each segment at its jump
        parts += rewards_section(run, figures)
        parts += fit_section(run, figures)
        parts += backtest_section(run)
    elif accelerated == [run.root]:
        parts += rewards_section(run, figures)
    parts += eval_section(run, figures)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "\n".join(parts).rstrip() + "\n", lock=True)
    LOG.info("report written to %s with %d figure(s)", out, len(figures.written))
    return out
