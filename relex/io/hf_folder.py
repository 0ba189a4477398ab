"""Write a Hugging Face model folder the way transformers writes one, streaming tensor by tensor.

Layout: size-bounded shards `model-0000i-of-0000N.safetensors` (or `model.safetensors` when one shard holds
everything), `model.safetensors.index.json` with `total_size` when sharded, `config.json` with the output dtype,
the tokenizer and generation config copied from the base, and `relex.json` saying how the folder was made.
Everything goes to a hidden temporary folder that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Sequence

import torch

from relex.errors import RelexError
from relex.io.checkpoint import INDEX_NAME, SINGLE_NAME, TensorInfo
from relex.io.dtypes import dtype_name
from relex.io.stream_writer import StreamingSafetensorsWriter, tensor_bytes

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
    """Split the ordered layout into consecutive shards of at most `max_shard_bytes` (a larger tensor stands alone)."""
    shards: list[list[tuple[str, TensorInfo]]] = [[]]
    size = 0
    for name, info in layout:
        nbytes = tensor_bytes(info)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, info))
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def copy_model_files(base_dir: Path, out_dir: Path) -> None:
    for pattern in COPIED_PATTERNS:
        for source in sorted(Path(base_dir).glob(pattern)):
            if source.is_file() and source.name != INDEX_NAME:
                shutil.copy2(source, out_dir / source.name)


def set_config_dtype(config_path: Path, dtype: torch.dtype) -> None:
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype_name(dtype)
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name(dtype)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class HFFolderWriter:
    """Streams the tensors of `layout`, in order, into a new HF folder at `out_dir`."""

    def __init__(
        self,
        out_dir: str | Path,
        layout: Sequence[tuple[str, TensorInfo]],
        *,
        base_dir: str | Path | None,
        max_shard_bytes: int = 5 * 10**9,
    ):
        self.out_dir = Path(out_dir)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.tmp_dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)
        self.shards = plan_shards(layout, max_shard_bytes)
        self.names = shard_names(len(self.shards))
        self.total_size = sum(tensor_bytes(info) for _, info in layout)
        self._writer: StreamingSafetensorsWriter | None = None
        self._shard = -1

    def write(self, name: str, values: torch.Tensor) -> None:
        """The whole tensor or its next rows; tensors come in layout order."""
        if self._writer is None or self._writer.complete:
            self._next_shard()
        self._writer.write(name, values)

    def _next_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._shard += 1
        shard = self.shards[self._shard]
        self._writer = StreamingSafetensorsWriter(self.tmp_dir / self.names[self._shard], shard, {"format": "pt"})

    def finish(self, out_dtype: torch.dtype | None, provenance: dict) -> Path:
        if self._shard != len(self.shards) - 1 or not self._writer.complete:
            raise ValueError(f"{self.out_dir}: finished before every tensor was written")
        self._writer.close()
        if len(self.shards) > 1:
            weight_map = {name: file for file, shard in zip(self.names, self.shards) for name, _ in shard}
            index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            (self.tmp_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if self.base_dir is not None:
            copy_model_files(self.base_dir, self.tmp_dir)
        if out_dtype is not None:
            set_config_dtype(self.tmp_dir / "config.json", out_dtype)
        (self.tmp_dir / "relex.json").write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
