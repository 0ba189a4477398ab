"""`relex accelerate --config FILE --out RUN`: GRPO segments alternating with guarded jumps; flags override the file.

Parse the options, call `relex.accelerate.run_accelerate`, show the run's jump decisions.
"""

from relex import settings
from relex.accelerate import AccelerateConfig, run_accelerate
from relex.accelerate.loop import read_jumps
from relex.accelerate.run import accelerate_config
from relex.cli.common import run_config_file
from relex.present import jumps_table, show
from relex.train import load_config

# the `accelerate:` settings that have a flag (the warning section and the validation batch are set in the file)
LOOP_FLAGS = ["segment_steps", "alphas", "scales", "methods", "keep", "optimizer", "validation_size", "confirm_size",
              "margin", "min_gain", "jump", "rollback"]


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML train config with an optional `accelerate:` section (e.g. configs/tiny.yaml); with --resume, default RUN/config.yaml")
    parser.add_argument("--out", metavar="RUN", help="run folder; overrides `out`")
    parser.add_argument("--max-steps", type=int, help="GRPO optimizer steps in all (jumps are not steps); overrides grpo.max_steps")
    group = parser.add_argument_group("the loop (each overrides the accelerate: section)")
    settings.add_arguments(group, AccelerateConfig, only=LOOP_FLAGS)
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint (needs record.resumable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log.jsonl is still written)")


def run(args) -> int:
    config = load_config(run_config_file(args), out=args.out, max_steps=args.max_steps)
    accelerate = accelerate_config(config, **settings.overrides(args, AccelerateConfig, only=LOOP_FLAGS))
    run_dir = run_accelerate(config, accelerate, resume=args.resume, show_progress=not args.no_progress)
    show(jumps_table(read_jumps(run_dir), f"jump decisions in {run_dir}"),
         f"run written to {run_dir} (jumps: {run_dir / 'jumps.jsonl'}, final weights: {run_dir / 'final'})")
    return 0
