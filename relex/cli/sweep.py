"""`relex sweep STORE --targets S1,S2,... --task NAME --out DIR`: parse the options, call `relex.sweep.sweep`, show
the validation accuracy of each target."""

import relex.sweep
from relex.cli.common import add_fit_options, fit_config_from
from relex.errors import RelexError
from relex.evaluate.config import parse_task_config, task_spec_from_file
from relex.extrapolate import parse_targets
from relex.present import show, sweep_table
from relex.sweep import SweepConfig
from relex.tasks.spec import task_spec_from_name


def add_arguments(parser):
    parser.add_argument("store", help="a trajectory store")
    parser.add_argument(
        "--targets", required=True,
        help="target steps to compare, e.g. 100,200,400; each is shown with its horizon ratio, target step / last "
        "observed step (both counted from the base)",
    )
    parser.add_argument("--task", default=None, help="chain_sum or reasoning_gym:NAME, FILE.jsonl, or hf:DATASET_ID")
    parser.add_argument("--task-file", default=None, metavar="FILE", help="YAML file with a `task:` mapping (e.g. the run's config.yaml)")
    parser.add_argument("--task-config", default=None, metavar="JSON|FILE", help="the task's config, inline JSON or a file")
    parser.add_argument("--n", type=int, default=64, help="validation problems (default 64; disjoint from the test problems)")
    parser.add_argument("--method", default="relex", help="extrapolation method (default relex)")
    parser.add_argument("--out", required=True, help="folder receiving fit/, checkpoints/, validation/ and sweep.json")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="completion length limit (default 512)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences generated together (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    parser.add_argument("--overwrite", action="store_true")
    add_fit_options(parser)


def task_from(args):
    if (args.task is None) == (args.task_file is None):
        raise RelexError("give --task NAME or --task-file FILE (one of them)")
    spec = task_spec_from_file(args.task_file) if args.task_file else task_spec_from_name(args.task)
    if args.task_config is not None:
        spec["config"] = parse_task_config(args.task_config)
    return spec


def run(args):
    config = SweepConfig(
        targets=parse_targets(args.targets), task=task_from(args), n=args.n, method=args.method, fit=fit_config_from(args),
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed, overwrite=args.overwrite,
    )
    result = relex.sweep.sweep(args.store, args.out, config)
    show(sweep_table(result, args.method, config.n),
         f"checkpoints in {result.out_dir / 'checkpoints'}, details in {result.out_dir / 'sweep.json'}")
