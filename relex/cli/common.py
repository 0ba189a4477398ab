"""Options and printing shared by the subcommands."""

from __future__ import annotations

import argparse

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

console = Console(stderr=False, highlight=False, soft_wrap=True)  # a message stays one line in a pipe


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
    from pathlib import Path

    from relex.errors import RelexError

    if args.config is not None:
        return args.config
    if not (args.resume and args.out):
        raise RelexError("give --config FILE (or --resume --out RUN to continue a run with its own config)")
    return Path(args.out) / "config.yaml"


RECIPE_FLAGS = ("rank", "temporal", "degree", "window", "observe_until")


def recipe_flags_given(args: argparse.Namespace) -> list[str]:
    """The recipe flags given on the command line (a saved fit already fixes them)."""
    return ["--" + name.replace("_", "-") for name in RECIPE_FLAGS if getattr(args, name, None) is not None]


def fit_config_from(args: argparse.Namespace):
    from relex.fit import FitConfig

    return FitConfig(
        rank=1 if args.rank is None else args.rank,
        temporal="linear" if args.temporal is None else args.temporal,
        degree=args.degree,
        window=args.window,
        observe_until=args.observe_until,
        device=args.device,
        io=args.io,
    )


def table(title: str, columns: list[str], rows: list[list], caption: str | None = None) -> "WholeTable":
    """A result table for `console.print`: the title on its own line, cells formatted by `fmt`, never cropped."""
    return WholeTable(title, columns, [[fmt(v) for v in row] for row in rows], caption)


class WholeTable:
    """A table that is never cut to `st…` and `0.…`: one wider than the output (a pipe is 80 columns) is printed as
    several, each repeating the first column. The title is a line of its own, so a narrow table does not squeeze it."""

    def __init__(self, title: str, columns: list[str], cells: list[list[str]], caption: str | None = None):
        self.title, self.columns, self.cells, self.caption = title, columns, cells, caption

    def __rich_console__(self, console, options):
        yield Text(self.title)
        widths = [max([cell_len(c)] + [cell_len(row[i]) for row in self.cells]) + 3 for i, c in enumerate(self.columns)]
        for part in column_groups(widths, options.max_width):
            yield self._part(part)
        if self.caption:
            yield Text(self.caption)

    def _part(self, indices: list[int]) -> Table:
        out = Table()
        for i in indices:
            out.add_column(self.columns[i], justify="left" if i == 0 else "right", no_wrap=True)
        for row in self.cells:
            out.add_row(*[row[i] for i in indices])
        return out


def column_groups(widths: list[int], max_width: int) -> list[list[int]]:
    """Column indices of the tables that fit `max_width` (drawn widths, borders included), each led by column 0."""
    groups, used = [[0]], widths[0] + 1
    for i, width in enumerate(widths[1:], start=1):
        if used + width > max_width and len(groups[-1]) > 1:
            groups.append([0])
            used = widths[0] + 1
        groups[-1].append(i)
        used += width
    return groups


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)
