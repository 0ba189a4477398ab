"""The `relex` command line: one thin module per subcommand.

Each module in this package defines `add_arguments(parser)` and `run(args)`; `run` validates its input, calls
one library function and shows what it returns through `relex.present` (tables and lines on stdout). Only the
module of the subcommand being run is imported. A `RelexError` (or a hub that cannot be
reached) becomes a one-line message and exit status 2, with no traceback. `relex` alone lists the commands; `-v`
works before or after the subcommand.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import logging
import os
import sys

from relex import __version__
from relex.errors import RelexError
from relex.models import hub_failure

# subcommand (= module in relex.cli) -> one-line help
COMMANDS = {
    "demo": "Run the whole pipeline on the embedded SmolLM2-135M: warmup, fit, extrapolate, evaluate, plot, report.",
    "train": "Run a GRPO warmup with verifiable rewards, recording parameter deltas into a trajectory store.",
    "accelerate": "Alternate GRPO segments with extrapolation jumps, each guarded by a paired validation score.",
    "ingest": "Make a trajectory store from a run's checkpoints (HF Trainer, verl, or plain folders with --steps).",
    "fit": "Fit each tensor's rank-r trajectory direction and its growth in the step number.",
    "extrapolate": "Write Hugging Face checkpoints at target steps (relex, reconstruct, observed, two-point, per-param).",
    "backtest": "Fit on an observed prefix, predict later observed steps, and report errors and direction drift.",
    "eval": "Score checkpoints with a task's verifier on held-out problems (pass@1 with intervals, pass@k, maj@k).",
    "sweep": "Extrapolate to several horizons, evaluate each on a validation split, and recommend a target step.",
    "plot": "Draw trajectory, variance, accuracy and reward figures as PNG files.",
    "report": "Write a Markdown report of a run: config, rewards, fit diagnostics, backtest and evaluation.",
}


def _load(name: str):
    return importlib.import_module(f"relex.cli.{name}")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """`-v` after a subcommand too; SUPPRESS keeps a parser that did not see it from resetting the one given before."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad option ends in relex's one error line (naming --help) instead of the usage block."""

    def error(self, message: str):
        raise RelexError(f"{message} (`{self.prog} --help` lists the options)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="relex", description="Record, fit and extrapolate RLVR weight trajectories.")
    parser.add_argument("--version", action="version", version=f"relex {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        add_verbose(command)
        if name == only:
            _load(name).add_arguments(command)
    return parser


class OnceFilter(logging.Filter):
    """Lets each distinct warning through once: a message repeated on every call says nothing new."""

    def __init__(self):
        super().__init__()
        self._seen: set[tuple] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage())
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def quiet_when_piped() -> None:
    """No progress bars when stderr is not a terminal, so piped logs and CI output get no carriage-return frames.

    tqdm reads TQDM_* defaults when it is first imported, which the subcommands do lazily, after this; it reaches
    the bars of transformers, TRL and huggingface_hub as well as relex's own.
    """
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def error_line(text: str) -> None:
    """One line on stderr, written with one call: under torchrun every rank prints its line into the same pipe,
    and a line written in two parts (text, then newline) can run into another rank's."""
    sys.stderr.write(text.replace("  ", " ") + "\n")
    sys.stderr.flush()


# At exit CPython's collector walks every object it tracks except the frozen ones: after a command that imported
# torch, 1.2 of the 1.4 s between `main` returning and the process ending (`relex fit` on the SmolLM2 store, here).
# Freezing them first skips that walk. The process is ending, and relex closes its files and locks itself.
atexit.register(gc.freeze)


@contextlib.contextmanager
def collector_for_one_command():
    """Python's cyclic garbage collector around one command: off while the command's modules are imported (torch
    and the rest set off some 450 collections, 0.3 s, with next to nothing to collect), then on again with what was
    imported frozen (`imported()`), so that the full collections a pass's allocations trigger do not walk torch's
    object graph each time (0.4 s of CPU in an extrapolate on SmolLM2 shapes); all unfrozen when the command ends."""
    enabled = gc.isenabled()
    gc.disable()

    def imported() -> None:
        gc.freeze()
        if enabled:
            gc.enable()

    try:
        yield imported
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if not argv or argv in (["-v"], ["--verbose"]):  # `relex` alone: the list of commands, not an error
        build_parser().print_help()
        return 0
    try:
        with collector_for_one_command() as imported:
            return _run_command(argv, command, imported)
    except RelexError as error:
        error_line(f"relex {command or ''}: error: {error}")
        return 2
    except Exception as error:
        message = hub_failure(error)  # the hub unreachable or a repository missing: one line, not 40 of traceback
        if message is None:
            raise
        error_line(f"relex {command or ''}: error: {message}")
        return 2
    except KeyboardInterrupt:
        print("relex: interrupted", file=sys.stderr)
        return 130


def _run_command(argv: list[str], command: str | None, imported) -> int:
    parser = build_parser(only=command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.captureWarnings(True)  # library deprecation warnings go through the log, and so appear once
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, OnceFilter) for f in handler.filters):
            handler.addFilter(OnceFilter())
    quiet_when_piped()
    module = _load(args.command)
    imported()
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
