"""Benchmark: the Gram matrices of a trajectory, torch's matrix multiply against relex's CPU kernel.

Forms M Mᵀ over blocks of T × (block values / T) float32 values, as `relex fit` does, for as many columns as a
model has parameters (SmolLM2-135M by default), on 1 thread and on all of them, and prints seconds, GFLOP/s
(counting the full T × T product, 2·T²·n, for all) and the speed-ups, for torch and for the kernel with each of
its tiles (relex.fit.gram_kernel, compiled by relex.fit.native: 4 × 4 where the CPU has AVX-512, 3 × 3 otherwise; the one this CPU runs is
marked). The blocks are made once and reused, so the figures are arithmetic, not reading.

    .venv/bin/python scripts/bench_gram.py [--steps 20] [--parameters 134515008] [--block-values 4194304]
"""

from __future__ import annotations

import argparse
import time

import torch

from relex.fit import native
from relex.fit.gram import cpu_gram


def timed(form, blocks, count: int) -> float:
    form(blocks[0])  # compile / warm up
    start = time.perf_counter()
    for i in range(count):
        form(blocks[i % len(blocks)])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parameters", type=int, default=134_515_008)
    parser.add_argument("--block-values", type=int, default=1 << 22)
    args = parser.parse_args()

    columns = args.block_values // args.steps
    count = max(1, args.parameters // columns)
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(args.steps, columns, generator=generator) for _ in range(8)]
    flops = 2 * args.steps**2 * columns * count
    reference = blocks[0].double() @ blocks[0].double().T

    def with_torch(m):
        return (m @ m.T).double()

    def with_kernel(tile):
        return lambda m: torch.from_numpy(cpu_gram(m.numpy(), torch.get_num_threads(), tile))

    forms = {"torch": with_torch, "kernel 4x4": with_kernel(4), "kernel 3x3": with_kernel(3)}
    for name, form in forms.items():
        error = ((form(blocks[0]) - reference).abs().max() / reference.abs().max()).item()
        print(f"{name}: max relative error against float64 {error:.1e}")

    threads = torch.get_num_threads()
    print(f"T = {args.steps}, {count * columns / 1e6:.1f} M columns in {count} blocks of {columns}; "
          f"{flops / 1e9:.0f} GFLOP for the full products; this CPU's tile: "
          f"{native.TILE}x{native.TILE}")
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        seconds = {name: timed(form, blocks, count) for name, form in forms.items()}
        label = f"{n} thread{'s' if n > 1 else ''}"
        for name, s in seconds.items():
            print(f"  {label}  {name:10s} {s:6.2f} s  {flops / s / 1e9:6.0f} GFLOP/s")
        print(f"  {label}  speed-up over torch: 4x4 {seconds['torch'] / seconds['kernel 4x4']:.2f}x, "
              f"3x3 {seconds['torch'] / seconds['kernel 3x3']:.2f}x; 3x3 over 4x4 "
              f"{seconds['kernel 4x4'] / seconds['kernel 3x3']:.2f}x")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
