"""Benchmark: what a process waits for before its first CPU product, numba's JIT against the kernels compiled ahead
of time (relex.fit.native).

Each way runs in fresh processes, alternating, after torch is imported (every relex command imports it first):
  numba     import relex.fit.gram_kernel (numba and its NumPy implementations) and call each of the five
            kernels once on tiny arrays, which loads their machine code from numba's own cache;
  compiled  relex.fit.native.load() (llvmlite's JIT linker on the kept object file) and the same five calls.
Both caches are filled before the first timed round, so neither compiles. Prints each round, the medians and
their ratio.

    .venv/bin/python scripts/bench_kernel_load.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

# the five calls, on arrays too small to time: what each way must have ready before a pass's first product
CALLS = """
import os, numpy as np
from types import SimpleNamespace
from relex.store import TensorFiles
m, g, w = np.ones((5, 3), np.float32), np.zeros((5, 5)), np.ones((2, 5), np.float32)
fd = os.open(os.devnull, os.O_RDONLY)
files = TensorFiles.of_segments("trial", 3, [[(SimpleNamespace(descriptor=fd), 0, 3)]], [0], [0], None)
"""

WAYS = {
    "numba": CALLS + """
started = time.perf_counter()
from relex.fit import gram_kernel as k
from relex.fit.native import ENTRIES, SUM_PIECE, read_piece_columns
piece = read_piece_columns(1)
rows, base_row, half = np.empty((1, piece), np.float32), np.empty(piece, np.float32), np.empty(piece, np.uint16)
sa, sb, tile = np.empty(SUM_PIECE, np.float32), np.empty(SUM_PIECE, np.float32), np.empty(16, np.float32)
k._lower(m, g, 0, 3, 4096, tile)
k._sums(w, m, np.zeros((2, 3), np.float32), 0, 3, SUM_PIECE, sa, sb)
located = (files.descriptors, files.offsets, files.bounds, files.dtypes, files.subtract, -1, 0, 0)
k._file_lower(*located, 3, piece, 4, np.zeros((1, 1)), rows, base_row, half, tile)
k._file_sums(np.ones((2, 1), np.float32), np.zeros(0, np.float32), *located, 0, 3, piece, np.zeros((2, 3), np.float32),
             np.zeros((0, 2)), rows, base_row, half, sa, sb)
k._round_half(np.ones(4, np.float32), np.empty(4, np.uint16), 1)
""",
    "compiled": CALLS + """
started = time.perf_counter()
from relex.fit import native
k = native.load()
k.accumulate(m, g)
k.weighted_sums(w, m, np.zeros((2, 3), np.float32))
k.file_gram(files, np.zeros((1, 1)))
k.file_sums(np.ones((2, 1), np.float32), files, np.zeros((2, 3), np.float32))
k.round_half(np.ones(4, np.float32), np.empty(4, np.uint16), 1)
""",
}


def run(way: str) -> dict:
    code = "import time, json, sys, torch\n" + WAYS[way] + (
        "print(json.dumps({'seconds': time.perf_counter() - started, 'numba': 'numba' in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{way}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for way in WAYS:  # fill both caches: numba's and the kept object
        run(way)
    seconds = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS:
            result = run(way)
            seconds[way].append(result["seconds"])
            print(f"round {round_ + 1}  {way:8s} {result['seconds']:6.3f} s  (numba imported: {result['numba']})")
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    print(f"median: numba {medians['numba']:.3f} s, compiled {medians['compiled']:.3f} s; "
          f"numba / compiled: {medians['numba'] / medians['compiled']:.1f}x")


if __name__ == "__main__":
    main()
