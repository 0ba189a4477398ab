"""Options and printing shared by the subcommands."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

console = Console(stderr=False, highlight=False)


def add_fit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fit")
    group.add_argument("--rank", type=int, default=1, help="directions per tensor (default 1)")
    group.add_argument("--temporal", default="linear", help="temporal model: linear (default), poly, robust")
    group.add_argument("--degree", type=int, default=None, help="degree of the poly temporal model (default 2)")
    group.add_argument("--window", type=int, default=None, help="the temporal model sees the last N observed steps (default: all)")
    group.add_argument("--observe-until", type=int, default=None, help="use only recorded steps ≤ this (default: all)")
    group.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    group.add_argument(
        "--io", default="auto", choices=["auto", "direct", "cached"],
        help="reading the store: direct bypasses the page cache (O_DIRECT), for stores larger than RAM; "
        "cached goes through it; auto (default) picks direct when the store is larger than the memory available",
    )


def fit_config_from(args: argparse.Namespace):
    from relex.fit import FitConfig

    return FitConfig(
        rank=args.rank,
        temporal=args.temporal,
        degree=args.degree,
        window=args.window,
        observe_until=args.observe_until,
        device=args.device,
        io=args.io,
    )


def table(title: str, columns: list[str], rows: list[list]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:
        out.add_row(*[fmt(v) for v in row])
    return out


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)
