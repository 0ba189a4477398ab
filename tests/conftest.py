"""Fixtures: tiny Llama checkpoints built locally (no network) and planted trajectories in each run layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from relex.cli import main as relex_main
from relex.store import TrajectoryStore
from relex.synthetic import write_planted_run

STEPS = [2, 4, 6, 9, 13, 20, 30]  # uneven on purpose


def make_base(folder: Path, *, tied: bool = True, dtype: torch.dtype = torch.float32, alias_in_file: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    if alias_in_file:  # some exporters store the tied output embedding as a second copy
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return folder


class Payload:
    """What a hostile pickle would run if it were unpickled freely: `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def tiny_base(tmp_path) -> Path:
    return make_base(tmp_path / "base")


@pytest.fixture
def planted(tmp_path, tiny_base):
    """A tied tiny Llama and a planted HF-Trainer run at uneven steps."""
    run = tmp_path / "run"
    truth = write_planted_run(tiny_base, run, STEPS, layout="hf-trainer", noise=0.02)
    return tiny_base, run, truth


@pytest.fixture
def store(planted, tmp_path):
    """The planted run ingested into a store (referenced in place)."""
    base, run, truth = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    return TrajectoryStore.open(tmp_path / "store")


def cli(*args: str) -> int:
    return relex_main([str(a) for a in args])
