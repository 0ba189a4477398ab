"""verl's unmerged FSDP checkpoints, read shard by shard: no merge step, no second copy on disk.

    global_step_N/actor/model_world_size_W_rank_R.pt     R = 0 … W-1: rank R's part of every tensor
    global_step_N/actor/huggingface/                     config.json and tokenizer (weights only once merged)

Each `.pt` file is the state dict one rank saved with `torch.save`: tensor name -> DTensor (FSDP2, or FSDP with
DTensor state dicts), whose local part is that rank's shard, `Shard(d)` along one dimension or `Replicate()`, on a
one-dimensional device mesh of the W ranks. A tensor is the concatenation of its ranks' parts along the sharded
dimension in rank order (what verl's model merger computes); rows of a tensor sharded along its rows are assembled
from the ranks that hold them only.

The files are opened with `torch.load(weights_only=True, mmap=True)`: the unpickler builds tensors and the classes
torch registers for DTensors (the DTensor, its spec and placements, the device mesh), nothing else, and the values
stay on disk until a tensor is read. A file holding any other object (a class of the training code, a function,
a string beside the tensors) is refused in one line naming the file; relex never unpickles freely.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader, TensorInfo

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


def _local(value: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a tensor in its shard: a DTensor's local tensor, or a plain tensor itself."""
    return value.to_local() if hasattr(value, "to_local") else value


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


_STORAGE_RECORD = re.compile(r"(?:^|/)data/\d+")  # the zip records `torch.save` writes a storage's bytes in


def _record_base(path: Path, storages: dict[int, int]) -> int | None:
    """Where `torch.load(mmap=True)` mapped `path`: the address of its byte 0, found from the storages it loaded
    (`storages`: data pointer -> bytes), each at the offset of its own record in the zip file (torch's reader gives
    every record's offset and size; `torch.save` writes each storage as one stored, uncompressed record). None
    unless exactly one address puts every storage at a record of its size."""
    if not storages:
        return None
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = {reader.get_record_offset(name): reader.get_record_size(name)
                   for name in reader.get_all_records() if _STORAGE_RECORD.fullmatch(name)}
    except (AttributeError, RuntimeError):  # a torch without this reader, or not a zip file
        return None
    first, found = min(storages), set()
    for offset in records:
        base = first - offset
        if all(records.get(pointer - base) == size for pointer, size in storages.items()):
            found.add(base)
    return found.pop() if len(found) == 1 else None


class VerlShardReader:
    """Reads named tensors (or row ranges of them) from verl's per-rank `.pt` shards; the CheckpointReader interface."""

    def __init__(self, folder: str | Path, direct: bool = False):
        self.folder = Path(folder)
        self.paths = shard_files(self.folder)
        if not self.paths:
            raise RelexError(f"{self.folder}: no model_world_size_W_rank_R.pt files")
        self.files = {path.name: path for path in self.paths}  # what a store's size counts
        self._states: list[dict[str, torch.Tensor]] | None = None
        self._opened: list[tuple[ShardFile, int | None]] | None = None  # per rank: its file and mapped address

    def _load(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's state dict (memory-mapped, loaded on first use), checked to name the same tensors."""
        if self._states is None:
            states = [load_shard(path) for path in self.paths]
            for path, state in zip(self.paths[1:], states[1:]):
                if set(state) != set(states[0]):
                    odd = sorted(set(state) ^ set(states[0]))[0]
                    raise RelexError(f"{path}: tensor {odd} is in some ranks' shards and not in others")
            self._states = states
        return self._states

    def _parts(self, name: str) -> list[torch.Tensor]:
        try:
            return [state[name] for state in self._load()]
        except KeyError:
            raise RelexError(f"{self.folder}: tensor {name} is missing") from None

    def names(self) -> list[str]:
        return sorted(self._load()[0])

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
            for part in parts:
                local = _local(part)
                if local.numel() == 0:
                    break
                where.append((local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(), local.dtype))
            else:
                groups.setdefault((tuple(where), self._shard_dim(name, parts[0])), set()).add(name)
        return [names for names in groups.values() if len(names) > 1]

    def segments(self, name: str) -> list[tuple[ShardFile, int, int]] | None:
        """Where tensor `name`'s values lie in the rank files, for a caller that reads them itself (relex.store.
        TensorFiles): (file, byte offset, values) for each rank's part in order, for a tensor split along its rows
        (`Shard(0)`), or rank 0's part for one every rank holds whole; None where the parts are not runs of the
        whole's values in order (a split along another dimension, a part that is not contiguous) or where a
        file's layout cannot be told (`_record_base`)."""
        parts = self._parts(name)
        dim = self._shard_dim(name, parts[0])
        if dim not in (None, 0) or len(parts[0].shape) == 0:
            return None
        locals_ = [_local(part) for part in parts]
        if dim is None:
            locals_ = locals_[:1]
        opened = self._open_files()
        segments = []
        for (file, base), local in zip(opened, locals_):
            if local.numel() == 0:
                continue
            if base is None or not local.is_contiguous() or local.dtype != locals_[0].dtype:
                return None
            offset = local.untyped_storage().data_ptr() - base + local.storage_offset() * local.element_size()
            segments.append((file, offset, local.numel()))
        if sum(values for _, _, values in segments) != parts[0].numel():  # padded parts, say: read in blocks
            return None
        return segments

    def _open_files(self) -> list[tuple[ShardFile, int | None]]:
        """Each rank's file, opened for reads, and where torch mapped it (None: unknown, so read in blocks)."""
        if self._opened is None:
            opened = []
            for path, state in zip(self.paths, self._load()):
                storages = {}
                for value in state.values():
                    local = _local(value)
                    if local.numel():
                        storage = local.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
                opened.append((ShardFile(path), _record_base(path, storages)))
            self._opened = opened
        return self._opened

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, assembled from the ranks' parts; with `rows=(a, b)`, only rows a..b-1."""
        parts = self._parts(name)
        dim = self._shard_dim(name, parts[0])
        locals_ = [_local(part) for part in parts]
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

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        out.copy_(self.read(name, rows).reshape(out.shape))

    def _shard_dim(self, name: str, part: torch.Tensor) -> int | None:
        """The dimension the ranks split `name` along, None when each holds all of it (or it is a plain tensor)."""
        placements = getattr(part, "placements", None)
        if placements is None:
            return None
        if len(placements) != 1:
            raise RelexError(
                f"{self.folder}: tensor {name} is placed {placements} on a {len(placements)}-dimensional device mesh; "
                "relex reads shards of one-dimensional FSDP meshes; merge this checkpoint with verl's model merger"
            )
        placement = placements[0]
        if placement.is_replicate():
            return None
        if placement.is_shard():
            return placement.dim
        raise RelexError(f"{self.folder}: tensor {name} has placement {placement}; only Shard and Replicate can be read")

    def __enter__(self) -> "VerlShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for file, _ in self._opened or ():
            file.close()
        self._states, self._opened = None, None
