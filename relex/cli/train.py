"""`relex train --config FILE`: a GRPO run that records its trajectory; flags override the file."""

from relex.cli.common import run_config_file
from relex.present import show
from relex.train import load_config, run_training
from relex.train.grpo import is_main_process


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML train config (e.g. configs/tiny.yaml); with --resume, default RUN/config.yaml")
    parser.add_argument("--out", metavar="RUN", help="run folder (config.yaml, log.jsonl, trajectory/); overrides `out`")
    parser.add_argument("--max-steps", type=int, help="optimizer steps; overrides grpo.max_steps")
    parser.add_argument("--record-every", type=int, metavar="K", help="record θ − θ₀ every K steps; overrides record.every")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log.jsonl is still written)")


def run(args) -> int:
    config = load_config(run_config_file(args), out=args.out, max_steps=args.max_steps, record_every=args.record_every)
    run_dir = run_training(config, resume=args.resume, show_progress=not args.no_progress)
    if is_main_process():  # under accelerate launch or torchrun: once, not once per rank
        show(f"run written to {run_dir} (trajectory store: {run_dir / 'trajectory'}, log: {run_dir / 'log.jsonl'})")
    return 0
