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


def weight_files(folder: Path, opened: dict[Path, "SafetensorsFile"] | None = None, direct: bool = False) -> dict[str, Path]:
    """Tensor name -> safetensors file for a checkpoint folder; refuses pickles and folders without weights. A single
    file is opened for its names: given `opened` (a reader's open files), it is kept there, its header read and
    checked once, for its names and every read after; else it is closed again."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RelexError(f"{folder}: not a folder")
    index = folder / INDEX_NAME
    if index.is_file():
        paths: dict[str, Path] = {}  # one Path per file: a reader's lookups by it are then by identity (`_handle`)
        return {name: paths.setdefault(file, folder / file) for name, file in read_weight_map(index).items()}
    single = folder / SINGLE_NAME
    if single.is_file():
        file = SafetensorsFile(single, direct)
        if opened is None:
            file.close()
        else:
            opened[single] = file
        return dict.fromkeys(file.keys(), single)
    if any((folder / name).exists() for name in PICKLE_NAMES):
        raise RelexError(
            f"{folder}: holds pickled pytorch_model.bin weights, which relex does not unpickle; "
            "convert them to safetensors first (e.g. load and save_pretrained(safe_serialization=True))"
        )
    raise RelexError(f"{folder}: no {SINGLE_NAME} or {INDEX_NAME}; not a safetensors checkpoint")


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name), every file a `.safetensors` inside the folder."""
    try:
        payload = json.loads(index.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise RelexError(f"{index}: not a safetensors index (not JSON: {str(error)[:100]})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("weight_map"), dict):
        raise RelexError(f"{index}: not a safetensors index (no weight_map object)")
    weight_map = payload["weight_map"]
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _plain_file_name(file):
            shown = repr(file) if len(repr(file)) <= 60 else repr(file)[:57] + "..."
            raise RelexError(
                f"{index}: tensor {name[:80]} maps to {shown}; shards must be .safetensors files inside the folder"
            )
    return weight_map


def _plain_file_name(file: str) -> bool:
    path = Path(file)
    return (
        bool(file) and not path.is_absolute() and ".." not in path.parts and "\\" not in file
        and file.endswith(".safetensors") and file.isprintable()
    )


def read_config(folder: str | Path) -> dict | None:
    """The folder's config.json as a dict (None when there is none); anything but a JSON object is refused."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise RelexError(f"{path}: not valid JSON ({str(error)[:100]}); fix or replace the model's config.json") from None
    if not isinstance(config, dict):
        raise RelexError(f"{path}: a JSON {type(config).__name__}, not an object; fix or replace the model's config.json")
    return config


def checkpoint_infos(folder: str | Path) -> dict[str, "TensorInfo"]:
    """Name -> shape and dtype of every tensor of a checkpoint folder, its files closed again."""
    with CheckpointReader(folder) as reader:
        return reader.infos()


class CheckpointReader:
    """Reads named tensors (or row ranges of them) from one checkpoint folder, keeping file handles open until
    `close` (or the end of a `with` block)."""

    def __init__(self, folder: str | Path, direct: bool = False):
        self.folder = Path(folder)
        self.direct = direct  # read values with O_DIRECT, bypassing the page cache (see SafetensorsFile)
        self._handles: dict[Path, SafetensorsFile] = {}
        self.files = weight_files(self.folder, self._handles, direct)

    @classmethod
    def from_file(cls, path: str | Path, direct: bool = False) -> "CheckpointReader":
        """A reader over one safetensors file (the store's per-step delta files), opened here: its header is read and
        checked once, for its names and for every read after."""
        reader = cls.__new__(cls)
        path = Path(path)
        handle = SafetensorsFile(path, direct)
        reader.folder = path.parent
        reader.files = dict.fromkeys(handle.keys(), path)
        reader.direct = direct
        reader._handles = {path: handle}
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

    def file_of(self, name: str) -> SafetensorsFile:
        """The open file that holds tensor `name` (for reads of many row ranges of it, `SafetensorsFile.fill`)."""
        return self._handle(name)

    def info(self, name: str) -> TensorInfo:
        handle = self._handle(name)
        return TensorInfo(handle.shape(name), handle.dtype(name))

    def infos(self) -> dict[str, TensorInfo]:
        return {name: self.info(name) for name in self.names()}

    def shared(self) -> list[set[str]]:
        """Sets of names that hold the same values by construction (relex.io.verl_shards); none here: a
        safetensors file stores every tensor it names on its own."""
        return []

    def read(self, name: str, rows: tuple[int, int] | None = None, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name` in its stored dtype; with `rows=(a, b)`, only rows a..b-1 of its first dimension. With
        `buffer` (a flat uint8 tensor), a view of it when the values fit, instead of new memory."""
        return self._handle(name).read(name, rows, buffer)

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Fill `out` (contiguous, the stored dtype) with tensor `name` or its rows, without an intermediate copy."""
        self._handle(name).read_into(name, out, rows)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

