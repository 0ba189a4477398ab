"""`relex fit`: parse the options and call the library."""


def add_arguments(parser):
    from relex.cli.common import add_fit_options

    parser.add_argument("store", help="a trajectory store (from relex ingest or relex train)")
    parser.add_argument("--out", required=True, help="the FIT folder to write")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--gram-from", default=None, metavar="FIT",
        help="refit from the Gram matrices of an earlier fit over the same steps (other rank, temporal model or window; no pass over the store)",
    )
    add_fit_options(parser)


def run(args):
    from pathlib import Path

    from relex.cli.common import console, fit_config_from
    from relex.errors import RelexError
    from relex.fit import fit_store, refit
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(args.store)
    if Path(args.out).exists() and not args.overwrite:
        raise RelexError(f"{args.out}: exists; pass --overwrite to replace it")
    config = fit_config_from(args)
    result = refit(store, config, args.gram_from) if args.gram_from else fit_store(store, config)
    result.save(args.out, overwrite=args.overwrite)
    print_fit_summary(result)
    console.print(f"fit written to {args.out} (diagnostics.csv per tensor)")


def print_fit_summary(result):
    from relex.cli.common import console, table

    rows = [
        [r["module_type"], r["tensors"], r["median_explained_variance"], r["share_ev_ge_0.9"], r["median_r2"]]
        for r in result.summary_by_module_type()
    ]
    title = f"rank-{result.config.rank} fit over steps {result.steps[0]}..{result.steps[-1]} ({len(result.steps)} observed), temporal {result.config.temporal}"
    console.print(table(title, ["module type", "tensors", f"median EV(r={result.config.rank})", "share EV≥0.9", "median R²"], rows))
