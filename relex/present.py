"""How results are shown: one `Table`, three renderers (terminal, Markdown, plain text), one way to write a number.

    from relex.present import Table, markdown, show, text
    table = Table("relative error", ["method", "step 40"], [["relex", 0.1234], ["two-point", None]], notes=["lower is better"])
    show(table)            # the terminal (rich): never cropped, split into several tables when too wide
    markdown(table)        # `relex report`
    text(table)            # aligned plain text, e.g. for a log

A table holds values, not strings: every renderer formats a cell with `cell` (None and NaN become "—", floats three
decimals or two significant digits when tiny), so the same table reads the same everywhere. The first column is
left-aligned, the others right-aligned. A table without columns is a title with notes: a summary line.

The adapters at the end turn the results of relex's commands into tables: a fit, a backtest (in its saved form,
what backtest.json holds), extrapolated checkpoints, a sweep, jump decisions, an ingested store. This module sits
just below `relex.evaluate` in the layers (above the extrapolation it takes the horizon ratio from), so evaluate,
the pipeline commands, the report and the CLI all render through it; the adapters read a result by its attributes
and import none of the commands above. `relex.evaluate.report.eval_table` and `relex.demo.DemoResult.tables` are
built beside their results. The CLI shows tables with `show`, the report writes them with `markdown`.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from relex.extrapolate.methods import horizon_ratio

DASH = "—"  # a missing value: None, NaN, a comparison with nothing
MAX_STEP_COLUMNS = 8  # a backtest shows at most about this many later steps

# a message stays one line in a pipe; paths and reasons are never read as rich markup or emoji codes
console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)


@dataclass
class Table:
    """A result's rows: `title` above, `columns` as headers, `rows` of values, `notes` (lines) below."""

    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[list[str]]:
        """The rows as the renderers print them (each value through `cell`)."""
        return [[cell(value) for value in row] for row in self.rows]


# ---- numbers ------------------------------------------------------------------------------------------------------
def missing(value) -> bool:
    """None or NaN (numpy's floats too)."""
    return value is None or isinstance(value, numbers.Real) and math.isnan(value)


def number(value, digits: int = 3, *, signed: bool = False) -> str:
    """`digits` decimals (two significant digits in exponent form below 10⁻³), a sign with `signed`, "—" if missing."""
    if missing(value):
        return DASH
    sign = "+" if signed else ""
    if not isinstance(value, numbers.Integral) and value != 0 and abs(value) < 1e-3:
        return f"{float(value):{sign}.2e}"
    return f"{float(value):{sign}.{digits}f}"


def interval(value, low, high, *, signed: bool = False) -> str:
    """"0.375 [0.125, 0.625]", signed "+0.250 [+0.000, +0.500]" for a difference, "—" if the value is missing."""
    if missing(value):
        return DASH
    return f"{number(value, signed=signed)} [{number(low, signed=signed)}, {number(high, signed=signed)}]"


def percent(value) -> str:
    return DASH if missing(value) else f"{value:.0%}"


def step(value) -> str:
    """A step number, whole or not (an accelerated run's "as if step" 7.5): no trailing zeros."""
    return DASH if missing(value) else f"{value:g}"


