"""relex eval's logits extrapolation, l = l_A + α (l_B − l_A), against a cache-free greedy decode of the formula."""

from __future__ import annotations

import pytest
import torch

from relex.errors import RelexError
from relex.evaluate import evaluate
from relex.evaluate.checkpoints import parse_logits_spec
from relex.evaluate.logits import LogitsGenerator
from relex.models import make_tiny_llama

PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "Add 12 and 30, then tell me."}]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny Llamas with one tokenizer: A, and B = A moved along a random direction."""
    root = tmp_path_factory.mktemp("logits")
    a = make_tiny_llama(root / "a", seed=0)
    b = make_tiny_llama(root / "b", seed=0)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(b / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v for k, v in weights.items()}
    save_file(moved, str(b / "model.safetensors"), metadata={"format": "pt"})
    return a, b


def greedy_by_formula(a, b, alpha: float, prompt, max_new_tokens: int) -> list[int]:
    """Greedy decoding where every step recomputes both models' logits on the whole prefix (no cache, no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(b)
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (a, b)]
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            la, lb = (m(ids).logits[0, -1] for m in models)
            token = int(torch.argmax(la + alpha * (lb - la)))
            out.append(token)
            if token == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize("alpha", [1.0, 2.5])
def test_decoding_equals_the_formula(pair, alpha):
    a, b = pair
    generator = LogitsGenerator(str(a), str(b), alpha, batch_size=8, max_new_tokens=12)
    texts = [generator.render(p) for p in PROMPTS]
    raw = generator._generate_batch(texts, 1, 0.0)  # both prompts in one left-padded batch
    for prompt, (completion,) in zip(PROMPTS, raw):
        expected = greedy_by_formula(a, b, alpha, prompt, 12)
        decoded = generator.tokenizer.decode([t for t in expected if t not in generator.stop_ids], skip_special_tokens=True)
        assert completion.text == decoded


def test_a_method_in_the_eval_table(pair):
    a, b = pair
    task = {"source": "reasoning_gym", "name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "train_size": 20, "eval_size": 4}
    spec = f"logits({a},{b},2)"
    result = evaluate([str(b), spec], task, n=4, max_new_tokens=8)
    assert [r.checkpoint for r in result.checkpoints] == [str(b), spec]


def test_different_vocabularies_and_bad_specs_fail_in_one_line(pair, tmp_path):
    a, _ = pair
    other = make_tiny_llama(tmp_path / "other", tokenizer_from=None, hidden_size=32)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra-token>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(RelexError, match="different tokenizers"):
        LogitsGenerator(str(a), str(other), 2.0, batch_size=2, max_new_tokens=2)
    for text in ("logits(a,b)", "logits(a,b,x)", "logits(a,b,-1)"):
        with pytest.raises(RelexError):
            parse_logits_spec(text)
