"""Read tensors, or row ranges of them, from a safetensors file with positioned reads instead of a memory map.

A memory-mapped file keeps every page it has touched in the process's resident set until it is unmapped, so
streaming a whole trajectory through `safe_open` makes RSS grow to the size of the data. Reading with `os.pread`
straight into a buffer the caller reuses (`read_into`) keeps memory at one block and costs one copy (page cache
to buffer) per value. The header is validated against the file size on open, so a truncated or corrupt file
fails at once, naming itself.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.dtypes import SAFETENSORS_TO_TORCH

MAX_HEADER_BYTES = 100 * 2**20
DIRECT_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's block size
DIRECT_PIECE = 8 * 2**20  # bytes per direct read
_bounce = threading.local()  # one page-aligned buffer per thread for direct reads


def _bounce_buffer(size: int) -> mmap.mmap:
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _bounce.buffer = mmap.mmap(-1, size)  # anonymous maps are page-aligned
    return buffer


class SafetensorsFile:
    """One safetensors file. With `direct=True`, values are read with O_DIRECT where the OS and file system allow
    it: from storage into an aligned buffer and copied from there, bypassing the page cache (no kernel copy, no
    cache pollution), which is what a trajectory larger than RAM wants. Elsewhere it falls back to plain reads."""

    def __init__(self, path: str | Path, direct: bool = False):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise RelexError(f"{self.path}: cannot open ({error.strerror})") from None
        self._direct_fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # e.g. tmpfs: no direct I/O there, plain reads it is
                self._direct_fd = -1
        self.size = os.fstat(self._fd).st_size
        self.header, self.data_start = self._read_header()

    @property
    def direct(self) -> bool:
        return self._direct_fd >= 0

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
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        if self._direct_fd >= 0:
            try:
                self._read_direct(name, offset, nbytes, view)
                return
            except OSError:  # the file system took O_DIRECT at open but refuses the read: plain reads from now on
                os.close(self._direct_fd)
                self._direct_fd = -1
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise self._fail(f"short read of tensor {name}")
            done += got

    def _read_direct(self, name: str, offset: int, nbytes: int, view: memoryview) -> None:
        """Bytes offset..offset+nbytes into `view`, in aligned pieces through this thread's bounce buffer."""
        bounce = _bounce_buffer(DIRECT_PIECE)
        done = 0
        while done < nbytes:
            start = (offset + done) // DIRECT_ALIGN * DIRECT_ALIGN
            skip = offset + done - start
            length = min(DIRECT_PIECE, -(-(skip + nbytes - done) // DIRECT_ALIGN) * DIRECT_ALIGN)
            got = os.preadv(self._direct_fd, [memoryview(bounce)[:length]], start)
            take = min(got - skip, nbytes - done)
            if take <= 0:
                raise self._fail(f"short read of tensor {name}")
            view[done : done + take] = memoryview(bounce)[skip : skip + take]
            done += take

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
