"""Read tensors, or row ranges of them, from a safetensors file with positioned reads instead of a memory map.

A memory-mapped file keeps every page it has touched in the process's resident set until it is unmapped, so
streaming a whole trajectory through `safe_open` makes RSS grow to the size of the data. Reading with `os.pread`
straight into a buffer the caller reuses (`read_into`) keeps memory at one block and costs one copy (page cache
to buffer) per value. The header is validated against the file size on open, so a truncated or corrupt file
fails at once, naming itself.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.dtypes import SAFETENSORS_TO_TORCH
from relex.util import is_int

MAX_HEADER_BYTES = 100 * 2**20
DIRECT_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's block size
DIRECT_PIECE = 8 * 2**20  # bytes per direct read
_bounce = threading.local()  # one page-aligned buffer per thread for direct reads


def _is_count(value) -> bool:
    return is_int(value) and value >= 0


def _shown(value) -> str:
    """A value from an untrusted header, short and printable, for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"tensor {_shown(key)} is listed twice")
        out[key] = value
    return out


def pread_exactly(fd: int, view: memoryview, offset: int) -> bool:
    """Bytes offset..offset+len(view) of the open file `fd` into `view` (pread, as many calls as it takes): True, or
    False when the file ends first (it was cut short or rewritten since its layout was read)."""
    done, nbytes = 0, len(view)
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            return False
        done += got
    return True


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
        self._direct_refused = False  # a direct read failed: plain reads from then on (the descriptor stays open)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # e.g. tmpfs: no direct I/O there, plain reads it is
                self._direct_fd = -1
        self.size = os.fstat(self._fd).st_size
        self.header, self.data_start = self._read_header()

    @property
    def direct(self) -> bool:
        return self._direct_fd >= 0 and not self._direct_refused

    @property
    def descriptor(self) -> int:
        """The file's plain (page-cache) descriptor, for a caller that reads spans itself (relex.store.TensorFiles)."""
        return self._fd

    def short_read(self, name: str) -> RelexError:
        """The error for a read of tensor `name` that found fewer bytes than its header promised (the file was
        truncated or rewritten after it was opened)."""
        return self._fail(f"short read of tensor {name}")

    def _fail(self, why: str) -> RelexError:
        return RelexError(f"{self.path}: corrupt or truncated safetensors file ({why})")

    def _read_header(self) -> tuple[dict, int]:
        """The header, checked as the safetensors format demands before anything is allocated or read."""
        if self.size < 8:
            raise self._fail(f"{self.size} bytes")
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if length > min(MAX_HEADER_BYTES, self.size - 8):
            raise self._fail(f"header length {length} in a file of {self.size} bytes")
        try:
            header = json.loads(os.pread(self._fd, length, 8), object_pairs_hook=_unique_keys)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            raise self._fail(f"header is not JSON: {str(error)[:100]}") from None
        except ValueError as error:  # a name given twice
            raise self._fail(str(error)) from None
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise self._fail("__metadata__ must map names to strings")
        data_start = 8 + length
        spans = sorted((self._check_entry(name, entry), name) for name, entry in header.items())
        position = 0
        for (begin, end), name in spans:
            if begin != position:
                what = "overlaps the tensor before it" if begin < position else f"leaves a gap of {begin - position} bytes before it"
                raise self._fail(f"tensor {_shown(name)} at bytes {begin}..{end} {what}")
            position = end
        if data_start + position != self.size:
            raise self._fail(f"header describes {data_start + position} bytes, the file has {self.size}")
        return header, data_start

    def _check_entry(self, name: str, entry) -> tuple[int, int]:
        """(begin, end) of one tensor after checking its dtype, shape and offsets against each other."""
        if not isinstance(entry, dict):
            raise self._fail(f"tensor {_shown(name)}: entry is a JSON {type(entry).__name__}, not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_TO_TORCH:
            raise RelexError(f"{self.path}: tensor {_shown(name)} has unsupported dtype {_shown(dtype)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._fail(f"tensor {_shown(name)}: shape {_shown(shape)} is not a list of non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise self._fail(f"tensor {_shown(name)}: data_offsets {_shown(offsets)} are not two non-negative integers")
        begin, end = offsets
        if end < begin:
            raise self._fail(f"tensor {_shown(name)}: data_offsets {begin}..{end} run backwards")
        if end > self.size:
            raise self._fail(f"tensor {_shown(name)}: data_offsets end at {end}, beyond the file's {self.size} bytes")
        numel = math.prod(shape)
        nbytes = numel * SAFETENSORS_TO_TORCH[dtype].itemsize
        if end - begin != nbytes:
            raise self._fail(f"tensor {_shown(name)}: shape {shape} of {dtype} takes {nbytes} bytes, data_offsets give {end - begin}")
        return begin, end

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

    def read(self, name: str, rows: tuple[int, int] | None = None, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, or rows a..b-1 of its first dimension, in its stored dtype (a new, writable tensor; with
        `buffer`, a flat uint8 tensor of at least its bytes, a view of that instead of new memory)."""
        _, nbytes, shape = self.span(name, rows)
        dtype = self.dtype(name)
        if buffer is not None and buffer.numel() >= nbytes:
            out = buffer[:nbytes].view(dtype).view(shape)
        else:
            out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out, rows)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Fill the contiguous CPU tensor `out` (stored dtype, same number of values) straight from the file."""
        offset, nbytes, _ = self.span(name, rows)
        if out.dtype != self.dtype(name) or not out.is_contiguous() or out.numel() * out.element_size() != nbytes:
            raise ValueError(f"{self.path}: tensor {name}: cannot read {nbytes} bytes of {self.dtype(name)} into {out.dtype} {tuple(out.shape)}")
        if nbytes:
            self.fill(name, offset, memoryview(out.reshape(-1).view(torch.uint8).numpy()))

    def fill(self, name: str, offset: int, view: memoryview) -> None:
        """Bytes offset..offset+len(view) of the file (a span of tensor `name`, from `span`) into the byte buffer
        `view`, the caller having checked that they fit: `read_into` without its per-call checks and views, for a
        caller reading many rows of known layout (relex.store)."""
        nbytes = len(view)
        if self.direct:
            try:
                self._read_direct(name, offset, nbytes, view)
                return
            except OSError:  # the file system took O_DIRECT at open but refuses the read: plain reads from now on
                # not closed here: another reader thread may be using the descriptor, and a number closed under it
                # can be reused for another file at once; `close` closes it
                self._direct_refused = True
        if not pread_exactly(self._fd, view, offset):
            raise self.short_read(name)

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
                raise self.short_read(name)
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
