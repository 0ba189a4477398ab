"""Benchmark: how long a `relex` process takes to end once its command has returned.

At exit CPython's garbage collector walks every object it tracks except the frozen ones; after a command that
imported torch those are several hundred thousand. relex.cli freezes them at exit (`atexit.register(gc.freeze)`),
so that walk is skipped. This runs the given command alternately as shipped and with that freeze undone (an
`atexit` handler registered before relex.cli's runs after it, and unfreezes them, as before the change), and
prints, for each, the seconds from `relex.cli.main` returning to the process ending, and their ratio.

    .venv/bin/python scripts/bench_exit.py --repeats 5 -- fit /tmp/relex-bench-verl/store --out /tmp/fit --overwrite
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from statistics import median

CHILD = """
import atexit, gc, sys, time
if sys.argv[1] == "unfrozen":
    atexit.register(gc.unfreeze)  # registered before relex.cli's gc.freeze, so it runs after it
import relex.cli
code = relex.cli.main(sys.argv[2:])
sys.stderr.write(f"relex.cli.main returned at {time.time()!r}\\n")
sys.exit(code)
"""


def exit_seconds(mode: str, command: list[str]) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, *command], capture_output=True, text=True)
    ended = time.time()
    if done.returncode:
        raise SystemExit(f"relex {' '.join(command)}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    returned = float(done.stderr.strip().splitlines()[-1].rsplit(" ", 1)[1])
    return ended - returned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each mode, alternating; medians are reported")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="a relex command and its arguments, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a relex command after --, e.g. -- fit STORE --out DIR --overwrite")
    runs = {"frozen at exit (relex.cli)": [], "unfrozen at exit (before)": []}
    for _ in range(args.repeats):
        for label, mode in zip(runs, ("frozen", "unfrozen")):
            runs[label].append(exit_seconds(mode, command))
    print(f"relex {' '.join(command)}: seconds from relex.cli.main returning to the process's end, median of {args.repeats}")
    for label, seconds in runs.items():
        print(f"  {label:<28} {median(seconds):6.2f} s   (runs: {', '.join(f'{s:.2f}' for s in seconds)})")
    frozen, unfrozen = (median(s) for s in runs.values())
    print(f"  unfrozen / frozen: {unfrozen / frozen:.2f}; saved per command: {unfrozen - frozen:.2f} s")


if __name__ == "__main__":
    main()
