"""Benchmark: the Gram matrices of a trajectory, torch's matrix multiply against relex's CPU kernel.

Forms M Mᵀ over blocks of T × (block values / T) float32 values, as `relex fit` does, for as many columns as a
model has parameters (SmolLM2-135M by default), on 1 thread and on all of them, and prints seconds, GFLOP/s
(counting the full T × T product, 2·T²·n, for both) and the kernel's speed-up. The blocks are made once and
reused, so the figures are arithmetic, not reading.

    .venv/bin/python scripts/bench_gram.py [--steps 20] [--parameters 134515008] [--block-values 4194304]
"""

from __future__ import annotations

import argparse
import time

import torch

from relex.fit.gram import chunk_gram


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
    cpu = torch.device("cpu")
    reference = blocks[0].double() @ blocks[0].double().T

    def with_torch(m):
        return (m @ m.T).double()

    def with_kernel(m):
        return chunk_gram(m, cpu)

    for name, form in (("torch x @ x.T", with_torch), ("relex kernel", with_kernel)):
        error = ((form(blocks[0]) - reference).abs().max() / reference.abs().max()).item()
        print(f"{name}: max relative error against float64 {error:.1e}")

    threads = torch.get_num_threads()
    print(f"T = {args.steps}, {count * columns / 1e6:.1f} M columns in {count} blocks of {columns}; "
          f"{flops / 1e9:.0f} GFLOP for the full products")
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        seconds = {name: timed(form, blocks, count) for name, form in (("torch", with_torch), ("kernel", with_kernel))}
        for name, s in seconds.items():
            print(f"  {n} thread{'s' if n > 1 else ''}  {name:6s} {s:6.2f} s  {flops / s / 1e9:6.0f} GFLOP/s")
        print(f"  {n} thread{'s' if n > 1 else ''}  kernel speed-up: {seconds['torch'] / seconds['kernel']:.2f}x")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
