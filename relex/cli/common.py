"""Options shared by the subcommands (their output goes through relex.present)."""

from __future__ import annotations

import argparse
from pathlib import Path

from relex.errors import RelexError
from relex.fit import FitConfig


def add_fit_options(parser: argparse.ArgumentParser, *, observe_until_required: bool = False) -> None:
    group = parser.add_argument_group("fit (the recipe, saved with a fit)")
    group.add_argument("--rank", type=int, default=None, help="directions per tensor (default 1)")
    group.add_argument("--temporal", default=None, help="temporal model: linear (default), poly, robust")
    group.add_argument("--degree", type=int, default=None, help="degree of the poly temporal model (default 2)")
    group.add_argument("--window", type=int, default=None, help="the temporal model sees the last N observed steps (default: all)")
    if observe_until_required:
        group.add_argument("--observe-until", type=int, required=True, metavar="S", help="the last recorded step the fit may see")
    else:
        group.add_argument("--observe-until", type=int, default=None, metavar="S", help="use only recorded steps ≤ this (default: all)")
    group = parser.add_argument_group("how it runs (never saved: a fit made on a GPU extrapolates on a CPU)")
    group.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    group.add_argument(
        "--io", default="auto", choices=["auto", "direct", "cached"],
        help="reading the store: direct bypasses the page cache (O_DIRECT), for stores larger than RAM; "
        "cached goes through it; auto (default) picks direct when the store is larger than the memory available",
    )


def run_config_file(args: argparse.Namespace):
    """`--config`, or with `--resume --out RUN` the run's own RUN/config.yaml (relex train and relex accelerate)."""
    if args.config is not None:
        return args.config
    if not (args.resume and args.out):
        raise RelexError("give --config FILE (or --resume --out RUN to continue a run with its own config)")
    return Path(args.out) / "config.yaml"


RECIPE_FLAGS = ("rank", "temporal", "degree", "window", "observe_until")


def recipe_flags_given(args: argparse.Namespace) -> list[str]:
    """The recipe flags given on the command line (a saved fit already fixes them)."""
    return ["--" + name.replace("_", "-") for name in RECIPE_FLAGS if getattr(args, name, None) is not None]


def fit_config_from(args: argparse.Namespace) -> FitConfig:
    return FitConfig(
        rank=1 if args.rank is None else args.rank,
        temporal="linear" if args.temporal is None else args.temporal,
        degree=args.degree,
        window=args.window,
        observe_until=args.observe_until,
        device=args.device,
        io=args.io,
    )
