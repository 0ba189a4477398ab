"""`relex plot trajectory|variance|accuracy|rewards|jumps`: parse the options, call `relex.plot`, say where the PNG is."""

from relex import plot
from relex.accelerate.figures import plot_jumps
from relex.cli import add_verbose
from relex.errors import RelexError
from relex.fit import FitResult
from relex.present import show
from relex.store import TrajectoryStore
from relex.util import comma_list


def _names(text):
    return comma_list(text) or None


def add_arguments(parser):
    kinds = parser.add_subparsers(dest="figure", metavar="FIGURE", required=True)
    trajectory = kinds.add_parser("trajectory", help="rank-1 coefficient against the step, fitted line, held-out steps")
    trajectory.add_argument("store", help="the trajectory store the fit was made from")
    trajectory.add_argument("--fit", required=True, help="a FIT folder from relex fit")
    chosen = trajectory.add_mutually_exclusive_group()
    chosen.add_argument("--tensors", default=None, help="comma-separated tensor names (default: one per module type of the middle layer)")
    chosen.add_argument("--module-types", default=None, help="comma-separated module types, e.g. mlp.up_proj.weight,self_attn.q_proj.weight")
    trajectory.add_argument("--max", type=int, default=6, help="at most this many tensors (default 6)")
    trajectory.add_argument("--extend-to", type=float, default=None, help="draw the fitted line up to this step (default: 15%% past the last recorded)")
    variance = kinds.add_parser("variance", help="explained variance and temporal R² per module type")
    variance.add_argument("fit", help="a FIT folder from relex fit")
    accuracy = kinds.add_parser("accuracy", help="accuracy against step of evaluated checkpoints, with 95%% intervals")
    accuracy.add_argument("summaries", nargs="+", metavar="EVAL_SUMMARY", help="summary.json files written by relex eval")
    accuracy.add_argument("--title", default=None)
    rewards = kinds.add_parser("rewards", help="the training reward curve of a run")
    rewards.add_argument("run", help="a run folder with log.jsonl (from relex train), or the log file")
    rewards.add_argument("--window", type=int, default=None, help="moving-average window in steps (default: a tenth of the run)")
    jumps = kinds.add_parser("jumps", help="validation accuracy against GRPO steps of relex accelerate runs, jumps marked")
    jumps.add_argument("runs", nargs="+", metavar="RUN", help="run folders of relex accelerate (one with --no-jump is the plain control)")
    jumps.add_argument("--title", default=None)
    for sub in (trajectory, variance, accuracy, rewards, jumps):
        sub.add_argument("--out", required=True, help="the PNG file to write")
        add_verbose(sub)


def trajectory(args):
    if args.max < 1:
        raise RelexError(f"--max {args.max}: plot at least one tensor")
    return plot.plot_trajectory(
        TrajectoryStore.open(args.store), FitResult.load(args.fit), args.out, tensors=_names(args.tensors),
        module_types=_names(args.module_types), max_tensors=args.max, extend_to=args.extend_to,
    )


FIGURES = {
    "trajectory": trajectory,
    "variance": lambda args: plot.plot_variance(FitResult.load(args.fit), args.out),
    "accuracy": lambda args: plot.plot_accuracy(args.summaries, args.out, title=args.title),
    "rewards": lambda args: plot.plot_rewards(args.run, args.out, window=args.window),
    "jumps": lambda args: plot_jumps(args.runs, args.out, title=args.title),
}


def run(args):
    show(f"figure written to {FIGURES[args.figure](args)}")
