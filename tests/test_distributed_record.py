"""DeltaRecorder under 2-process torch.distributed on CPU (gloo), started with torchrun.

DDP: the main process records and the other does nothing; with the same rows on both ranks DDP's mean gradient is
exact, so the store must be byte for byte the one a single process records. FSDP2 (`fully_shard`): parameters are
sharded DTensors, which the recorder refuses on every rank at train begin, in one line and without a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

TRAIN = '''
import os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from relex import DeltaRecorder

out = sys.argv[1]
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
if sys.argv[2] == "fsdp":
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainerState
    from relex.errors import RelexError

    dist.init_process_group("gloo")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = TrainerState(is_world_process_zero=dist.get_rank() == 0)
    try:
        DeltaRecorder(f"{out}/trajectory").on_train_begin(None, state, None, model=model)
    except RelexError as error:
        print(f"rank {dist.get_rank()}: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
row = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row}] * 8  # every rank sees the same rows
args = TrainingArguments(
    output_dir=f"{out}/hf", max_steps=3, per_device_train_batch_size=1, learning_rate=1e-2, report_to="none",
    save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
    **({"ddp_backend": "gloo"} if os.environ.get("WORLD_SIZE") else {}),
)
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[DeltaRecorder(f"{out}/trajectory", every=1)])
trainer.train()
print(f"world size {trainer.args.world_size}")
'''


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def store_files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def test_ddp_recording_equals_one_process(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    one = run([sys.executable, "train.py", "one", "ddp"], tmp_path)
    assert one.returncode == 0 and "world size 1" in one.stdout, one.stderr[-3000:]
    two = run([*TORCHRUN, "train.py", "two", "ddp"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("world size 2") == 2
    single, ddp = (tmp_path / name / "trajectory" for name in ("one", "two"))
    assert store_files(ddp) == store_files(single)  # the deltas of steps 1-3 and θ₀, byte for byte
    assert sorted(store_files(ddp)) == ["base/config.json", "base/generation_config.json", "base/model.safetensors",
                                        "base/relex.json", *(f"deltas/step-0000000{s}.safetensors" for s in (1, 2, 3))]
    manifests = [json.loads((store / "manifest.json").read_text()) for store in (single, ddp)]
    for manifest in manifests:
        del manifest["created_by"]["time"]
    assert manifests[0] == manifests[1]


def test_fsdp2_parameters_are_refused_on_every_rank(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    done = run([*TORCHRUN, "train.py", "fsdp-run", "fsdp"], tmp_path)
    assert done.returncode != 0
    refusals = sorted(line for line in done.stderr.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in refusals] == ["rank 0", "rank 1"]
    assert all("is sharded (FSDP or DeepSpeed ZeRO-3); DeltaRecorder needs whole parameters" in line for line in refusals)
    assert not (tmp_path / "fsdp-run" / "trajectory").exists()
