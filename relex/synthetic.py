"""Planted trajectories: checkpoints whose deltas have a known rank-1 direction and linear coefficient.

θ_s = θ₀ + (a·s + b)·v + noise, per float tensor, with a unit direction v and noise of a chosen relative size.
Used by the tests (the fit must recover v) and by `scripts/bench_fit.py`; `write_sharded_run` saves such a run as
verl's unmerged FSDP2 shards (the tests of relex.io.verl_shards, `scripts/bench_shards.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from relex.io.checkpoint import CheckpointReader
from relex.io.hf_folder import copy_model_files


@dataclass
class PlantedTruth:
    directions: dict[str, torch.Tensor]  # unit direction per tensor (flattened)
    slope: float
    intercept: float

    def coefficient(self, step: int) -> float:
        return self.slope * step + self.intercept


def step_folder(run_dir: Path, step: int, layout: str) -> Path:
    if layout == "hf-trainer":
        return run_dir / f"checkpoint-{step}"
    if layout == "verl":
        return run_dir / f"global_step_{step}" / "actor" / "huggingface"
    if layout == "plain":
        return run_dir / f"step{step:04d}"
    raise ValueError(f"unknown layout {layout}")


def write_planted_run(
    base_dir: str | Path,
    run_dir: str | Path,
    steps: list[int],
    *,
    layout: str = "hf-trainer",
    slope: float = 1e-3,
    intercept: float = 2e-3,
    noise: float = 0.02,
    shards: int = 1,
    seed: int = 0,
    extra_files: bool = True,
) -> PlantedTruth:
    """Write one checkpoint per step under `run_dir` in the given layout; returns the planted truth."""
    base_dir, run_dir = Path(base_dir), Path(run_dir)
    base = CheckpointReader(base_dir)
    generator = torch.Generator().manual_seed(seed)
    names = [n for n in base.names() if base.info(n).is_float]
    tied = _tied_pairs(base)
    directions = {}
    for name in names:
        if name in tied:
            continue
        v = torch.randn(base.info(name).numel, generator=generator, dtype=torch.float64)
        directions[name] = v / v.norm()
    truth = PlantedTruth(directions, slope, intercept)
    for step in steps:
        tensors = {}
        for name in base.names():
            value = base.read(name)
            source = tied.get(name, name)
            if source in directions:
                scale = truth.coefficient(step) * (value.double().norm() / value.numel() ** 0.5 + 1e-3)
                noise_v = torch.randn(value.numel(), generator=generator, dtype=torch.float64) / value.numel() ** 0.5
                delta = scale * (directions[source] + noise * noise_v)
                value = (value.double() + delta.reshape(value.shape)).to(value.dtype)
            tensors[name] = value
        for alias, canonical in tied.items():
            tensors[alias] = tensors[canonical].clone()
        folder = step_folder(run_dir, step, layout)
        _write_checkpoint(folder, tensors, shards)
        copy_model_files(base_dir, folder)
        if extra_files and layout == "hf-trainer":
            (folder / "optimizer.pt").write_bytes(b"not a real optimizer state")
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return truth


def _tied_pairs(base: CheckpointReader) -> dict[str, str]:
    """An output embedding stored beside the input embedding it is tied to (per config.json)."""
    config = json.loads((base.folder / "config.json").read_text())
    names = base.names()
    if not config.get("tie_word_embeddings") or "lm_head.weight" not in names:
        return {}
    head = base.read("lm_head.weight")
    same = [n for n in names if n != "lm_head.weight" and base.info(n) == base.info("lm_head.weight") and torch.equal(base.read(n), head)]
    return {"lm_head.weight": same[-1]} if same else {}


def _write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    groups = [names[i::shards] for i in range(shards)]
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(folder / file), metadata={"format": "pt"})
        for n in group:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


# torchrun script: each rank shards the merged checkpoint of every step with FSDP2 (`fully_shard` on each decoder
# layer, then the model) and saves its `state_dict()` of DTensors, as verl's FSDP2 checkpoints hold them
_SHARD_SCRIPT = '''
import shutil, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
merged_run, sharded_run, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
for step in steps:
    model = AutoModelForCausalLM.from_pretrained(merged_run / f"global_step_{step}" / "actor" / "huggingface")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    actor = sharded_run / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), actor / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        shutil.copy(merged_run / f"global_step_{step}" / "actor" / "huggingface" / "config.json", actor / "huggingface")
    dist.barrier()
dist.destroy_process_group()
'''


def write_sharded_run(merged_run: str | Path, sharded_run: str | Path, steps: list[int], ranks: int = 2,
                      timeout: float = 600) -> Path:
    """The verl run `merged_run` (merged checkpoints, `write_planted_run(layout="verl")`) saved again as `ranks`
    CPU ranks' FSDP2 shards under `sharded_run` (`global_step_N/actor/model_world_size_W_rank_R.pt`), by torchrun
    with gloo."""
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "shard.py"
        script.write_text(_SHARD_SCRIPT)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script),
                   str(merged_run), str(sharded_run), ",".join(map(str, steps))]
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"sharding {merged_run} failed:\n{done.stderr[-3000:]}")
    return Path(sharded_run)
