"""Benchmark: keeping the first blocks of a partly held trajectory, in fresh memory per tensor against one reused buffer.

A pass reads a trajectory too large to hold (T steps × the tensor's values > the hold budget, 512 MiB by default)
twice: once for its Gram, and again for its weighted sums, except for its first blocks, up to the budget, which it
keeps from the first read where that pays (relex.fit.passes.plan_pass: reads past the page cache, or enough such
trajectories to reuse the buffer). From Qwen2.5-1.5B up nearly every matrix is such a trajectory. Kept
as a copy per tensor (`clone`), each is fresh memory: the allocator maps it anew, and the kernel faults in and
zeroes every 4 KiB page before the copy writes it. Kept in one buffer that the next tensor reuses (what the pass
does now), only the first tensor pays for that. This times both for `--tensors` tensors of `--hold-mib` kept
each, copied from blocks of `--block-mib`, on one thread, and prints seconds, minor page faults and the ratio.

    .venv/bin/python scripts/bench_hold.py [--tensors 16] [--hold-mib 512] [--block-mib 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import time
from statistics import median

import torch


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def keep_fresh(blocks: list[torch.Tensor], tensors: int, hold: torch.Tensor) -> None:
    """Each tensor's kept blocks copied into new memory (`clone`), freed when the next tensor begins."""
    for _ in range(tensors):
        kept = [block.clone() for block in blocks]
        del kept


def keep_reused(blocks: list[torch.Tensor], tensors: int, hold: torch.Tensor) -> None:
    """Each tensor's kept blocks copied into the one hold buffer."""
    for _ in range(tensors):
        at = 0
        for block in blocks:
            hold[at : at + block.numel()].view(block.shape).copy_(block)
            at += block.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=16, help="partly held trajectories in the pass")
    parser.add_argument("--hold-mib", type=int, default=512, help="values kept per tensor (the hold budget)")
    parser.add_argument("--block-mib", type=int, default=16, help="size of one read block")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_block = args.block_mib * 2**20 // 4
    blocks = [torch.randn(per_block) for _ in range(args.hold_mib // args.block_mib)]
    # the pass allocates its hold buffer once; its first use faults its pages in, which is timed below too
    results = {}
    for name, keep in (("a copy per tensor (clone)", keep_fresh), ("one reused buffer", keep_reused)):
        seconds, faulted = [], []
        for _ in range(args.repeats):
            hold = torch.empty(len(blocks) * per_block)
            before, start = faults(), time.perf_counter()
            keep(blocks, args.tensors, hold)
            seconds.append(time.perf_counter() - start)
            faulted.append(faults() - before)
            del hold
        results[name] = median(seconds)
        print(f"{name:<28} {median(seconds):6.2f} s  {median(faulted):>9,.0f} page faults  (runs: "
              f"{', '.join(f'{s:.2f}' for s in seconds)})")
    fresh, reused = results.values()
    print(f"{args.tensors} tensors × {args.hold_mib} MiB kept: fresh / reused = {fresh / reused:.2f}")


if __name__ == "__main__":
    main()
