"""Read tensors, or row ranges of them, from a safetensors file with positioned reads instead of a memory map.

A memory-mapped file keeps every page it has touched in the process's resident set until it is unmapped, so
streaming a whole trajectory through `safe_open` makes RSS grow to the size of the data. Reading with `os.pread`
straight into a buffer the caller reuses (`read_into`) keeps memory at one block and costs one copy (page cache
to buffer) per value. The header is validated against the file size on open, so a truncated or corrupt file
fails at once, naming itself.
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

    def span(self, name: str, rows: tuple[int, int] | None = None) -> tuple[int, int, list[int]]:
        """(file offset, byte count, shape) of tensor `name`, or of its rows a..b-1."""
        entry = self.header[name]
        shape = list(entry["shape"])
        begin, end = entry["data_offsets"]
        if rows is not None and shape:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            a, b = max(0, rows[0]), min(shape[0], rows[1])
            begin, end, shape[0] = begin + a * row_bytes, begin + b * row_bytes, max(0, b - a)
        return self.data_start + begin, end - begin, shape

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or rows a..b-1 of its first dimension, in its stored dtype (a new, writable tensor)."""
        _, _, shape = self.span(name, rows)
        out = torch.empty(shape, dtype=self.dtype(name))
        self.read_into(name, out, rows)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Fill the contiguous CPU tensor `out` (stored dtype, same number of values) straight from the file."""
        offset, nbytes, _ = self.span(name, rows)
        if out.dtype != self.dtype(name) or not out.is_contiguous() or out.numel() * out.element_size() != nbytes:
            raise ValueError(f"{self.path}: tensor {name}: cannot read {nbytes} bytes of {self.dtype(name)} into {out.dtype} {tuple(out.shape)}")
        if not nbytes:
            return
        view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise self._fail(f"short read of tensor {name}")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
