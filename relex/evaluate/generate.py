"""Completions for chat prompts from one checkpoint: batched transformers generation, or vLLM when installed.

    generator = load_generator("transformers", "runs/extrapolated-500", batch_size=32, max_new_tokens=512)
    greedy = generator.generate(prompts, samples=1, temperature=0.0, seed=0)   # one list of Completion per prompt
    sampled = generator.generate(prompts, samples=8, temperature=0.7, seed=0)
    generator.close()

Prompts are chat message lists rendered with the checkpoint's own chat template (`add_generation_prompt=True`).
Backends live in the `BACKENDS` registry; `relex.evaluate.evaluate` accepts any object with the same `generate`
and `close` methods, which is how tests plant completions without a model.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import sys
from dataclasses import dataclass
from typing import Protocol, Sequence

from relex.errors import RelexError
from relex.models import hub_failure, torch_seeded
from relex.registry import Registry

LOG = logging.getLogger(__name__)

Messages = list[dict]


@dataclass(frozen=True)
class Completion:
    text: str
    n_tokens: int  # generated tokens, not counting the stop token or padding


class Generator(Protocol):
    def generate(
        self, prompts: Sequence[Messages], *, samples: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        """`samples` completions per prompt, in prompt order; temperature 0 means greedy decoding."""

    def close(self) -> None:
        """Free the model (GPU memory) before the next checkpoint is loaded."""


BACKENDS: Registry[type] = Registry("generation backend")
VLLM_MISSING = "vLLM is not installed: pip install vllm (GPU only), or use --backend transformers"


def check_backend(name: str) -> None:
    """Fails before any work when the backend is unknown or its library is missing."""
    BACKENDS.get(name)
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RelexError(VLLM_MISSING)


def load_generator(backend: str, model_path: str, *, batch_size: int, max_new_tokens: int) -> Generator:
    check_backend(backend)
    return BACKENDS.get(backend)(model_path, batch_size=batch_size, max_new_tokens=max_new_tokens)


def _batches(items: list[int], size: int) -> list[list[int]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


@BACKENDS.register("transformers")
class TransformersGenerator:
    """`model.generate` on left-padded batches of prompts sorted by length, with the KV cache.

    On a GPU the model runs in its checkpoint's dtype; on a CPU in float32, where bf16 matmuls are slow.
    `batch_size` counts sequences, so sampling K completions puts batch_size // K prompts in a batch.
    """

    def __init__(self, model_path: str, *, batch_size: int, max_new_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
            dtype = "auto" if self.device == "cuda" else torch.float32
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        except (OSError, ValueError) as error:
            offline = hub_failure(error, model_path)  # a hub id with no network: say so in one line
            raise RelexError(offline or f"checkpoint {model_path}: cannot load its tokenizer or model ({error})") from None
        if self.tokenizer.chat_template is None:
            raise RelexError(f"checkpoint {model_path}: its tokenizer has no chat template to render prompts with")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.stop_ids = self._stop_ids()
        LOG.info("loaded %s on %s in %s", model_path, self.device, self.model.dtype)

    def _stop_ids(self) -> list[int]:
        """The tokenizer's eos and every eos the checkpoint's generation config names (chat models often add one)."""
        configured = self.model.generation_config.eos_token_id
        configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
        ids = [self.tokenizer.eos_token_id, *configured]
        return sorted({i for i in ids if i is not None})

    def render(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def generate(
        self, prompts: Sequence[Messages], *, samples: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        from tqdm.auto import tqdm

        texts = [self.render(messages) for messages in prompts]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        # longest first: similar lengths share a batch (little padding), and running out of memory shows at once
        order = sorted(range(len(texts)), key=lambda i: -lengths[i])
        results: list[list[Completion]] = [[] for _ in texts]
        batches = _batches(order, max(1, self.batch_size // samples))
        mode = "greedy" if temperature == 0 else f"{samples} samples at T={temperature}"
        with torch_seeded(seed):  # reproducible samples; the caller's stream (relex accelerate's GRPO) put back after
            # disable=None: no bar when stderr is not a terminal, so piped logs get no `\r` frames
            for batch in tqdm(batches, desc=f"generating ({mode})", unit="batch", leave=False, disable=None):
                for index, completions in zip(batch, self._generate_batch([texts[i] for i in batch], samples, temperature)):
                    results[index] = completions
        return results

    def _generation_kwargs(self, samples: int, temperature: float) -> dict:
        kwargs = dict(
            max_new_tokens=self.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            num_return_sequences=samples,
            use_cache=True,
        )
        if temperature == 0:
            return kwargs | dict(do_sample=False)
        # plain temperature sampling: the checkpoint's own top_p / top_k would bias pass@k estimates
        return kwargs | dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)

    def _generate_batch(self, texts: list[str], samples: int, temperature: float) -> list[list[Completion]]:
        import torch

        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        with torch.inference_mode():
            output = self.model.generate(**inputs, **self._generation_kwargs(samples, temperature))
        new_tokens = output[:, inputs["input_ids"].shape[1] :].cpu()
        completions = [self._completion(row.tolist()) for row in new_tokens]
        return [completions[i * samples : (i + 1) * samples] for i in range(len(texts))]

    def _completion(self, tokens: list[int]) -> Completion:
        stop = next((i for i, token in enumerate(tokens) if token in self.stop_ids), len(tokens))
        kept = tokens[:stop]
        return Completion(self.tokenizer.decode(kept, skip_special_tokens=True), len(kept))

    def close(self) -> None:
        import torch

        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@BACKENDS.register("vllm")
class VLLMGenerator:
    """vLLM's continuous batching (GPU only); `batch_size` is left to vLLM's scheduler."""

    def __init__(self, model_path: str, *, batch_size: int, max_new_tokens: int):
        try:
            from vllm import LLM
        except ImportError:
            raise RelexError(VLLM_MISSING) from None
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.llm = LLM(model=model_path, dtype="auto")
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self, prompts: Sequence[Messages], *, samples: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        # every sampling knob explicit: vLLM would otherwise take the checkpoint's generation_config defaults
        params = SamplingParams(
            n=samples,
            temperature=temperature,
            top_p=1.0,
            top_k=-1,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=self.max_new_tokens,
            seed=seed,
        )
        texts = [
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            for messages in prompts
        ]
        outputs = self.llm.generate(texts, params, use_tqdm=sys.stderr.isatty())
        return [[self._completion(o) for o in output.outputs] for output in outputs]

    def _completion(self, output) -> Completion:
        n_tokens = len(output.token_ids)
        if output.finish_reason == "stop" and not isinstance(output.stop_reason, str):
            n_tokens -= 1  # stopped by eos or a stop token id, which vLLM keeps in token_ids (not in text)
        return Completion(output.text, n_tokens)

    def close(self) -> None:
        import torch

        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