def cell(value) -> str:
    """Any value of a table as text: strings as they are, yes/no, integers whole, other numbers by `number`."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if value is None or isinstance(value, numbers.Real):
        return number(value)
    return str(value)


# ---- renderers ----------------------------------------------------------------------------------------------------
def text(table: Table) -> str:
    """Aligned plain text: the title, the headers, one line per row, the notes."""
    cells = table.cells()
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(table.columns)]

    def line(row: list[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [value.rjust(width) for value, width in zip(row[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    lines = [table.title] if table.title else []
    if table.columns:
        lines += [line(table.columns)] + [line(row) for row in cells]
    return "\n".join(lines + table.notes)


def _markdown_cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def markdown(table: Table) -> str:
    """A Markdown table (first column left-aligned, the others right), the title and each note a paragraph."""
    blocks = [table.title] if table.title else []
    if table.columns:
        head = "| " + " | ".join(_markdown_cell(c) for c in table.columns) + " |"
        rule = "|" + "|".join(["---"] + ["---:"] * (len(table.columns) - 1)) + "|"
        body = ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in table.cells()]
        blocks.append("\n".join([head, rule, *body]))
    return "\n\n".join(blocks + table.notes)


class Terminal:
    """A table for `console.print` that is never cut to `st…` and `0.…`: one wider than the output (a pipe is 80
    columns) is printed as several, each repeating the first column, whose long labels fold instead. The title is
    a line of its own, so a narrow table does not squeeze it."""

    def __init__(self, table: Table):
        self.table, self.cells = table, table.cells()

    def __rich_console__(self, console, options):
        if self.table.title:
            yield Text(self.table.title)
        columns = self.table.columns
        if columns:
            widths = [max([cell_len(c)] + [cell_len(row[i]) for row in self.cells]) + 3 for i, c in enumerate(columns)]
            for part in column_groups(widths, options.max_width):
                yield self._part(part)
        for note in self.table.notes:
            yield Text(note)

    def _part(self, indices: list[int]) -> RichTable:
        out = RichTable()
        for i in indices:
            if i == 0:
                out.add_column(self.table.columns[i], overflow="fold")
            else:
                out.add_column(self.table.columns[i], justify="right", no_wrap=True)
        for row in self.cells:
            out.add_row(*[Text(row[i]) for i in indices])
        return out


def column_groups(widths: list[int], max_width: int) -> list[list[int]]:
    """Column indices of the tables that fit `max_width` (drawn widths, borders included), each led by column 0."""
    groups, used = [[0]], widths[0] + 1
    for i, width in enumerate(widths[1:], start=1):
        if used + width > max_width and len(groups[-1]) > 1:
            groups.append([0])
            used = widths[0] + 1
        groups[-1].append(i)
        used += width
    return groups


def show(*items: Table | str) -> None:
    """Print tables and lines to the terminal (stdout), in order."""
    for item in items:
        console.print(Terminal(item) if isinstance(item, Table) else Text(item))


# ---- adapters: the results of relex's commands as tables ----------------------------------------------------------
def fit_table(fit) -> Table:
    """A `relex.fit.FitResult` per module type: explained variance of the rank-r directions and temporal R²."""
    rank = fit.config.rank
    rows = [[r["module_type"], r["tensors"], r["median_explained_variance"], r["share_ev_ge_0.9"], r["median_r2"]]
            for r in fit.summary_by_module_type()]
    title = f"rank-{rank} fit over steps {fit.steps[0]}..{fit.steps[-1]} ({len(fit.steps)} observed), temporal {fit.config.temporal}"
    return Table(title, ["module type", "tensors", f"median EV(r={rank})", "share EV≥0.9", "median R²"], rows)


def shown_steps(steps: list[int], most: int = MAX_STEP_COLUMNS) -> list[int]:
    """About `most` of `steps`, evenly spaced, always with the last one."""
    if len(steps) <= most:
        return steps
    return sorted(set(steps[:: max(1, len(steps) // most)]) | {steps[-1]})


def backtest_tables(saved: dict) -> list[Table]:
    """A backtest as `relex.backtest.BacktestResult.to_dict` gives it (and backtest.json holds it): the relative
    error of each method at later steps, then at the last step by module type with the direction drift."""
    observed, later, errors = saved["observed_steps"], saved["later_steps"], saved["relative_error"]
    shown, last = shown_steps(later), str(later[-1])
    by_step = Table(
        f"relative error ‖Δ̂ − Δ‖/‖Δ‖, fit on steps ≤ {observed[-1]} ({len(observed)} observed)",
        ["method"] + [f"step {s}" for s in shown], [[m] + [errors[m][str(s)]["all"] for s in shown] for m in errors],
    )
    groups = sorted(k for k in next(iter(errors.values()))[last] if k != "all")
    drift = saved.get("drift_cosine_by_module_type", {})
    by_type = Table(
        f"at step {last}, by module type (drift: |cos| of the rank-1 directions of the fitted and the later steps)",
        ["module type"] + list(errors) + ["drift |cos|"], [[g] + [errors[m][last][g] for m in errors] + [drift.get(g)] for g in groups],
    )
    return [by_step, by_type]


LOSSY = 0.01  # an output dtype that rounds away more of the predicted update than this is warned about


def extrapolate_table(reports, method: str, out) -> Table:
    """The checkpoints `relex.extrapolate.extrapolate_store` wrote (its `TargetReport`s), with the horizon ratio
    explained and a warning for each output dtype that loses more than 1% of the predicted update."""
    rows = [[r.path.name, r.target, r.horizon_ratio, r.interpolation, r.delta_norm, r.rounding_loss] for r in reports]
    last_observed = round(reports[0].target / reports[0].horizon_ratio)
    notes = [f"horizon ratio = step / {last_observed}, the last observed step (both counted from the base)"]
    notes += [f"warning: step {r.target}: the output dtype rounds away {100 * r.rounding_loss:.1f}% of the predicted update "
              "(‖lost‖/‖Δ̂‖); consider --dtype float32" for r in reports if r.rounding_loss > LOSSY]
    columns = ["folder", "step", "horizon ratio", "interpolation", "‖Δ̂‖", "dtype loss"]
    return Table(f"{method} checkpoints in {out}", columns, rows, notes)


def sweep_table(result, method: str, n: int) -> Table:
    """A `relex.sweep.SweepResult`: validation accuracy of the references and of each target, the best marked."""
    rows = [[name, None, "", r["accuracy"], r["ci_low"], r["ci_high"]] for name, r in result.references.items()]
    rows += [[f"step {t}", horizon_ratio(t, result.last_step), "◀ best" if t == result.best_target else "",
              r["accuracy"], r["ci_low"], r["ci_high"]] for t, r in result.accuracies.items()]
    notes = [f"horizon ratio = step / {result.last_step}, the last observed step (both counted from the base)", result.verdict()]
    columns = ["checkpoint", "horizon ratio", "", "accuracy", "95% low", "95% high"]
    return Table(f"validation accuracy ({method}, {n} problems)", columns, rows, notes)


def decision_kind(jump: dict) -> str:
    """What a line of jumps.jsonl did: kept, jump, or rollback (back to the weights the segment started from)."""
    if not jump["jumped"]:
        return "kept"
    return "rollback" if (jump["chosen"] or {}).get("method") == "rollback" else "jump"


def jumps_table(jumps: list[dict], title: str = "") -> Table:
    """The jump decisions of a `relex accelerate` run (`relex.accelerate.loop.read_jumps`): GRPO step, validation
    accuracy of the current weights and after the decision, the step the weights stand for; each reason below."""
    rows = [[j["step"], decision_kind(j), j["chosen"]["name"] if j["chosen"] else DASH,
             j["validation_accuracy_before"], j["validation_accuracy_after"], step(j["virtual_step_after"])] for j in jumps]
    columns = ["step", "decision", "candidate", "val. before", "val. after", "as if step"]
    return Table(title, columns, rows, [f"step {j['step']}: {j['reason']}" for j in jumps])


def store_summary(store, *, repointed_at: list[str] | None = None) -> Table:
    """What `relex ingest` made (a `relex.store.TrajectoryStore`): steps, tensors, size; or where it now points."""
    if repointed_at is not None:
        base = os.path.normpath(store.base_dir)
        return Table(f"store {store.path}: {len(store.steps)} steps re-pointed at {', '.join(map(str, repointed_at))} (base {base})")
    entries = store.entries
    copied = any(e.kind == "delta" for e in entries)
    title = (f"store {store.path}: {len(entries)} steps ({', '.join(str(e.step) for e in entries)}), "
             f"{len(store.trajectory_names)} trajectory tensors, tied {store.tied or 'none'}, "
             f"{'copied' if copied else 'referenced in place'}, {store.size_bytes() / 2**20:.1f} MiB")
    errors = [e.quantization_error for e in entries if e.quantization_error is not None]
    dtypes = sorted({e.dtype for e in entries if e.quantization_error is not None})
    notes = [f"delta quantization error ({', '.join(dtypes)}): max ‖q(Δ)−Δ‖/‖Δ‖ = {max(errors):.2e}"] if errors else []
    return Table(title, notes=notes)
