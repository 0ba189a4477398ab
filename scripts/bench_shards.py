"""How long it takes to open verl's unmerged FSDP shards: torch.load (how relex opened them until stop 39) against
relex's own records of them (relex.io.torch_save), on the same files in one run, alternating.

    .venv/bin/python scripts/bench_shards.py               # builds a planted run: SmolLM2-135M's 30 layers (272
                                                           # tensors) at a small width, 2 ranks x 2 steps
    .venv/bin/python scripts/bench_shards.py --run RUN     # the shards of an existing verl run

Every pass over a run referenced in place, and its ingest, opens every rank's file of every step, so what one file
costs is paid ranks x steps times. The time depends on how many tensors a file holds (each is a DTensor with its
spec and device mesh to unpickle), not on their sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relex.io.verl_shards import load_shard, read_shard  # noqa: E402


def planted_sharded_run(root: Path, steps: list[int], ranks: int) -> Path:
    """A planted verl run with SmolLM2-135M's layer count and a small width, saved as FSDP2 shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from relex.synthetic import write_planted_run, write_sharded_run

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=30, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    write_planted_run(root / "base", root / "merged", steps, layout="verl")
    return write_sharded_run(root / "merged", root / "sharded", steps, ranks)


def timed(open_file, path: Path) -> float:
    start = time.perf_counter()
    open_file(path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a verl run whose global_step_N/actor folders hold rank files")
    parser.add_argument("--rounds", type=int, default=3, help="times each file is opened each way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run = args.run or planted_sharded_run(Path(scratch), [1, 2], ranks=2)
        files = sorted(run.glob("global_step_*/actor/model_world_size_*_rank_*.pt"))
        if not files:
            raise SystemExit(f"{run}: no global_step_N/actor/model_world_size_W_rank_R.pt files")
        load_shard(files[0]), read_shard(files[0])  # imports and first-use costs out of the timings
        torch_load, records = [], []
        for _ in range(args.rounds):
            for path in files:  # alternating, so that a change in the machine's speed falls on both
                torch_load.append(timed(load_shard, path))
                records.append(timed(read_shard, path))
        tensors = len(read_shard(files[0])[0])
        slow, fast = statistics.median(torch_load), statistics.median(records)
        print(f"{args.run or 'a planted run'}: {len(files)} rank files, {tensors} tensors each; medians of {len(torch_load)} opens each way")
        print(f"  torch.load(weights_only=True, mmap=True)   {slow * 1e3:8.1f} ms a file  (runs {min(torch_load) * 1e3:.1f}-{max(torch_load) * 1e3:.1f})")
        print(f"  relex.io.torch_save records                {fast * 1e3:8.1f} ms a file  (runs {min(records) * 1e3:.1f}-{max(records) * 1e3:.1f})")
        print(f"  ratio torch.load / records                 {slow / fast:8.1f}")
        for ranks, steps in ((8, 20), (8, 100), (64, 100)):
            print(f"  {ranks} ranks x {steps} steps ({ranks * steps} files), each pass: {slow * ranks * steps:7.1f} s with torch.load, "
                  f"{fast * ranks * steps:5.1f} s with the records")


if __name__ == "__main__":
    main()
