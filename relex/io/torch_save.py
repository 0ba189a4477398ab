"""What a `torch.save` file holds, read without building a tensor: each tensor's dtype, shape, strides and where its
values lie in the file; for a DTensor, its global shape and placements as well.

    archive/data.pkl        the pickled object: tensors refer to their storages by key ("0", "1", …)
    archive/data/KEY        each storage's bytes, one stored (uncompressed) zip record
    archive/byteorder       "little" (absent in old files: little)

`torch.load(weights_only=True)` unpickles in Python, building every tensor and, for verl's FSDP shards, every
DTensor's device mesh: 54–81 ms for one rank's file of SmolLM2-135M here, in every pass and ingest, and a run
saved by 8 ranks at 20 steps has 160 such files. This reads the same pickle with Python's C unpickler into plain
records instead (`TensorRecord`, `DTensorRecord`): 8–12 ms (`scripts/bench_shards.py`). It never calls what the pickle names:
each global it may name maps to one of the small builders below, the DTensor classes (`torch.distributed.*`) to
inert records of their state, and any other global is refused (`Refused`, naming it), as `weights_only` refuses
it. A torch global this reader does not know (another torch version's way of pickling a tensor) is `Unknown`:
the caller then lets torch itself load the file.

Where a tensor's values lie comes from the zip's own headers (`record_offsets`), not from torch.
"""

from __future__ import annotations

import gc
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch


class Refused(Exception):
    """The pickle names a global outside torch's tensors and DTensors (`what`: module.name), which relex never
    unpickles."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class Unknown(Exception):
    """The file is a torch.save file this reader cannot take apart (an unknown torch global, a compressed record,
    a layout of another version); torch.load may still read it."""


@dataclass(frozen=True)
class Storage:
    key: str  # its record: archive/data/KEY
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRecord:
    storage: Storage
    storage_offset: int  # in values
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected, stride = 1, {}
        for dim in reversed(range(len(self.shape))):
            stride[dim] = expected
            expected *= self.shape[dim]
        return all(self.shape[d] <= 1 or self.stride[d] == stride[d] for d in range(len(self.shape)))

    def extent(self) -> int:
        """How many of its storage's values, from `storage_offset` on, the tensor spans."""
        if self.numel == 0:
            return 0
        return 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride))


@dataclass(frozen=True)
class DTensorRecord:
    """A DTensor: this rank's part (`local`), the whole's shape and dtype, and its placements, each (class name,
    its fields), e.g. ("Shard", {"dim": 0}) or ("Replicate", {})."""

    local: TensorRecord
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[tuple[str, dict], ...]


def read_records(path: str | Path) -> tuple[object, dict[str, tuple[int, int]]]:
    """What `path` holds, with records in place of tensors, and each storage key's (byte offset, bytes) in the file.
    Raises Refused for a global relex never unpickles, Unknown where torch.load should decide."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickled = [name for name in archive.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
            if len(pickled) != 1:
                raise Unknown(f"{len(pickled)} data.pkl records")
            prefix = pickled[0][: -len("data.pkl")]
            order = f"{prefix}byteorder"
            if order in archive.namelist() and archive.read(order).strip() != b"little":
                raise Unknown("big-endian values")
            offsets = _storage_offsets(path, archive, f"{prefix}data/")
            state = _unpickle(archive.read(pickled[0]))
    except (zipfile.BadZipFile, OSError, EOFError, struct.error) as error:
        raise Unknown(str(error)) from None
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, IndexError, KeyError) as error:
        raise Unknown(f"unexpected pickle ({error})") from None
    return state, offsets


def _unpickle(pickled: bytes):
    """The records the pickle holds. The cyclic garbage collector is held off meanwhile: the records make thousands
    of small objects and none are garbage (one of SmolLM2's shards: 8.3–8.6 ms without it, 11.5–13.1 ms with)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Unpickler(io.BytesIO(pickled)).load()
    finally:
        if collecting:
            gc.enable()


def _storage_offsets(path, archive: zipfile.ZipFile, folder: str) -> dict[str, tuple[int, int]]:
    """Each storage record's (offset of its first byte, bytes), from the zip's local headers."""
    found = {}
    with open(path, "rb") as handle:
        for info in archive.infolist():
            if not info.filename.startswith(folder) or "/" in info.filename[len(folder) :]:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise Unknown(f"record {info.filename} is compressed")
            handle.seek(info.header_offset)
            header = handle.read(30)
            signature, *_, name_bytes, extra_bytes = struct.unpack("<IHHHHHIIIHH", header)
            if signature != 0x04034B50:
                raise Unknown(f"record {info.filename} has no local header")
            found[info.filename[len(folder) :]] = (info.header_offset + 30 + name_bytes + extra_bytes, info.file_size)
    return found


# the storage classes `torch.save` names, by the dtype of their values
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128, "UntypedStorage": torch.uint8,
}


