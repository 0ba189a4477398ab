"""Write a Hugging Face model folder the way transformers writes one, streaming tensor by tensor.

Layout: size-bounded shards `model-0000i-of-0000N.safetensors` (or `model.safetensors` when one shard holds
everything), `model.safetensors.index.json` with `total_size` and `total_parameters` when sharded, `config.json`
with the output dtype and the architecture, the tokenizer and generation config copied from the base, and
`relex.json` saying how the folder was made. Everything goes to a hidden temporary folder that is renamed into place
only when complete.

The shards are the ones `save_pretrained(max_shard_size=...)` writes: tensors in the order transformers saves them
(`model_order`), split as huggingface_hub's `split_torch_state_dict_into_shards` splits them (`plan_shards`), so
each tensor lies in the shard file where transformers would have put it.
The config is made ready for inference (`make_inference_ready`): training leaves `use_cache: false` behind, and a
config saved on its own (not by the model's `save_pretrained`) lacks `architectures`, which vLLM and mergekit need.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Sequence

import torch

from relex.errors import RelexError
from relex.io.checkpoint import INDEX_NAME, SINGLE_NAME, TensorInfo, read_config
from relex.io.dtypes import dtype_name
from relex.io.stream_writer import StreamingSafetensorsWriter, tensor_bytes

LOG = logging.getLogger(__name__)

# files of a base folder that describe the model or its tokenizer (weights are never copied)
COPIED_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "chat_template*",
    "*.jinja",
)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """`5GB` -> 5_000_000_000 (units as transformers' `max_shard_size` reads them)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise RelexError(f"cannot read size {text!r}; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def plan_shards(layout: Sequence[tuple[str, TensorInfo]], max_shard_bytes: int) -> list[list[tuple[str, TensorInfo]]]:
    """Split the ordered layout into shards of at most `max_shard_bytes`, as huggingface_hub splits a state dict.

    Tensors fill the current shard in order until the next would overflow it; a tensor larger than the limit gets
    a shard of its own at once, placed before the shard still being filled (`split_state_dict_into_shards_factory`).
    """
    shards: list[list[tuple[str, TensorInfo]]] = []
    current: list[tuple[str, TensorInfo]] = []
    size = 0
    for name, info in layout:
        nbytes = tensor_bytes(info)
        if nbytes > max_shard_bytes:
            shards.append([(name, info)])
            continue
        if size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, info))
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def model_order(names: Sequence[str], config_dir: str | Path | None) -> list[str]:
    """`names` in the order `save_pretrained` writes a loaded model's tensors, so shards split where transformers'.

    transformers 5 sorts the state dict by `core_model_loading.dot_natural_key` before saving (dotted parts, numbers
    as numbers: layers.2 before layers.10; `dot_natural_key` here is that key, since importing transformers takes
    seconds); transformers 4 keeps the order of the model's `state_dict()`, taken here from the model built on the
    meta device from `config_dir`'s config.json. Names that model lacks come last.
    """
    if (transformers_major() or 0) >= 5:
        return sorted(names, key=dot_natural_key)
    known = {name: i for i, name in enumerate(state_dict_order(config_dir))} if config_dir is not None else {}
    return sorted(names, key=lambda name: (name not in known, known.get(name, 0), natural_key(name)))


def transformers_major() -> int | None:
    """The installed transformers' major version (from its metadata: nothing is imported), None without it."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def dot_natural_key(name: str) -> list[tuple]:
    """transformers 5's sort key of state-dict names (`core_model_loading.dot_natural_key`): dotted parts, a number
    before a word, numbers (and a word's trailing digits, `shard_2` before `shard_11`) compared as numbers."""
    parts: list[tuple] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text):]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def natural_key(name: str) -> tuple:
    """`model.layers.10.mlp` sorts after `model.layers.2.mlp`: digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def state_dict_order(config_dir: str | Path) -> list[str]:
    """The state_dict names, in order, of the causal LM that `config_dir`'s config.json describes; [] when unknown."""
    config_path = Path(config_dir) / "config.json"
    if not config_path.is_file():
        return []
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(config_path.parent)
        architecture = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, architecture, None) if architecture else None
        with torch.device("meta"):
            model = model_class(config) if model_class is not None else AutoModelForCausalLM.from_config(config)
        return list(model.state_dict())
    except (ImportError, OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as error:
        # the folder is still written, only in natural order; say why, since shards then differ from transformers'
        LOG.info("%s: tensors in natural order of their names (no model could be built from its config: %s)", config_dir, error)
        return []


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def copy_model_files(base_dir: Path, out_dir: Path) -> None:
    for pattern in COPIED_PATTERNS:
        for source in sorted(Path(base_dir).glob(pattern)):
            if source.is_file() and source.name != INDEX_NAME:
                shutil.copy2(source, out_dir / source.name)


def make_inference_ready(folder: Path, dtype: torch.dtype | None = None, architecture: str | None = None) -> None:
    """Edit `folder`'s config.json and generation_config.json into what loaders and inference engines expect.

    config.json gets the output dtype, `architectures` (`architecture`, else the one it names, else the causal-LM
    class transformers maps its `model_type` to) and no `use_cache: false`; generation_config.json loses
    `use_cache: false` too (training turns the KV cache off; generation wants it).
    """
    config_path = folder / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if dtype is not None:
            config["dtype"] = dtype_name(dtype)
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype_name(dtype)
        architecture = architecture or (None if config.get("architectures") else causal_lm_class(config, config_path))
        if architecture is not None:
            config["architectures"] = [architecture]
        if config.get("use_cache") is False:
            config["use_cache"] = True
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text())
        if generation.get("use_cache") is False:
            del generation["use_cache"]
            generation_path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


