"""Benchmark: reading a store's files from storage through the page cache against O_DIRECT (relex's --io).

Takes the store `scripts/bench_fit.py` built (or any folder of files), drops its pages from the page cache, then
reads every file once, sequentially in 8 MiB requests, through the page cache and then with O_DIRECT, alternately,
and prints each run's wall time and the process's kernel (sys) CPU time, their medians and ratios. Linux only.

    .venv/bin/python scripts/bench_io.py [--folder /tmp/relex-bench/store-smollm2-135m-T20/deltas] [--repeats 2]
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import time
from pathlib import Path
from statistics import median

from bench_fit import evict  # scripts/ is on the path when a script there runs

PIECE = 8 * 2**20


def read_all(files: list[Path], direct: bool) -> tuple[float, float, int]:
    """(wall seconds, sys CPU seconds, bytes) of reading every file once."""
    buffer = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    before, started, total = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
    for path in files:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            offset = 0
            while True:
                got = os.preadv(fd, [buffer], offset)
                offset += got
                if got < PIECE:
                    break
            total += offset
        finally:
            os.close(fd)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter() - started, after.ru_stime - before.ru_stime, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default="/tmp/relex-bench/store-smollm2-135m-T20/deltas")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    files = sorted(p for p in Path(args.folder).rglob("*") if p.is_file())
    runs: dict[str, list[tuple[float, float]]] = {"page cache": [], "O_DIRECT": []}
    size = 0
    for _ in range(args.repeats):
        for label, direct in (("page cache", False), ("O_DIRECT", True)):
            evict(Path(args.folder))
            wall, sys_cpu, size = read_all(files, direct)
            runs[label].append((wall, sys_cpu))
    print(f"{len(files)} files, {size / 1e9:.2f} GB, page cache dropped before each run; median of {args.repeats}")
    medians = {}
    for label, values in runs.items():
        medians[label] = (median(w for w, _ in values), median(s for _, s in values))
        listed = ", ".join(f"{w:.2f} s / {s:.2f} s" for w, s in values)
        print(f"  {label:10s}  wall {medians[label][0]:6.2f} s   sys CPU {medians[label][1]:6.2f} s   (runs, wall / sys: {listed})")
    (wall_c, sys_c), (wall_d, sys_d) = medians["page cache"], medians["O_DIRECT"]
    print(f"  O_DIRECT / page cache: wall {wall_d / wall_c:.2f}, sys CPU {sys_d / max(sys_c, 1e-9):.2f}")


if __name__ == "__main__":
    main()
