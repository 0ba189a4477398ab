"""`relex backtest STORE --observe-until S`: parse the options, call `relex.backtest.backtest_store`, show its tables."""

import dataclasses

from relex.backtest import backtest_store, grams_of_fit
from relex.cli.common import add_fit_options, fit_config_from
from relex.distributed import backtest_across_ranks
from relex.io.atomic import check_output, refuse_inputs
from relex.present import backtest_tables, show
from relex.ranks import launched
from relex.store import TrajectoryStore
from relex.util import comma_list


def add_arguments(parser):
    parser.add_argument("store", help="a trajectory store")
    parser.add_argument("--methods", default="relex,two-point,per-param", help="comma-separated methods to compare")
    parser.add_argument("--out", default=None, help="write the full result as JSON here")
    parser.add_argument("--gram-from", default=None, metavar="FIT", help="reuse the Gram matrices of a fit over all recorded steps (no pass over the store)")
    add_fit_options(parser, observe_until_required=True)


def run(args):
    store = TrajectoryStore.open(args.store)
    if args.out:  # refused before the pass over the store: a folder, or the store or its base itself
        check_output(args.out, overwrite=True, folder=False)
        refuse_inputs(args.out, [store.path, store.base_dir])
    config = dataclasses.replace(fit_config_from(args), observe_until=None)  # the prefix is backtest's own argument
    grams = grams_of_fit(args.gram_from, store) if args.gram_from else None
    methods = comma_list(args.methods)
    if launched() and grams is None:  # under torchrun: the ranks share the Gram pass, rank 0 reports (relex.distributed)
        result = backtest_across_ranks(store, args.observe_until, methods, config)
        if result is None:
            return
    else:
        result = backtest_store(store, args.observe_until, methods, config, grams)
    show(*backtest_tables(result.to_dict()))
    if args.out:
        result.save(args.out)
        show(f"backtest written to {args.out}")
