"""`relex backtest`: parse the options and call the library."""

from relex.util import comma_list


def add_arguments(parser):
    from relex.cli.common import add_fit_options

    parser.add_argument("store", help="a trajectory store")
    parser.add_argument("--methods", default="relex,two-point,per-param", help="comma-separated methods to compare")
    parser.add_argument("--out", default=None, help="write the full result as JSON here")
    parser.add_argument("--gram-from", default=None, metavar="FIT", help="reuse the Gram matrices of a fit over all recorded steps (no pass over the store)")
    add_fit_options(parser, observe_until_required=True)


def run(args):
    from relex.backtest import backtest_store
    from relex.cli.common import console, fit_config_from, table
    from relex.distributed import backtest_across_ranks
    from relex.errors import RelexError
    from relex.io.atomic import check_output, refuse_inputs
    from relex.ranks import launched
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(args.store)
    if args.out:  # refused before the pass over the store: a folder, or the store or its base itself
        check_output(args.out, overwrite=True, folder=False)
        refuse_inputs(args.out, [store.path, store.base_dir])
    config = fit_config_from(args)
    until, config.observe_until = config.observe_until, None
    grams = None
    if args.gram_from:
        from relex.fit import FitResult

        previous = FitResult.load(args.gram_from)
        if previous.steps.tolist() != store.steps:
            raise RelexError(f"{args.gram_from}: its Gram covers steps {previous.steps.tolist()[:3]}…, not all {len(store.steps)} recorded steps")
        grams = previous.grams
    methods = comma_list(args.methods)
    if launched() and grams is None:  # under torchrun: the ranks share the Gram pass, rank 0 reports (relex.distributed)
        result = backtest_across_ranks(store, until, methods, config)
        if result is None:
            return
    else:
        result = backtest_store(store, until, methods, config, grams)
    shown = result.later if len(result.later) <= 8 else result.later[:: max(1, len(result.later) // 8)] + [result.later[-1]]
    shown = sorted(set(shown))
    rows = [[m] + [result.relative_error(m, s) for s in shown] for m in result.methods]
    console.print(table(f"relative error ‖Δ̂ − Δ‖/‖Δ‖, fit on steps ≤ {until} ({len(result.observed)} observed)", ["method"] + [f"step {s}" for s in shown], rows))
    last = result.later[-1]
    drift = result.drift_by_module_type()
    rows = [[g] + [result.relative_error(m, last, g) for m in result.methods] + [drift.get(g, float("nan"))] for g in result.module_types()]
    console.print(table(f"at step {last}, by module type", ["module type"] + result.methods + ["drift |cos|"], rows))
    if args.out:
        result.save(args.out)
        console.print(f"backtest written to {args.out}")
