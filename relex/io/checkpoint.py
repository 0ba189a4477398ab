"""Lazy, read-only access to the tensors of a Hugging Face checkpoint folder.

A folder holds either `model.safetensors` or shards listed by `model.safetensors.index.json` (its `weight_map`).
Tensors are read one at a time by name, optionally a range of rows (relex.io.safetensors_file); nothing loads a
whole state dict. Pickled `.bin` weights are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.safetensors_file import SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file for a checkpoint folder; refuses pickles and folders without weights."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RelexError(f"{folder}: not a folder")
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise RelexError(f"{index}: not a safetensors index ({error})") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_NAME
    if single.is_file():
        return {name: single for name in _header_names(single)}
    if any((folder / name).exists() for name in PICKLE_NAMES):
        raise RelexError(
            f"{folder}: holds pickled pytorch_model.bin weights, which relex does not unpickle; "
            "convert them to safetensors first (e.g. load and save_pretrained(safe_serialization=True))"
        )
    raise RelexError(f"{folder}: no {SINGLE_NAME} or {INDEX_NAME}; not a safetensors checkpoint")


def _header_names(path: Path) -> list[str]:
    file = SafetensorsFile(path)
    names = file.keys()
    file.close()
    return names


class CheckpointReader:
    """Reads named tensors (or row ranges of them) from one checkpoint folder, keeping file handles open."""

    def __init__(self, folder: str | Path, direct: bool = False):
        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self.direct = direct  # read values with O_DIRECT, bypassing the page cache (see SafetensorsFile)
        self._handles: dict[Path, SafetensorsFile] = {}

    @classmethod
    def from_file(cls, path: str | Path, direct: bool = False) -> "CheckpointReader":
        """A reader over one safetensors file (the store's per-step delta files)."""
        reader = cls.__new__(cls)
        reader.folder = Path(path).parent
        reader.files = {name: Path(path) for name in _header_names(Path(path))}
        reader.direct = direct
        reader._handles = {}
        return reader

    def names(self) -> list[str]:
        return sorted(self.files)

    def _handle(self, name: str) -> SafetensorsFile:
        try:
            path = self.files[name]
        except KeyError:
            raise RelexError(f"{self.folder}: tensor {name} is missing") from None
        if path not in self._handles:
            if not path.is_file():
                raise RelexError(f"{path}: listed in the index for {name} but missing")
            self._handles[path] = SafetensorsFile(path, self.direct)
        handle = self._handles[path]
        if name not in handle.header:
            raise RelexError(f"{path}: tensor {name} is listed in the index but not in the file")
        return handle

    def info(self, name: str) -> TensorInfo:
        handle = self._handle(name)
        return TensorInfo(handle.shape(name), handle.dtype(name))

    def infos(self) -> dict[str, TensorInfo]:
        return {name: self.info(name) for name in self.names()}

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name` in its stored dtype; with `rows=(a, b)`, only rows a..b-1 of its first dimension."""
        return self._handle(name).read(name, rows)

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Fill `out` (contiguous, the stored dtype) with tensor `name` or its rows, without an intermediate copy."""
        self._handle(name).read_into(name, out, rows)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

