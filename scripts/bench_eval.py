"""Evaluation throughput: completions per second generated in batches versus one prompt at a time.

    python scripts/bench_eval.py                       # the embedded smollm2-135m-instruct, 32 chain_sum prompts
    python scripts/bench_eval.py --model runs/extrapolated-500 --n 64 --batch-size 64

Both runs decode the same held-out prompts greedily with the same generator (`relex.evaluate.generate`); the
model is loaded once, and a short warm-up run is not timed.
"""

from __future__ import annotations

import argparse
import time

from relex.evaluate.generate import load_generator
from relex.models import resolve_model
from relex.tasks import load_task

CHAIN_SUM = {"source": "reasoning_gym", "name": "chain_sum",
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def completions_per_second(generator, prompts, batch_size: int) -> tuple[float, float]:
    generator.batch_size = batch_size
    start = time.perf_counter()
    completions = generator.generate(prompts, samples=1, temperature=0.0, seed=0)
    seconds = time.perf_counter() - start
    tokens = sum(group[0].n_tokens for group in completions)
    return len(completions) / seconds, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n", type=int, default=32, help="held-out chain_sum prompts")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    prompts = [row["prompt"] for row in load_task(CHAIN_SUM).rows("eval", args.n)]
    generator = load_generator(
        "transformers", resolve_model(args.model), batch_size=args.batch_size, max_new_tokens=args.max_new_tokens
    )
    completions_per_second(generator, prompts[:2], 2)  # warm-up
    batched, batched_tokens = completions_per_second(generator, prompts, args.batch_size)
    single, single_tokens = completions_per_second(generator, prompts, 1)
    print(f"model {args.model} on {generator.device}, {args.n} prompts, greedy, max {args.max_new_tokens} new tokens")
    print(f"batch {args.batch_size:>3}: {batched:8.2f} completions/s  ({batched_tokens:8.1f} tokens/s)")
    print(f"batch   1: {single:8.2f} completions/s  ({single_tokens:8.1f} tokens/s)")
    print(f"ratio batched / one at a time: {batched / single:.2f}x")


if __name__ == "__main__":
    main()
