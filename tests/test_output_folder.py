"""Written checkpoints open as a user would open them: transformers loads them, they generate, they are complete."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relex.io.checkpoint import CheckpointReader
from tests.conftest import cli


def test_loads_generates_and_is_complete(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    assert cli("extrapolate", tmp_path / "store", "--targets", "40,80", "--out", tmp_path / "out", "--max-shard-size", "20KB") == 0
    folder = tmp_path / "out" / "step-80"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards for t in load_file(str(folder / s)).values()
    )
    assert (folder / "tokenizer_config.json").is_file() and (folder / "generation_config.json").is_file()
    provenance = json.loads((folder / "relex.json").read_text())
    assert provenance["method"] == "relex" and provenance["target_step"] == 80 and provenance["rank"] == 1
    assert provenance["observed_steps"] == [2, 4, 6, 9, 13, 20, 30]
    model = AutoModelForCausalLM.from_pretrained(folder)
    base_names = set(CheckpointReader(base).names())
    assert base_names == set(CheckpointReader(folder).names())
    state = model.state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    out = model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    assert not list(tmp_path.glob("out/.*")), "temporary folders left behind"


def test_output_dtype_and_rounding_loss(planted, tmp_path, capsys):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    assert cli("extrapolate", tmp_path / "store", "--targets", "40", "--out", tmp_path / "out", "--dtype", "bf16") == 0
    folder = tmp_path / "out" / "step-40"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(folder / "model.safetensors")).values())
    loss = json.loads((folder / "relex.json").read_text())["rounding_loss"]
    assert 0 < loss < 1
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16
