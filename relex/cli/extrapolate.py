"""`relex extrapolate STORE --targets S,.. --out DIR`: parse the options, call `relex.extrapolate.extrapolate_store`,
show the checkpoints it wrote."""

from relex.cli.common import add_fit_options, fit_config_from, recipe_flags_given
from relex.distributed import extrapolate_across_ranks
from relex.errors import RelexError
from relex.extrapolate import ExtrapolateConfig, extrapolate_store, parse_targets
from relex.fit import FitResult
from relex.present import extrapolate_table, show
from relex.ranks import launched
from relex.store import TrajectoryStore
from relex.util import comma_list


def add_arguments(parser):
    parser.add_argument("store", help="a trajectory store")
    parser.add_argument(
        "--targets", required=True,
        help="target steps, e.g. 100,200,500; each is reported with its horizon ratio, target step / last observed step "
        "(both counted from the base, step 0: 2.0 is twice the observed run, ≤ 1 is interpolation)",
    )
    parser.add_argument("--out", required=True, help="folder receiving step-<S>/ for each target")
    parser.add_argument("--fit", default=None, help="a FIT folder from relex fit (default: fit now)")
    parser.add_argument("--method", default="relex", help="relex (default), relex-anchored, reconstruct, observed, two-point, per-param")
    parser.add_argument("--anchors", default=None, help="two-point: steps A,B (0 is the base; default 0,<last observed>)")
    parser.add_argument("--scale", type=float, default=1.0, metavar="λ",
                        help="multiply the displacement predicted beyond the last observed step by λ (default 1; "
                        "0.3-0.5 is the shrink that partly rescued plateaued runs elsewhere)")
    parser.add_argument("--keep", default=None, metavar="TYPES",
                        help="module types copied from the last observed step instead of extrapolated, comma-separated "
                        "fnmatch patterns, e.g. '*norm.weight'")
    parser.add_argument("--dtype", default=None, help="output dtype of float tensors (default: the base's)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest shard, as transformers reads it (default 5GB)")
    parser.add_argument("--overwrite", action="store_true")
    add_fit_options(parser)


def anchors_from(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        anchors = tuple(int(a) for a in comma_list(text))
    except ValueError:
        raise RelexError(f"cannot read --anchors {text!r}; give two steps like 0,40") from None
    if len(anchors) != 2:
        raise RelexError(f"--anchors takes two steps A,B, got {text!r}")
    return anchors


def saved_fit(args) -> FitResult | None:
    """The fit of --fit, which fixes the recipe: recipe flags beside it are refused, naming the command that refits."""
    if not args.fit:
        return None
    given = recipe_flags_given(args)
    if given:
        raise RelexError(
            f"{' '.join(given)} with --fit: the fit {args.fit} fixes its rank, temporal model and window; to change "
            f"them refit from its Gram matrices (relex fit {args.store} --gram-from {args.fit} {' '.join(given)} --out NEW_FIT)"
        )
    return FitResult.load(args.fit)


def run(args):
    store = TrajectoryStore.open(args.store)
    config = ExtrapolateConfig(
        targets=parse_targets(args.targets), method=args.method, fit=fit_config_from(args), anchors=anchors_from(args.anchors),
        dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
        scale=args.scale, keep=tuple(comma_list(args.keep)),
    )
    if args.keep is not None and not config.keep:
        raise RelexError(f"--keep {args.keep!r} names no module type; give patterns like '*norm.weight'")
    fit = saved_fit(args)
    if launched():  # under torchrun: each rank writes its share of the shards, rank 0 reports (relex.distributed)
        reports = extrapolate_across_ranks(store, args.out, config, fit)
        if reports is None:
            return
    else:
        reports = extrapolate_store(store, args.out, config, fit)
    show(extrapolate_table(reports, args.method, args.out))
