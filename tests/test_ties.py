"""Ties come from the checkpoint's architecture (config.json) and the model's shared storage, never from equal values;
and no store shape, however many aliases a tensor has, crashes relex extrapolate."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from relex.io.checkpoint import CheckpointReader
from relex.store import TrajectoryStore
from relex.synthetic import write_planted_run
from tests.conftest import cli

STEPS = [2, 4, 6]


def twelve_layer_base(folder, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=12, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_norms_that_start_equal_and_move_alike_are_not_tied(tmp_path):
    base = twelve_layer_base(tmp_path / "base")
    run = tmp_path / "run"
    write_planted_run(base, run, STEPS)
    for step in STEPS:  # every norm weight starts at 1.0 and moves exactly like model.norm.weight
        path = run / f"checkpoint-{step}" / "model.safetensors"
        tensors = load_file(str(path))
        for name in tensors:
            if name.endswith("norm.weight"):
                tensors[name] = tensors["model.norm.weight"].clone()
        save_file(tensors, str(path), metadata={"format": "pt"})
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    assert store.tied == {}
    assert cli("extrapolate", tmp_path / "store", "--targets", "10", "--out", tmp_path / "out") == 0


def test_config_ties_are_found_without_equal_value_guessing(tmp_path):
    base = twelve_layer_base(tmp_path / "base", tied=True)
    tensors = load_file(str(base / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # an exporter that stores both
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    write_planted_run(base, tmp_path / "run", STEPS)
    assert cli("ingest", tmp_path / "run", "--base", base, "--out", tmp_path / "store") == 0
    assert TrajectoryStore.open(tmp_path / "store").tied == {"lm_head.weight": "model.embed_tokens.weight"}


def test_a_tensor_with_several_aliases_extrapolates(planted, tmp_path):
    base, run, _ = planted
    infos = CheckpointReader(base).infos()
    canonical = "model.norm.weight"
    aliases = ["model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
    store = TrajectoryStore.create(tmp_path / "store", base_dir=base, tensors=infos, tied={a: canonical for a in aliases})
    for step in (2, 4, 6):
        store.append_checkpoint(step, run / f"checkpoint-{step}", torch.float32)
    assert cli("extrapolate", tmp_path / "store", "--targets", "12", "--out", tmp_path / "out") == 0
    out = load_file(str(tmp_path / "out" / "step-12" / "model.safetensors"))
    assert all(torch.equal(out[a], out[canonical]) for a in aliases)
    assert not torch.equal(out[canonical], CheckpointReader(base).read(canonical))


def test_recorder_ties_come_from_shared_storage(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from relex.record import DeltaRecorder

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)  # the norms are all ones, equal but not shared
    store = DeltaRecorder(tmp_path / "store").attach(model)
    assert store.tied == {"lm_head.weight": "model.embed_tokens.weight"}
