"""Benchmark: fit + extrapolate against one plain read of the stored trajectory.

Builds (once, in --workdir) a trajectory store with the tensor shapes of a real model (SmolLM2-135M by default;
`--shape qwen2.5-1.5b` for a 1.5B-parameter one) and T recorded steps of float32 deltas, then measures, each
phase in its own process so that peak RSS is that phase's own:
  1. read: every stored value read once through the store's reader (the I/O floor of any method), before and
     after phase 2, keeping the faster;
  2. fit + extrapolate: `relex extrapolate` without a saved fit (Gram pass + weighted sum) to two targets.
Prints both times, their ratio, and each phase's peak RSS. Goal on SmolLM2 shapes, T = 20: ratio ≤ 2.0 and peak
RSS of phase 2 under 3 GiB while the trajectory is ~11 GB.

    .venv/bin/python scripts/bench_fit.py --workdir /tmp/relex-bench [--steps 20] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # LlamaConfig fields of real models
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}


def build(workdir: Path, shape: str, steps: int) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from relex.io.checkpoint import CheckpointReader
    from relex.store import TrajectoryStore

    store_dir = workdir / f"store-{shape}-T{steps}"
    if (store_dir / "manifest.json").is_file() and len(TrajectoryStore.open(store_dir).steps) == steps:
        return store_dir
    shutil.rmtree(workdir, ignore_errors=True)
    base = workdir / "base"
    base.mkdir(parents=True)
    config = LlamaConfig(**SHAPES[shape])
    config.save_pretrained(base)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        names = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=gen) * 0.02 for n, s in names.items()}, str(base / "model.safetensors"), metadata={"format": "pt"})
    store = TrajectoryStore.create(store_dir, base_dir=base, tensors=CheckpointReader(base).infos(), created_by={"command": "bench_fit"})
    directions = {}
    for step in range(1, steps + 1):
        def delta(name, step=step):
            if name not in directions:
                directions[name] = torch.randn(names[name], generator=gen) * 1e-4
            noise = torch.randn(names[name], generator=gen) * 1e-5
            return directions[name] * (0.5 * step + 1) + noise

        store.append_deltas(step * 2, delta)
        print(f"built step {step * 2}", file=sys.stderr)
    return store_dir


def phase_read(store_dir: str) -> dict:
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    reader = store.reader()
    started, values = time.perf_counter(), 0
    for name in store.trajectory_names:
        for _, chunk in reader.chunks(name, 2**25):
            values += chunk.numel()
    return {"seconds": time.perf_counter() - started, "values": values}


def phase_extrapolate(store_dir: str, out: str, device: str) -> dict:
    from relex.extrapolate import ExtrapolateConfig, extrapolate_store
    from relex.fit import FitConfig
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    last = store.steps[-1]
    started = time.perf_counter()
    extrapolate_store(store, out, ExtrapolateConfig(targets=[2 * last, 5 * last], fit=FitConfig(device=device), overwrite=True))
    return {"seconds": time.perf_counter() - started}


def run_phase(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/relex-bench")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--phase", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        kind, *rest = args.phase
        result = phase_read(rest[0]) if kind == "read" else phase_extrapolate(rest[0], rest[1], rest[2])
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(json.dumps(result))
        return
    workdir = Path(args.workdir)
    store_dir = build(workdir, args.shape, args.steps)
    size = sum(f.stat().st_size for f in (store_dir / "deltas").iterdir())
    # read before and after, so that both phases see the same page cache; the faster read is the floor
    reads = [run_phase("read", str(store_dir))]
    fit = run_phase("extrapolate", str(store_dir), str(workdir / "out"), args.device)
    reads.append(run_phase("read", str(store_dir)))
    read = min(reads, key=lambda r: r["seconds"])
    runs = ", ".join(f"{r['seconds']:.1f} s" for r in reads)
    print(f"trajectory: {args.shape} shapes, T={args.steps} steps, {read['values'] / 1e9:.2f} G values, {size / 1e9:.2f} GB on disk")
    print(f"read every stored value once:      {read['seconds']:8.2f} s   peak RSS {read['peak_rss_gib']:.2f} GiB  (runs: {runs})")
    print(f"fit + extrapolate to two targets:  {fit['seconds']:8.2f} s   peak RSS {fit['peak_rss_gib']:.2f} GiB  (device {args.device})")
    print(f"ratio (fit + extrapolate) / read:  {fit['seconds'] / read['seconds']:8.2f}")


if __name__ == "__main__":
    main()
