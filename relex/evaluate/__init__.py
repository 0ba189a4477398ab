"""Evaluate checkpoints on a task's held-out problems: accuracy with intervals, pass@k, maj@k, paired differences.

    from relex.evaluate import evaluate, format_table
    result = evaluate(["runs/base", "runs/grpo/trajectory@40"], task, n=200, out_dir="runs/eval")
    print(format_table(result))

Modules: `generate` (completions from a checkpoint), `checkpoints` (what counts as a checkpoint, store steps),
`metrics` (bootstrap, pass@k, majority vote), `evaluation` (the loop), `report` (table and output files),
`config` (the `relex eval` configuration).
"""

from relex.evaluate.evaluation import (
    CheckpointResult,
    EvalResult,
    EvalSettings,
    evaluate,
)
from relex.evaluate.report import format_table

__all__ = ["CheckpointResult", "EvalResult", "EvalSettings", "evaluate", "format_table"]
