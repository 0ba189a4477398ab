"""Benchmark: how long training waits for `DeltaRecorder` at each record, written in place or in the background.

Loads a model (the embedded SmolLM2-135M-Instruct by default), attaches a recorder to it as a trainer would, and
runs --records cycles of "a training step" (a fixed amount of matrix products on the CPU, --step-seconds long when
nothing else runs, changing every weight a little) followed by a record of θ − θ₀, once with the file written
before training goes on (`background=False`) and once with the write in a thread (`background=True`, what
`relex train` does). It prints, for each, the median seconds training waited per record, the median wall time of
a whole cycle, and their ratios (background / in place), measured in this one run:

    .venv/bin/python scripts/bench_record.py [--model smollm2-135m-instruct] [--records 5] [--step-seconds 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
from transformers import AutoModelForCausalLM

from relex import DeltaRecorder
from relex.models import resolve_model


def busy(seconds: float, size: int = 512) -> int:
    """Matrix products for about `seconds` of one core's time: the stand-in for a training step's arithmetic."""
    a = torch.randn(size, size)
    started, products = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a = torch.tanh(a @ a)
        products += 1
    return products


def cycle_times(model, store: Path, background: bool, records: int, step_seconds: float) -> tuple[list, list]:
    """(seconds training waited at each record, wall seconds of each step + record) for one recorder."""
    recorder = DeltaRecorder(store, every=1, background=background)
    recorder.attach(model)
    waited, cycles = [], []
    for step in range(1, records + 1):
        started = time.perf_counter()
        busy(step_seconds)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1e-4)
        before = time.perf_counter()
        recorder.record(step, wait=step == records)  # the last record is written before "training" ends
        waited.append(time.perf_counter() - before)
        cycles.append(time.perf_counter() - started)
    recorder.flush()
    assert recorder.store.steps == list(range(1, records + 1))
    return waited, cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--records", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=2.0)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    results = {}
    work = Path(tempfile.mkdtemp(prefix="relex-bench-record-"))
    try:
        for background in (False, True):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            results[background] = cycle_times(model, work / f"store-{background}", background, args.records, args.step_seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(p.numel() for p in model.parameters()) * 4 / 1e9
    print(f"model {args.model}: {size:.2f} GB of float32 weights; {args.records} records after steps of "
          f"~{args.step_seconds:g} s; medians (records 1..{args.records - 1}: the last one is written in place by both)")
    rows = {}
    for background, (waited, cycles) in results.items():
        name = "background" if background else "in place"
        rows[name] = (median(waited[:-1]), median(cycles[:-1]))
        print(f"  {name:10s}  training waited {rows[name][0]:.3f} s per record   step + record {rows[name][1]:.3f} s"
              f"   (waited: {', '.join(f'{w:.2f}' for w in waited)})")
    print(f"  ratio background / in place: waited {rows['background'][0] / rows['in place'][0]:.2f}, "
          f"step + record {rows['background'][1] / rows['in place'][1]:.2f}")


if __name__ == "__main__":
    main()
