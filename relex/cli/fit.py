"""`relex fit STORE --out FIT`: parse the options, call `relex.fit.fit_store` (or `refit`), show the fit's table."""

from relex.cli.common import add_fit_options, fit_config_from
from relex.distributed import fit_across_ranks
from relex.fit import fit_store, refit
from relex.io.atomic import check_output, write_lock
from relex.present import fit_table, show
from relex.ranks import launched
from relex.store import TrajectoryStore


def add_arguments(parser):
    parser.add_argument("store", help="a trajectory store (from relex ingest or relex train)")
    parser.add_argument("--out", required=True, help="the FIT folder to write")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing FIT once the new one is complete (never the store, its base or --gram-from)",
    )
    parser.add_argument(
        "--gram-from", default=None, metavar="FIT",
        help="refit from the Gram matrices of an earlier fit over the same steps (other rank, temporal model or window; no pass over the store)",
    )
    add_fit_options(parser)


def run(args):
    config = fit_config_from(args)
    store = TrajectoryStore.open(args.store)
    inputs = [store.path, store.base_dir, args.gram_from]
    check_output(args.out, overwrite=args.overwrite, inputs=inputs)  # before the pass, not after it
    if launched():  # under torchrun: the ranks share the pass, rank 0 writes and reports (relex.distributed)
        result = fit_across_ranks(store, config, args.out, overwrite=args.overwrite, inputs=inputs, gram_from=args.gram_from)
        if result is None:
            return
    else:
        with write_lock(args.out):
            result = refit(store, config, args.gram_from) if args.gram_from else fit_store(store, config)
            result.save(args.out, overwrite=args.overwrite, inputs=inputs)
    show(fit_table(result), f"fit written to {args.out} (diagnostics.csv per tensor)")
