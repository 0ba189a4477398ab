"""Read tensors, or row ranges of them, from a safetensors file with positioned reads instead of a memory map.

A memory-mapped file keeps every page it has touched in the process's resident set until it is unmapped, so
streaming a whole trajectory through `safe_open` makes RSS grow to the size of the data. Reading with `os.pread`
into a fresh buffer keeps memory at one chunk. The header is validated against the file size on open, so a
truncated or corrupt file fails at once, naming itself.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.dtypes import SAFETENSORS_TO_TORCH

MAX_HEADER_BYTES = 100 * 2**20


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise RelexError(f"{self.path}: cannot open ({error.strerror})") from None
        self.size = os.fstat(self._fd).st_size
        self.header, self.data_start = self._read_header()

    def _fail(self, why: str) -> RelexError:
        return RelexError(f"{self.path}: corrupt or truncated safetensors file ({why})")

    def _read_header(self) -> tuple[dict, int]:
        if self.size < 8:
            raise self._fail(f"{self.size} bytes")
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if length > min(MAX_HEADER_BYTES, self.size - 8):
            raise self._fail(f"header length {length} in a file of {self.size} bytes")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise self._fail(f"header is not JSON: {error}") from None
        header.pop("__metadata__", None)
        data_start = 8 + length
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        if data_start + end > self.size:
            raise self._fail(f"header promises {data_start + end} bytes, the file has {self.size}")
        for name, entry in header.items():
            if entry.get("dtype") not in SAFETENSORS_TO_TORCH:
                raise RelexError(f"{self.path}: tensor {name} has unsupported dtype {entry.get('dtype')}")
        return header, data_start

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_TO_TORCH[self.header[name]["dtype"]]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or rows a..b-1 of its first dimension, in its stored dtype (a new, writable tensor)."""
        entry = self.header[name]
        shape, dtype = list(entry["shape"]), self.dtype(name)
        begin, end = entry["data_offsets"]
        if rows is not None and shape:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            a, b = max(0, rows[0]), min(shape[0], rows[1])
            begin, end, shape[0] = begin + a * row_bytes, begin + b * row_bytes, b - a
        buffer = bytearray(end - begin)
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            got = os.preadv(self._fd, [view[done:]], self.data_start + begin + done)
            if got <= 0:
                raise self._fail(f"short read of tensor {name}")
            done += got
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