@functools.cache
def _import_in_background(module: str) -> None:
    """Start importing `module` in a thread (once), so that its import (seconds, for transformers) runs while the
    caller computes instead of when it is first needed."""
    threading.Thread(target=importlib.import_module, args=(module,), name="relex-import", daemon=True).start()


def causal_lm_class(config: dict, where: Path) -> str | None:
    """The causal-LM class transformers builds for `config`'s `model_type` (what `AutoModelForCausalLM` picks)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    if name is None:
        LOG.warning(
            "%s: no `architectures`, and model_type %r has no causal-LM class in transformers; vLLM and mergekit "
            "need one: add \"architectures\": [\"<ModelClass>\"] to the base's config.json", where, config.get("model_type"),
        )
    return name


class HFFolderWriter:
    """Streams the tensors of `layout`, in order, into a new HF folder at `out_dir`."""

    def __init__(
        self,
        out_dir: str | Path,
        layout: Sequence[tuple[str, TensorInfo]],
        *,
        base_dir: str | Path | None,
        max_shard_bytes: int = 5 * 10**9,
        direct: bool = False,
    ):
        """`direct`: shard files written past the page cache where the file system allows (relex.io.stream_writer)."""
        self.out_dir = Path(out_dir)
        self.direct = direct
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.tmp_dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)
        self.shards = plan_shards(layout, max_shard_bytes)
        self.names = shard_names(len(self.shards))
        self.total_size = sum(tensor_bytes(info) for _, info in layout)
        self.total_parameters = sum(info.numel for _, info in layout)  # transformers' num_parameters()
        self._shard_of = {name: i for i, shard in enumerate(self.shards) for name, _ in shard}
        self._open: dict[int, StreamingSafetensorsWriter] = {}  # the shard being filled, and an oversized tensor's
        self._closed: set[int] = set()
        if self.base_dir is not None and not (read_config(self.base_dir) or {"architectures": ["-"]}).get("architectures"):
            _import_in_background("transformers.models.auto.modeling_auto")  # `finish` names the architecture from it

    def write(self, name: str, values: torch.Tensor) -> None:
        """The whole tensor or its next rows; tensors come in layout order.

        A shard's tensors are consecutive in that order, except that an oversized tensor has a shard of its own
        placed before the one being filled; so at most two shard files are open at a time.
        """
        if name not in self._shard_of:
            raise ValueError(f"{self.out_dir}: tensor {name} is not in the folder's layout")
        index = self._shard_of[name]
        if index not in self._open:
            if index in self._closed:
                raise ValueError(f"{self.out_dir}: tensor {name} comes after its shard {self.names[index]} was complete")
            self._open[index] = StreamingSafetensorsWriter(self.tmp_dir / self.names[index], self.shards[index], {"format": "pt"},
                                                             direct=self.direct)
        writer = self._open[index]
        writer.write(name, values)
        if writer.complete:
            writer.close()
            del self._open[index]
            self._closed.add(index)

    def finish(self, out_dtype: torch.dtype | None, provenance: dict) -> Path:
        if len(self._closed) != len(self.shards):
            raise ValueError(f"{self.out_dir}: finished before every tensor was written")
        if len(self.shards) > 1:
            weight_map = {name: file for file, shard in zip(self.names, self.shards) for name, _ in shard}
            metadata = {"total_parameters": self.total_parameters, "total_size": self.total_size}
            index = {"metadata": metadata, "weight_map": weight_map}
            (self.tmp_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if self.base_dir is not None:
            copy_model_files(self.base_dir, self.tmp_dir)
        make_inference_ready(self.tmp_dir, out_dtype)
        (self.tmp_dir / "relex.json").write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        for writer in self._open.values():
            writer.abort()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
