"""`relex demo [--quick] [--out DIR]`: parse the options, call `relex.demo.run_demo`, show its tables."""

from relex.demo import DEFAULT, DEMO_CONFIG, QUICK, run_demo
from relex.present import show


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="about 5 minutes: fewer steps, rollouts, problems and tokens")
    parser.add_argument("--out", default=None, help="run folder (default runs/demo, or runs/demo-quick with --quick)")
    parser.add_argument("--config", default=None, help="training config (default: the packaged configs/smollm2-arithmetic.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run folder of an earlier demo")


def run(args):
    out = args.out or ("runs/demo-quick" if args.quick else "runs/demo")
    result = run_demo(QUICK if args.quick else DEFAULT, out, config_file=args.config or DEMO_CONFIG, overwrite=args.overwrite)
    show(*result.tables())
