"""Benchmark: `relex fit` and `relex extrapolate` in one process against two torchrun ranks (gloo, CPU).

Builds (once, in --workdir, with scripts/bench_fit.py's builder) a store with a real model's tensor shapes and T
float32 steps, then times each command as a user runs it, whole (start-up, imports and torchrun's rendezvous
included), with the page cache of the store dropped before each run:

    1 process, 1 thread      OMP_NUM_THREADS=1 relex ...           (the baseline the outputs are identical to)
    1 process, 2 threads     relex ...                             (torch's default on this machine)
    2 ranks, 1 thread each   OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m relex ...

It prints the start-up time of each launcher alone, the median wall time of each command, the speed-up of two
ranks over each single process, and whether the two-rank output is byte-identical to the one-thread process's.

    .venv/bin/python scripts/bench_distributed.py --workdir /tmp/relex-bench-dist [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
RELEX = [sys.executable, "-m", "relex"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "relex"]
SETUPS = {  # label -> (launcher, OMP_NUM_THREADS or None for torch's default)
    "1 process, 1 thread": (RELEX, "1"),
    "1 process, 2 threads": (RELEX, None),
    "2 ranks, 1 thread each": (TORCHRUN, "1"),
}


def bench_fit_module():
    spec = importlib.util.spec_from_file_location("bench_fit", HERE / "bench_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(command: list[str], threads: str | None) -> float:
    env = {**os.environ, "TQDM_DISABLE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return seconds


def same_tree(one: Path, two: Path) -> bool:
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(one / f, two / f, shallow=False) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/relex-bench-dist")
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-shard-size", default="100MB", help="extrapolate's shards, the unit split across ranks")
    args = parser.parse_args()
    bench_fit = bench_fit_module()
    workdir = Path(args.workdir)
    store = bench_fit.build(workdir, args.shape, args.steps)
    size = sum(f.stat().st_size for f in (store / "deltas").iterdir())
    last = max(int(p.stem.split("-")[1]) for p in (store / "deltas").iterdir())
    commands = {
        "fit": lambda out: ["fit", str(store), "--out", str(out), "--io", "cached"],
        "extrapolate": lambda out: ["extrapolate", str(store), "--targets", f"{2 * last},{5 * last}", "--out", str(out),
                                    "--max-shard-size", args.max_shard_size, "--io", "cached"],
    }
    print(f"store: {args.shape} shapes, T={args.steps} float32 steps, {size / 1e9:.2f} GB of deltas; "
          f"{os.cpu_count()} CPU cores; page cache dropped before each run; median of {args.repeats} runs")
    startup = {label: median(timed([*launcher, "--version"], threads) for _ in range(args.repeats))
               for label, (launcher, threads) in SETUPS.items() if "threads" not in label}
    print("start-up alone (`relex --version`): " + ", ".join(f"{label} {s:.2f} s" for label, s in startup.items()))
    for name, make in commands.items():
        seconds = {label: [] for label in SETUPS}
        for _ in range(args.repeats):
            for label, (launcher, threads) in SETUPS.items():
                out = workdir / f"out-{name}-{label.replace(' ', '_').replace(',', '')}"
                shutil.rmtree(out, ignore_errors=True)
                bench_fit.evict(store, workdir / "base")
                seconds[label].append(timed([*launcher, *make(out)], threads))
        print(f"\nrelex {name}")
        for label, runs in seconds.items():
            print(f"  {label:24s} {median(runs):7.2f} s   (runs: {', '.join(f'{s:.2f}' for s in runs)})")
        two = median(seconds["2 ranks, 1 thread each"])
        for label in ("1 process, 1 thread", "1 process, 2 threads"):
            print(f"  speed-up of 2 ranks over {label}: {median(seconds[label]) / two:.2f}x")
        identical = same_tree(workdir / f"out-{name}-1_process_1_thread", workdir / f"out-{name}-2_ranks_1_thread_each")
        print(f"  2-rank output byte-identical to 1 process, 1 thread: {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
