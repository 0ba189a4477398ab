"""verl's unmerged FSDP checkpoints, read shard by shard: no merge step, no second copy on disk.

    global_step_N/actor/model_world_size_W_rank_R.pt     R = 0 … W-1: rank R's part of every tensor
    global_step_N/actor/huggingface/                     config.json and tokenizer (weights only once merged)

Each `.pt` file is the state dict one rank saved with `torch.save`: tensor name -> DTensor (FSDP2, or FSDP with
DTensor state dicts), whose local part is that rank's shard, `Shard(d)` along one dimension or `Replicate()`, on a
one-dimensional device mesh of the W ranks. A tensor is the concatenation of its ranks' parts along the sharded
dimension in rank order (what verl's model merger computes); rows of a tensor sharded along its rows are assembled
from the ranks that hold them only.

Each file is taken apart without building a tensor (relex.io.torch_save: Python's C unpickler, every global it
meets mapped to a small record): names, shapes, dtypes, placements and where each part's values lie in the file,
in a seventh of the time `torch.load` takes. A file holding any other object (a class of the training
code, a function, a string beside the tensors) is refused in one line naming the file; relex never unpickles
freely. A file those records cannot describe (another torch's pickling) is loaded with
`torch.load(weights_only=True, mmap=True)` instead, and its values are then read through torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader, TensorInfo
from relex.io.safetensors_file import pread_exactly
from relex.io.torch_save import DTensorRecord, Refused, Storage, TensorRecord, Unknown, read_records

LOG = logging.getLogger(__name__)

_SHARD = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def shard_files(folder: str | Path) -> list[Path]:
    """The `model_world_size_W_rank_R.pt` files of `folder` in rank order (empty when there are none)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = {}
    for path in folder.iterdir():
        if match := _SHARD.fullmatch(path.name):
            found[(int(match[1]), int(match[2]))] = path
    if not found:
        return []
    worlds = sorted({world for world, _ in found})
    if len(worlds) > 1:
        raise RelexError(f"{folder}: shards of world sizes {worlds} side by side; keep the files of one run only")
    world = worlds[0]
    missing = [rank for rank in range(world) if (world, rank) not in found]
    if missing or len(found) != world:
        raise RelexError(f"{folder}: model_world_size_{world}_rank_R.pt for R = {missing[:5]} missing (world size {world})")
    return [found[(world, rank)] for rank in range(world)]


