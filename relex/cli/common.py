"""Options shared by the subcommands (their output goes through relex.present)."""

from __future__ import annotations

import argparse
from pathlib import Path

from relex import settings
from relex.errors import RelexError
from relex.fit import FitConfig
from relex.fit.fit import RECIPE
from relex.settings import load


def add_fit_options(parser: argparse.ArgumentParser, *, observe_until_required: bool = False) -> None:
    group = parser.add_argument_group("fit (the recipe, saved with a fit)")
    settings.add_arguments(group, FitConfig, only=[name for name in RECIPE if name != "observe_until"])
    if observe_until_required:
        group.add_argument("--observe-until", type=int, required=True, metavar="S", help="the last recorded step the fit may see")
    else:
        settings.add_arguments(group, FitConfig, only=["observe_until"])
    group = parser.add_argument_group("how it runs (never saved: a fit made on a GPU extrapolates on a CPU)")
    settings.add_arguments(group, FitConfig, only=["device", "io"])


def run_config_file(args: argparse.Namespace):
    """`--config`, or with `--resume --out RUN` the run's own RUN/config.yaml (relex train and relex accelerate)."""
    if args.config is not None:
        return args.config
    if not (args.resume and args.out):
        raise RelexError("give --config FILE (or --resume --out RUN to continue a run with its own config)")
    return Path(args.out) / "config.yaml"


def recipe_flags_given(args: argparse.Namespace) -> list[str]:
    """The recipe flags given on the command line (a saved fit already fixes them)."""
    return [settings.flag_name(name) for name in RECIPE if getattr(args, name, None) is not None]


def fit_config_from(args: argparse.Namespace) -> FitConfig:
    """The fit settings given on the command line, the rest at their defaults."""
    return load(FitConfig, settings.overrides(args, FitConfig, only=[*RECIPE, "device", "io"]), "fit")
