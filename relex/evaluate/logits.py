"""Logits extrapolation at decode time (RLVR-Linearity, arXiv 2601.04537): l = l_A + α (l_B − l_A).

Two checkpoints of one run, A (earlier) and B (later), decode together: at every step both score the same
prefix and the next token comes from the extrapolated logits. α = 1 is B itself; α > 1 goes beyond it. No weights
are written, so it is a method of `relex eval`, named like a checkpoint and compared in the same tables:

    relex eval 'logits(runs/a/trajectory@4,runs/a/trajectory@8,2)' runs/a/trajectory@8 --task chain_sum

A and B must share the tokenizer and the vocabulary (the logits are added index by index); otherwise one line
says which differs. Only the transformers backend decodes this way.
"""

from __future__ import annotations

from contextlib import contextmanager

from relex.errors import RelexError
from relex.evaluate.checkpoints import LogitsSpec, model_folder, parse_checkpoint
from relex.evaluate.generate import TransformersGenerator


class ExtrapolatedLogits:
    """A logits processor: the generating model B's scores become l_A + α (l_B − l_A), A decoding alongside with
    its own KV cache on the same prefix (same attention mask and positions, so left padding is handled)."""

    def __init__(self, model_a, attention_mask, alpha: float):
        self.model_a, self.alpha = model_a, alpha
        self.mask = attention_mask
        self.cache = None
        self.seen = 0
        import inspect

        # transformers ≥ 5.3 calls the KV cache `cache`, earlier versions `past_key_values`
        self.cache_argument = "cache" if "cache" in inspect.signature(model_a.forward).parameters else "past_key_values"

    def __call__(self, input_ids, scores):
        import torch

        if self.mask.shape[0] != input_ids.shape[0]:  # K samples per prompt: generate expands the batch
            self.mask = self.mask.repeat_interleave(input_ids.shape[0] // self.mask.shape[0], dim=0)
        new = input_ids.shape[1] - self.mask.shape[1]
        if new > 0:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], new)], dim=1)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        cache = {self.cache_argument: self.cache}
        with torch.inference_mode():
            out = self.model_a(
                input_ids=input_ids[:, self.seen:], attention_mask=self.mask, position_ids=positions[:, self.seen:],
                use_cache=True, **cache,
            )
        self.cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        self.seen = input_ids.shape[1]
        logits_a = out.logits[:, -1, :].to(scores.dtype)
        return logits_a + self.alpha * (scores - logits_a)


class LogitsGenerator(TransformersGenerator):
    """`TransformersGenerator` for B whose every decode step uses A's logits too (ExtrapolatedLogits)."""

    def __init__(self, folder_a: str, folder_b: str, alpha: float, *, batch_size: int, max_new_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        super().__init__(folder_b, batch_size=batch_size, max_new_tokens=max_new_tokens)
        self.alpha = alpha
        tokenizer_a = AutoTokenizer.from_pretrained(folder_a)
        if tokenizer_a.get_vocab() != self.tokenizer.get_vocab():
            raise RelexError(f"logits extrapolation: {folder_a} and {folder_b} have different tokenizers (vocabularies differ)")
        dtype = "auto" if self.device == "cuda" else torch.float32
        self.model_a = AutoModelForCausalLM.from_pretrained(folder_a, dtype=dtype).to(self.device).eval()
        sizes = (self.model_a.config.vocab_size, self.model.config.vocab_size)
        if sizes[0] != sizes[1]:
            raise RelexError(f"logits extrapolation: vocabulary sizes differ ({folder_a}: {sizes[0]}, {folder_b}: {sizes[1]})")

    def _generate_batch(self, texts, samples, temperature):
        import torch
        from transformers import LogitsProcessorList

        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        processor = ExtrapolatedLogits(self.model_a, inputs["attention_mask"], self.alpha)
        with torch.inference_mode():
            output = self.model.generate(
                **inputs, **self._generation_kwargs(samples, temperature), logits_processor=LogitsProcessorList([processor])
            )
        new_tokens = output[:, inputs["input_ids"].shape[1]:].cpu()
        completions = [self._completion(row.tolist()) for row in new_tokens]
        return [completions[i * samples:(i + 1) * samples] for i in range(len(texts))]

    def close(self) -> None:
        del self.model_a
        super().close()


def check_logits_spec(spec: LogitsSpec, backend: str) -> tuple:
    """The parsed checkpoints A and B, checked now (before any generation)."""
    if backend != "transformers":
        raise RelexError(f"{spec.label}: logits extrapolation decodes with the transformers backend, not {backend}")
    return parse_checkpoint(spec.a), parse_checkpoint(spec.b)


@contextmanager
def open_logits_generator(refs: tuple, spec: LogitsSpec, settings):
    with model_folder(refs[0]) as folder_a, model_folder(refs[1]) as folder_b:
        generator = LogitsGenerator(folder_a, folder_b, spec.alpha, batch_size=settings.batch_size,
                                    max_new_tokens=settings.max_new_tokens)
        try:
            yield generator
        finally:
            generator.close()
