"""Written folders as downstream tools expect them: transformers' shard layout and index, an inference-ready config.

The reference is transformers itself: `save_pretrained(max_shard_size=...)` of the same model must put every
tensor in the same shard file as `relex extrapolate --max-shard-size`, and write the same index metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from relex import DeltaRecorder
from relex.io.checkpoint import INDEX_NAME, TensorInfo
from relex.io.hf_folder import model_order, natural_key, plan_shards, state_dict_order
from relex.synthetic import write_planted_run
from tests.conftest import cli

SHARD = "20KB"  # the 12-layer model's embedding (384 × 32 float32, 49 kB) exceeds it: a shard of its own


def llama(folder: Path, *, layers: int, tied: bool) -> Path:
    """A seeded tiny Llama with `layers` layers, saved by transformers in one file."""
    config = LlamaConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def shard_of(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX_NAME).read_text())["weight_map"]


@pytest.mark.parametrize("tied", [True, False])
def test_shards_and_index_equal_save_pretrained(tmp_path, tied):
    base = llama(tmp_path / "base", layers=12, tied=tied)
    write_planted_run(base, tmp_path / "run", [10, 20], noise=0.0)
    assert cli("ingest", tmp_path / "run", "--base", base, "--out", tmp_path / "store") == 0
    out = tmp_path / "out"
    assert cli("extrapolate", tmp_path / "store", "--targets", "40", "--method", "two-point", "--out", out,
               "--max-shard-size", SHARD) == 0
    reference = tmp_path / "reference"
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(reference, max_shard_size=SHARD)

    written = out / "step-40"
    assert shard_of(written) == shard_of(reference)
    assert sorted(p.name for p in written.glob("*.safetensors")) == sorted(p.name for p in reference.glob("*.safetensors"))
    ours, theirs = (json.loads((f / INDEX_NAME).read_text())["metadata"] for f in (written, reference))
    assert ours == theirs and set(ours) == {"total_parameters", "total_size"}
    assert len(set(shard_of(written).values())) > 3  # the limit really splits layers


def test_tensor_order(tmp_path):
    names = ["model.layers.10.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight", "model.embed_tokens.weight",
             "model.layers.2.input_layernorm.weight"]
    assert model_order(names, None) == [names[2], names[3], names[1], names[0]]  # layers.2 before layers.10
    assert sorted(["layers.10.w", "layers.2.w", "layers.1.w"], key=natural_key) == ["layers.1.w", "layers.2.w", "layers.10.w"]
    # the model's own order, which transformers 4 saves in, from the class built on the meta device
    base = llama(tmp_path / "base", layers=11, tied=False)
    assert state_dict_order(base) == list(AutoModelForCausalLM.from_pretrained(base).state_dict())


def test_oversized_tensor_gets_its_own_shard_before_the_one_being_filled():
    layout = [(name, TensorInfo((n,), torch.float32)) for name, n in [("a", 15), ("big", 100), ("b", 5), ("c", 20)]]
    shards = [[name for name, _ in shard] for shard in plan_shards(layout, 100)]
    assert shards == [["big"], ["a", "b"], ["c"]]  # what huggingface_hub's split does with 60/400/20/80 bytes


def test_oversized_tensors_in_the_middle_of_the_order(tmp_path):
    """A limit below the MLP matrices (8 kB) but above the attention ones: oversized shards interleave with others."""
    base = llama(tmp_path / "base", layers=10, tied=False)
    write_planted_run(base, tmp_path / "run", [10, 20], noise=0.0)
    assert cli("ingest", tmp_path / "run", "--base", base, "--out", tmp_path / "store") == 0
    assert cli("extrapolate", tmp_path / "store", "--targets", "40", "--method", "two-point", "--out", tmp_path / "out",
               "--max-shard-size", "7KB") == 0
    reference = tmp_path / "reference"
    model = AutoModelForCausalLM.from_pretrained(base)
    model.save_pretrained(reference, max_shard_size="7KB")
    assert shard_of(tmp_path / "out" / "step-40") == shard_of(reference)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "step-40")
    assert sorted(loaded.state_dict()) == sorted(model.state_dict())


def test_folder_from_a_model_built_from_its_config_is_ready_for_inference(tmp_path):
    """A DeltaRecorder store of a model built from a config (no architectures) and trained without a KV cache."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config.use_cache = False
    rows = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.add_callback(DeltaRecorder(tmp_path / "trajectory", every=1))
    trainer.train()

    assert cli("extrapolate", tmp_path / "trajectory", "--targets", "6", "--method", "two-point", "--out", tmp_path / "out") == 0
    for folder in (tmp_path / "trajectory" / "base", tmp_path / "out" / "step-6"):
        written = json.loads((folder / "config.json").read_text())
        assert written["architectures"] == ["LlamaForCausalLM"], folder
        assert written.get("use_cache", True) is True and written["dtype"] == "float32", folder
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation.get("use_cache", True) is True, folder
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "step-6")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert all(torch.isfinite(p).all() for p in loaded.parameters())
