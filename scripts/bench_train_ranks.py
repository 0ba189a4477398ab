"""Benchmark: `relex train` in one process against two processes started by `accelerate launch` (DDP, gloo, CPU).

Trains configs/tiny.yaml for --steps GRPO steps with the same global batch (16 completions per step: 16 in one
process, 8 in each of two), recording every step, and reports for each setup the median over --repeats runs of
the mean seconds per step (RUN/summary.json: generation, update, recording, checkpoint; start-up excluded), of
the recording's share of a step, and of the whole command's wall time:

    1 process, 1 thread      OMP_NUM_THREADS=1 relex train ...
    1 process, 2 threads     relex train ...   (torch's default on a 2-core machine)
    2 ranks, 1 thread each   OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 -m relex train ...

    .venv/bin/python scripts/bench_train_ranks.py --workdir /tmp/relex-bench-train [--steps 8] [--repeats 3] \
        [--hidden-size 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import yaml

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def accelerate_launch() -> list[str]:
    with socket.socket() as probe:  # a free port, not accelerate's default 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
            "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]


SETUPS = {  # label -> (launcher, processes, OMP_NUM_THREADS or None for torch's default)
    "1 process, 1 thread": (lambda: [sys.executable], 1, "1"),
    "1 process, 2 threads": (lambda: [sys.executable], 1, None),
    "2 ranks, 1 thread each": (accelerate_launch, 2, "1"),
}


def config_file(workdir: Path, processes: int, steps: int, hidden_size: int, layers: int) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["grpo"].update(per_device_train_batch_size=16 // processes, max_steps=steps)
    data["model"]["tiny"].update(hidden_size=hidden_size, num_layers=layers)
    path = workdir / f"tiny-{processes}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_once(workdir: Path, label: str, steps: int, hidden_size: int, layers: int) -> dict:
    launcher, processes, threads = SETUPS[label]
    run = workdir / "run"
    shutil.rmtree(run, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"TQDM_DISABLE": "1", **({"OMP_NUM_THREADS": threads} if threads else {})})
    command = [*launcher(), "-m", "relex", "train", "--config", str(config_file(workdir, processes, steps, hidden_size, layers)),
               "--out", str(run), "--no-progress"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{label}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    return {"step": summary["seconds_per_step"], "record": summary["record_seconds_over_step_seconds"], "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=64, help="the tiny Llama's width (configs/tiny.yaml: 64)")
    parser.add_argument("--layers", type=int, default=2, help="its number of layers (configs/tiny.yaml: 2)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {label: [] for label in SETUPS}
    for _ in range(args.repeats):  # interleaved, so that a change of load on the machine touches every setup
        for label in SETUPS:
            results[label].append(run_once(args.workdir, label, args.steps, args.hidden_size, args.layers))
    print(f"configs/tiny.yaml with hidden size {args.hidden_size} and {args.layers} layers, {args.steps} steps of 16 "
          f"completions, medians of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    base = median(r["step"] for r in results["1 process, 1 thread"])
    for label, rows in results.items():
        step = median(r["step"] for r in rows)
        print(f"{label:24s} {step:6.3f} s/step  ({base / step:.2f}x of 1 process, 1 thread)  recording "
              f"{100 * median(r['record'] for r in rows):.1f}% of a step  command {median(r['wall'] for r in rows):5.1f} s")


if __name__ == "__main__":
    main()
