"""The outputs of an evaluation: a table for the terminal, and `OUT/completions.jsonl` + `OUT/summary.json`.

The output folder is written through relex.io.atomic: under a hidden temporary name next to it, renamed into
place once complete, so an interrupted or failed evaluation never leaves a half-written folder behind.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from relex.io.atomic import atomic_output, check_output

COMPLETIONS_NAME = "completions.jsonl"
SUMMARY_NAME = "summary.json"


def check_out_dir(out_dir: Path, overwrite: bool, inputs=()) -> None:
    """Refuses, before any work, an output path that is a file, a folder with something in it (without
    `overwrite`), or with `overwrite` one of the checkpoints evaluated (relex.io.atomic)."""
    check_output(out_dir, overwrite=overwrite, inputs=inputs)


def write_outputs(result, out_dir: Path, overwrite: bool, inputs=()) -> Path:
    with atomic_output(out_dir, overwrite=overwrite, inputs=inputs) as tmp:
        with open(tmp / COMPLETIONS_NAME, "w") as handle:
            for checkpoint in result.checkpoints:
                for record in checkpoint.records:
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        (tmp / SUMMARY_NAME).write_text(json.dumps(result.summary(), indent=1, default=str) + "\n")
    return out_dir


def _rate(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.3f}"


def _interval(value: float, low: float, high: float, signed: bool = False) -> str:
    number = f"{value:+.3f}" if signed else f"{value:.3f}"
    return f"{number} [{low:.3f}, {high:.3f}]"


def table_rows(result) -> list[dict[str, str]]:
    """One dict per checkpoint: column title -> cell text."""
    rows = []
    for r in result.checkpoints:
        row = {
            "checkpoint": r.checkpoint,
            "n": str(r.n),
            "greedy acc [95% CI]": _interval(r.accuracy, r.ci_low, r.ci_high),
            "Δ vs first [95% CI]": "—" if r.diff_vs_first is None else _interval(**_diff_args(r.diff_vs_first)),
        }
        row |= {f"pass@{k}": _rate(v) for k, v in r.pass_at_k.items()}
        if r.maj_at_k is not None:
            row[f"maj@{result.settings.samples}"] = _rate(r.maj_at_k)
        row |= {
            "tokens": f"{r.mean_tokens:.1f}",
            "truncated": f"{r.truncated:.0%}",
            "compl/s": f"{r.completions_per_s:.2f}",
            "verifier failures": str(sum(r.verifier_failures.values())),
        }
        rows.append(row)
    return rows


def _diff_args(diff: dict) -> dict:
    return {"value": diff["diff"], "low": diff["ci_low"], "high": diff["ci_high"], "signed": True}


def format_table(result) -> str:
    """The per-checkpoint table as aligned text (first column left-aligned, the others right-aligned)."""
    rows = table_rows(result)
    titles = list(dict.fromkeys(title for row in rows for title in row))
    widths = {t: max(len(t), *(len(row.get(t, "")) for row in rows)) for t in titles}

    def line(cells: dict[str, str]) -> str:
        first, *rest = titles
        parts = [cells.get(first, "").ljust(widths[first])] + [cells.get(t, "").rjust(widths[t]) for t in rest]
        return "  ".join(parts).rstrip()

    header = f"{result.task['name']} ({result.task['verifier']} verifier), seed {result.settings.seed}"
    return "\n".join([header, line({t: t for t in titles}), *(line(row) for row in rows)])
