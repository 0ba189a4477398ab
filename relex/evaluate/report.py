"""The outputs of an evaluation: its table (relex.present renders it), and `OUT/completions.jsonl` + `OUT/summary.json`.

The output folder is written through relex.io.atomic: under a hidden temporary name next to it, renamed into
place once complete, so an interrupted or failed evaluation never leaves a half-written folder behind.
"""

from __future__ import annotations

import json
from pathlib import Path

from relex.io.atomic import atomic_output, check_output
from relex.present import DASH, Table, interval, number, percent, text

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


def eval_table(result) -> Table:
    """The per-checkpoint table of an `EvalResult`: greedy accuracy with its interval and the paired difference with
    the first checkpoint, pass@k and maj@K when sampled, completion length, truncation, speed, verifier failures."""
    sampled = [f"pass@{k}" for k in result.checkpoints[0].pass_at_k] if result.checkpoints else []
    voted = [f"maj@{result.settings.samples}"] if any(r.maj_at_k is not None for r in result.checkpoints) else []
    columns = ["checkpoint", "n", "greedy acc [95% CI]", "Δ vs first [95% CI]", *sampled, *voted,
               "tokens", "truncated", "compl/s", "verifier failures"]
    title = f"{result.task['name']} ({result.task['verifier']} verifier), seed {result.settings.seed}"
    return Table(title, columns, [_row(r, bool(voted)) for r in result.checkpoints])


def _row(r, voted: bool) -> list:
    diff = r.diff_vs_first
    return [
        r.checkpoint, r.n, interval(r.accuracy, r.ci_low, r.ci_high),
        DASH if diff is None else interval(diff["diff"], diff["ci_low"], diff["ci_high"], signed=True),
        *r.pass_at_k.values(), *([r.maj_at_k] if voted else []),
        number(r.mean_tokens, 1), percent(r.truncated), number(r.completions_per_s, 2), sum(r.verifier_failures.values()),
    ]


def format_table(result) -> str:
    """The per-checkpoint table as aligned plain text (relex.present.text)."""
    return text(eval_table(result))