def open_checkpoint(folder: str | Path, direct: bool = False):
    """A reader of a checkpoint folder: unmerged verl shards (`VerlShardReader`) or safetensors (`CheckpointReader`)."""
    if shard_files(folder) and not any(Path(folder).glob("*.safetensors")):
        return VerlShardReader(folder)
    return CheckpointReader(folder, direct)


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """One rank's state dict: tensors (or DTensors) by name, memory-mapped; anything else is refused."""
    import torch.distributed.tensor  # noqa: F401 - registers the DTensor classes as loadable with weights_only

    # unpickling a device mesh warns that no process group exists yet; none is needed to read the local parts
    with _quiet("torch.distributed.device_mesh"):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # pickle.UnpicklingError for a refused object; RuntimeError for a broken file
            reason = " ".join(str(error).split())
            refused = re.search(r"(?:unsupported global:? GLOBAL|unsupported GLOBAL) (\S+)", reason, re.IGNORECASE)
            what = f"a pickled {refused[1]}" if refused else f"something torch.load cannot read ({reason[:150]})"
            raise RelexError(f"{path}: holds {what}; relex reads only tensors") from None
    if not isinstance(state, dict):
        raise RelexError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise RelexError(f"{path}: holds a {type(value).__name__} under {str(name)[:80]!r}; relex reads only tensors")
    return state


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class ShardFile:
    """One rank's `.pt` file, open for reads a caller makes itself (relex.store.TensorFiles): its plain
    descriptor, and the error for a read that found fewer bytes than the file held when it was opened."""

    direct = False

    def __init__(self, path: Path):
        self.path = path
        self.descriptor = os.open(path, os.O_RDONLY)

    def short_read(self, name: str) -> RelexError:
        return RelexError(f"{self.path}: truncated or rewritten since it was opened (short read of tensor {name})")

    def close(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


class VerlShardReader:
    """Reads named tensors (or row ranges of them) from verl's per-rank `.pt` shards; the CheckpointReader interface.

    Each rank's file is taken apart once into records (`read_shard`): names, shapes, dtypes, placements and where
    each part's values lie, which is all ingest and a pass through the kernels need. Blocks read for a tensor
    split along its rows (or held whole by every rank) come from those places too; only a tensor split otherwise
    (or a file the records cannot describe) is read through `torch.load`, loaded on first need."""

    def __init__(self, folder: str | Path, direct: bool = False):
        self.folder = Path(folder)
        self.paths = shard_files(self.folder)
        if not self.paths:
            raise RelexError(f"{self.folder}: no model_world_size_W_rank_R.pt files")
        self.files = {path.name: path for path in self.paths}  # what a store's size counts
        self._ranks: list[tuple[dict, dict]] | None = None  # per rank: name -> record, storage key -> (offset, bytes)
        self._opened: list[ShardFile] | None = None
        self._states: list[dict[str, torch.Tensor]] | None = None  # torch.load's, for what the records cannot read

    def _records(self) -> list[tuple[dict, dict]]:
        """Every rank's records (taken apart on first use), checked to name the same tensors."""
        if self._ranks is None:
            ranks = [read_shard(path) for path in self.paths]
            for path, (state, _) in zip(self.paths[1:], ranks[1:]):
                if set(state) != set(ranks[0][0]):
                    odd = sorted(set(state) ^ set(ranks[0][0]))[0]
                    raise RelexError(f"{path}: tensor {odd} is in some ranks' shards and not in others")
            self._ranks = ranks
        return self._ranks

    def _parts(self, name: str) -> list[TensorRecord | DTensorRecord]:
        try:
            return [state[name] for state, _ in self._records()]
        except KeyError:
            raise RelexError(f"{self.folder}: tensor {name} is missing") from None

    def names(self) -> list[str]:
        return sorted(self._records()[0][0])

    def info(self, name: str) -> TensorInfo:
        part = self._parts(name)[0]
        return TensorInfo(tuple(part.shape), part.dtype)

    def infos(self) -> dict[str, TensorInfo]:
        return {name: self.info(name) for name in self.names()}

    def shared(self) -> list[set[str]]:
        """Sets of two or more names whose parts are the same memory in every rank's shard: a model's tied weights
        (`lm_head.weight` and `model.embed_tokens.weight`), which its `state_dict()` holds under both names and
        `torch.save` writes once. A merged checkpoint (`save_pretrained`), and so the base, keeps one of the names
        only. Empty tensors share nothing."""
        groups: dict[tuple, set[str]] = {}
        for name in self.names():
            parts = self._parts(name)
            where = []
            for part in map(_local, parts):
                if part.numel == 0:
                    break
                where.append((part.storage.key, part.storage_offset, part.shape, part.stride, part.dtype))
            else:
                groups.setdefault((tuple(where), self._shard_dim(name, parts[0])), set()).add(name)
        return [names for names in groups.values() if len(names) > 1]

    def segments(self, name: str) -> list[tuple[ShardFile, int, int]] | None:
        """Where tensor `name`'s values lie in the rank files, for a caller that reads them itself (relex.store.
        TensorFiles): (file, byte offset, values) for each rank's part in order, for a tensor split along its rows
        (`Shard(0)`), or rank 0's part for one every rank holds whole; None where the parts are not runs of the
        whole's values in order (a split along another dimension, a part that is not contiguous) or where a
        file's layout could not be told (read through torch.load)."""
        parts = self._parts(name)
        dim = self._shard_dim(name, parts[0])
        if dim not in (None, 0) or len(parts[0].shape) == 0:
            return None
        ranks = list(zip(self._open_files(), self._records(), map(_local, parts)))
        if dim is None:
            ranks = ranks[:1]
        segments = []
        for file, (_, places), local in ranks:
            if local.numel == 0:
                continue
            if local.storage.key not in places or not local.is_contiguous() or local.dtype != parts[0].dtype:
                return None
            segments.append((file, _value_offset(file.path, name, local, places), local.numel))
        if sum(values for _, _, values in segments) != math.prod(parts[0].shape):  # padded parts, say: in blocks
            return None
        return segments

    def _open_files(self) -> list[ShardFile]:
        """Each rank's file, opened for reads."""
        if self._opened is None:
            self._opened = [ShardFile(path) for path in self.paths]
        return self._opened

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, assembled from the ranks' parts; with `rows=(a, b)`, only rows a..b-1."""
        info, segments = self.info(name), self.segments(name)
        if segments is None:
            return self._read_loaded(name, rows)
        first, last = self._rows(info, rows)
        out = torch.empty((last - first, *info.shape[1:]), dtype=info.dtype)
        _read_values(name, segments, first * math.prod(info.shape[1:]), out)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """The tensor (or rows a..b-1) into `out`, straight from the files where `out` is contiguous and of its dtype."""
        info = self.info(name)
        first, last = self._rows(info, rows)
        row = math.prod(info.shape[1:])
        fits = out.dtype == info.dtype and out.is_contiguous() and out.numel() == (last - first) * row
        segments = self.segments(name) if fits else None  # else `read` finds them, or reads through torch
        if segments is None:
            out.copy_(self.read(name, rows).reshape(out.shape))
            return
        _read_values(name, segments, first * row, out)

    @staticmethod
    def _rows(info: TensorInfo, rows: tuple[int, int] | None) -> tuple[int, int]:
        """The first and past-the-last row that `rows` asks for (all when None)."""
        if rows is None or not info.shape:
            return 0, info.shape[0] if info.shape else 1
        first = min(rows[0], info.shape[0])
        return first, max(first, min(rows[1], info.shape[0]))

    def _read_loaded(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """The tensor (or rows a..b-1) from the ranks' state dicts as torch.load builds them."""
        if self._states is None:
            self._states = [load_shard(path) for path in self.paths]
        parts = [state[name] for state in self._states]
        dim = self._shard_dim(name, self._parts(name)[0])
        locals_ = [_local_tensor(part) for part in parts]
        if dim is None:
            whole = locals_[0]
            return (whole if rows is None else whole[rows[0] : rows[1]]).clone()
        if dim != 0 or rows is None:
            whole = torch.cat(locals_, dim=dim)
            return whole if rows is None else whole[rows[0] : rows[1]].clone()
        pieces, start = [], 0
        for local in locals_:
            end = start + local.shape[0]
            a, b = max(rows[0], start), min(rows[1], end)
            if a < b:
                pieces.append(local[a - start : b - start])
            start = end
        return torch.cat(pieces) if pieces else locals_[0][:0].clone()

    def _shard_dim(self, name: str, part: TensorRecord | DTensorRecord) -> int | None:
        """The dimension the ranks split `name` along, None when each holds all of it (or it is a plain tensor)."""
        if not isinstance(part, DTensorRecord):
            return None
        if len(part.placements) != 1:
            raise RelexError(
                f"{self.folder}: tensor {name} is placed {_placed(part)} on a {len(part.placements)}-dimensional device "
                "mesh; relex reads shards of one-dimensional FSDP meshes; merge this checkpoint with verl's model merger"
            )
        kind, fields = part.placements[0]
        if kind == "Replicate":
            return None
        if kind == "Shard" and isinstance(fields.get("dim"), int):
            return fields["dim"] % len(part.shape) if part.shape else fields["dim"]
        raise RelexError(f"{self.folder}: tensor {name} has placement {_placed(part)}; only Shard and Replicate can be read")

    def __enter__(self) -> "VerlShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for file in self._opened or ():
            file.close()
        self._ranks, self._opened, self._states = None, None, None


def read_shard(path: Path) -> tuple[dict, dict[str, tuple[int, int]]]:
    """One rank's state dict as records (relex.io.torch_save: name -> TensorRecord or DTensorRecord) and its
    storages' places in the file (key -> byte offset, bytes). A file the records cannot describe is loaded by
    torch instead (`load_shard`, which refuses what is not a tensor) and its records have no places, so that its
    tensors are read through torch."""
    try:
        state, places = read_records(path)
    except Refused as refused:
        raise RelexError(f"{path}: holds a pickled {refused.what}; relex reads only tensors") from None
    except Unknown as why:
        LOG.info("%s: read through torch.load (%s)", path, why)
        return {name: _record_of(value) for name, value in load_shard(path).items()}, {}
    if not isinstance(state, dict):
        raise RelexError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, (TensorRecord, DTensorRecord)):
            raise RelexError(f"{path}: holds a {type(value).__name__} under {str(name)[:80]!r}; relex reads only tensors")
    return dict(state), places


def _record_of(tensor: torch.Tensor) -> TensorRecord | DTensorRecord:
    """The record of a tensor torch.load built (no place in the file: its storage key is its address)."""
    local = _local_tensor(tensor)
    storage = local.untyped_storage()
    record = TensorRecord(Storage(f"@{storage.data_ptr()}", local.dtype, storage.nbytes() // local.element_size()),
                          local.storage_offset(), tuple(local.shape), local.stride())
    if local is tensor:
        return record
    placements = tuple((type(p).__name__, {"dim": p.dim} if hasattr(p, "dim") else {}) for p in tensor.placements)
    return DTensorRecord(record, tuple(tensor.shape), tensor.dtype, placements)


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a tensor torch.load built: a DTensor's local tensor, or a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local(part: TensorRecord | DTensorRecord) -> TensorRecord:
    """A rank's own part of a tensor in its shard: a DTensor's local tensor, or a plain tensor itself."""
    return part.local if isinstance(part, DTensorRecord) else part


def _placed(part: DTensorRecord) -> str:
    return "(" + ", ".join(f"{kind}({', '.join(f'{k}={v}' for k, v in fields.items())})" for kind, fields in part.placements) + ")"


def _value_offset(path: Path, name: str, local: TensorRecord, places: dict[str, tuple[int, int]]) -> int:
    """The byte offset of a part's first value in its file, after checking that its values lie within its storage's
    record."""
    offset, nbytes = places[local.storage.key]
    size = local.dtype.itemsize
    if (local.storage_offset + local.extent()) * size > nbytes or local.storage_offset < 0:
        raise RelexError(f"{path}: tensor {name} lies past the end of its storage (a damaged file)")
    return offset + local.storage_offset * size


def _read_values(name: str, segments: list[tuple[ShardFile, int, int]], start: int, out: torch.Tensor) -> None:
    """Values start.. of the tensor whose segments these are, into `out` (C-contiguous), by pread."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    size, stop, at = out.element_size(), start + out.numel(), 0
    for file, offset, values in segments:
        a, b = max(start, at), min(stop, at + values)
        if a < b and not pread_exactly(file.descriptor, view[(a - start) * size : (b - start) * size], offset + (a - at) * size):
            raise file.short_read(name)
        at += values
