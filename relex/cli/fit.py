"""`relex fit`: parse the options and call the library."""


def add_arguments(parser):
    from relex.cli.common import add_fit_options

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
    from relex.cli.common import console, fit_config_from
    from relex.distributed import fit_across_ranks
    from relex.fit import fit_store, refit
    from relex.io.atomic import check_output, write_lock
    from relex.ranks import launched
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(args.store)
    inputs = [store.path, store.base_dir, args.gram_from]
    check_output(args.out, overwrite=args.overwrite, inputs=inputs)  # before the pass, not after it
    if launched():  # under torchrun: the ranks share the pass, rank 0 writes and reports (relex.distributed)
        result = fit_across_ranks(store, fit_config_from(args), args.out, overwrite=args.overwrite, inputs=inputs, gram_from=args.gram_from)
        if result is not None:
            print_fit_summary(result)
            console.print(f"fit written to {args.out} (diagnostics.csv per tensor)")
        return
    with write_lock(args.out):
        config = fit_config_from(args)
        result = refit(store, config, args.gram_from) if args.gram_from else fit_store(store, config)
        result.save(args.out, overwrite=args.overwrite, inputs=inputs)
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
