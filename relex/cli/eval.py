"""`relex eval CKPT [CKPT ...] --task NAME`: accuracy, pass@k and maj@k of checkpoints on held-out problems."""

from __future__ import annotations

from relex import settings
from relex.evaluate import EvalSettings, evaluate
from relex.evaluate.config import load_eval_config
from relex.evaluate.report import eval_table
from relex.present import show


def add_arguments(parser) -> None:
    parser.add_argument(
        "checkpoints", nargs="*", metavar="CKPT",
        help="model folders, hub ids, the alias smollm2-135m-instruct, or STORE@STEP (a step of a trajectory "
        "store); differences are reported against the first",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of eval settings (the flags below override it)")
    parser.add_argument(
        "--task", help="chain_sum or reasoning_gym:NAME (reasoning-gym), FILE.jsonl, or hf:DATASET_ID"
    )
    parser.add_argument("--task-file", metavar="FILE", help="YAML file with a `task:` mapping (e.g. a training config)")
    parser.add_argument(
        "--task-config", metavar="JSON|FILE",
        help='the task\'s config, inline JSON (e.g. \'{"min_terms": 2, "max_terms": 2}\') or a JSON/YAML file',
    )
    settings.add_arguments(parser, EvalSettings, only=["n", "samples", "temperature", "seed"])
    parser.add_argument("--out", metavar="DIR", help="output folder, new or empty (default runs/eval/TASK-TIME)")
    parser.add_argument("--overwrite", action="store_true", default=None, help="replace a non-empty output folder")
    settings.add_arguments(parser, EvalSettings, only=["backend", "batch_size", "max_new_tokens"])

def run(args) -> int:
    config = load_eval_config(
        args.config,
        task_file=args.task_file,
        task_config=args.task_config,
        checkpoints=args.checkpoints,
        task=args.task,
        out=args.out,
        overwrite=args.overwrite,
        **settings.overrides(args, EvalSettings),
    )
    config.validate()
    result = evaluate(
        config.checkpoints, config.task_spec(), **config.settings(),
        out_dir=config.out_dir(), overwrite=config.overwrite,
    )
    show(eval_table(result), f"completions and summary written to {result.out_dir}")
    return 0