# torch's dtypes by the names a pickle gives them (torch.float32, torch.bfloat16, …): read from the module's own
# namespace, since looking a name up on the module could import one of its lazily loaded submodules
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _StateDict(dict):
    """A state dict's OrderedDict, which `torch.save` pickles with its `_metadata` attribute."""


class _StorageKind:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _Inert:
    """A torch.distributed object (a DTensor's spec, mesh or placement), kept as its class name and state."""

    kind = "?"

    def __init__(self, *args):  # what it was built from is not kept: only its state is read
        self.state = {}

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {"state": state}


class _DTensorClass:
    """What the pickle's `torch.distributed.tensor.DTensor` stands for: only passed to the builders below."""


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    if not isinstance(storage, Storage):
        raise Unknown("a tensor without a stored storage")
    return TensorRecord(storage, int(storage_offset), tuple(map(int, size)), tuple(map(int, stride)))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    record = _rebuild_tensor(storage, storage_offset, size, stride)
    if record.storage.dtype != dtype:  # an untyped storage: its values are `dtype`
        if record.storage.dtype != torch.uint8 or record.storage.numel % dtype.itemsize:
            raise Unknown(f"a {dtype} tensor on a {record.storage.dtype} storage")
        typed = Storage(storage.key, dtype, storage.numel // dtype.itemsize)
        record = TensorRecord(typed, record.storage_offset, record.shape, record.stride)
    return record


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


class _Wrapper:
    """A tensor subclass built empty (`torch._utils._rebuild_wrapper_subclass`); `_rebuild_from_type` reads its state."""

    def __init__(self, kind, dtype, size, stride=None, storage_offset=None, layout=None, device=None, requires_grad=False):
        self.kind, self.dtype, self.shape = kind, dtype, tuple(map(int, size))


def _rebuild_from_type(func, new_type, args, state):
    built = func(*args)
    if not isinstance(built, _Wrapper) or built.kind is not _DTensorClass or new_type is not _DTensorClass:
        raise Unknown("a tensor subclass other than DTensor")
    if isinstance(state, tuple):
        state = {key: value for part in state if isinstance(part, dict) for key, value in part.items()}
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, TensorRecord) or not isinstance(spec, _Inert):
        raise Unknown("a DTensor without its local tensor or spec")
    placements = spec.state.get("placements")
    if not isinstance(placements, tuple) or not all(isinstance(p, _Inert) for p in placements):
        raise Unknown("a DTensor's placements")
    return DTensorRecord(local, built.shape, built.dtype, tuple((p.kind, dict(p.state)) for p in placements))


_BUILDERS = {
    ("collections", "OrderedDict"): _StateDict,
    ("torch", "Size"): tuple,
    ("torch", "device"): str,
    ("torch.serialization", "_get_layout"): str,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _Wrapper,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.distributed.tensor", "DTensor"): _DTensorClass,
    ("torch.distributed.tensor.api", "DTensor"): _DTensorClass,
    ("torch.distributed._tensor.api", "DTensor"): _DTensorClass,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _BUILDERS:
            return _BUILDERS[module, name]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageKind(_STORAGE_DTYPES[name])
        if module.startswith("torch.distributed."):
            return type(name, (_Inert,), {"kind": name})
        if module == "torch" or module.startswith("torch."):
            raise Unknown(f"global {module}.{name}")
        raise Refused(f"{module}.{name}")

    def persistent_load(self, saved):
        if not (isinstance(saved, tuple) and len(saved) == 5 and saved[0] == "storage" and isinstance(saved[1], _StorageKind)):
            raise Unknown(f"persistent id {str(saved)[:80]}")
        _, kind, key, _location, numel = saved
        return Storage(str(key), kind.dtype, int(numel))
