"""`relex accelerate --config FILE --out RUN`: GRPO segments alternating with guarded jumps; flags override the file.

Parse the options, call `relex.accelerate.run_accelerate`, show the run's jump decisions.
"""

from relex.accelerate import run_accelerate
from relex.accelerate.loop import read_jumps
from relex.accelerate.run import accelerate_config
from relex.cli.common import run_config_file
from relex.errors import RelexError
from relex.present import jumps_table, show
from relex.train import load_config
from relex.util import comma_list


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML train config with an optional `accelerate:` section (e.g. configs/tiny.yaml); with --resume, default RUN/config.yaml")
    parser.add_argument("--out", metavar="RUN", help="run folder; overrides `out`")
    parser.add_argument("--max-steps", type=int, help="GRPO optimizer steps in all (jumps are not steps); overrides grpo.max_steps")
    group = parser.add_argument_group("the loop (each overrides the accelerate: section)")
    group.add_argument("--segment-steps", type=int, metavar="M", help="GRPO steps per segment, a jump decision after each (default 4)")
    group.add_argument("--alphas", metavar="A,B", help="candidate horizons as multiples of the segment, each > 1 (default 1.5,2,3)")
    group.add_argument("--scales", metavar="L,..", help="λ: shrink of the displacement beyond the segment's end, each > 0 (default 1)")
    group.add_argument("--methods", metavar="M,..", help="extrapolation methods of the candidates (default relex-anchored,relex)")
    group.add_argument("--keep", metavar="TYPES", help="module types copied from the segment's end instead of extrapolated, e.g. '*norm.weight'")
    group.add_argument("--optimizer", help="optimizer state after a jump: reset (default), keep or rescale")
    group.add_argument("--validation-size", type=int, metavar="N", help="validation problems, disjoint from train and test (default 64)")
    group.add_argument("--margin", type=float, help="largest loss the paired interval may leave open for a jump (default 0.05)")
    group.add_argument("--min-gain", type=float, help="validation gain a jump needs over the current weights (default 0.01)")
    group.add_argument("--no-jump", action="store_true", help="run the same loop and validation but never jump (the plain control)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint (needs record.resumable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log.jsonl is still written)")


def _list(text, cast, flag):
    if text is None:
        return None
    try:
        values = [cast(part) for part in comma_list(text)]
    except ValueError:
        raise RelexError(f"{flag} {text!r}: give comma-separated values like 1.5,2,3") from None
    if not values:
        raise RelexError(f"{flag} {text!r}: give at least one value")
    return values


def run(args) -> int:
    config = load_config(run_config_file(args), out=args.out, max_steps=args.max_steps)
    accelerate = accelerate_config(
        config, segment_steps=args.segment_steps, alphas=_list(args.alphas, float, "--alphas"),
        scales=_list(args.scales, float, "--scales"), methods=_list(args.methods, str, "--methods"),
        keep=_list(args.keep, str, "--keep"),  # an empty list is refused there, in one line
        optimizer=args.optimizer, validation_size=args.validation_size, margin=args.margin, min_gain=args.min_gain,
        jump=False if args.no_jump else None,
    )
    run_dir = run_accelerate(config, accelerate, resume=args.resume, show_progress=not args.no_progress)
    show(jumps_table(read_jumps(run_dir), f"jump decisions in {run_dir}"),
         f"run written to {run_dir} (jumps: {run_dir / 'jumps.jsonl'}, final weights: {run_dir / 'final'})")
    return 0
