"""A safetensors file written tensor by tensor, so memory holds one tensor (or one chunk of rows) at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range, then the raw little-endian bytes. Since the layout (names, shapes, dtypes) is known before any
value is computed, the header is written first and the bytes follow in header order.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import threading
from pathlib import Path
from typing import Sequence

import torch

from relex.io.checkpoint import TensorInfo
from relex.io.dtypes import TORCH_TO_SAFETENSORS


def tensor_bytes(info: TensorInfo) -> int:
    return info.numel * torch.empty((), dtype=info.dtype).element_size()


def _header(layout: Sequence[tuple[str, TensorInfo]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, info in layout:
        size = tensor_bytes(info)
        header[name] = {
            "dtype": TORCH_TO_SAFETENSORS[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class StreamingSafetensorsWriter:
    """Write `layout`'s tensors, in order, each whole or as consecutive row chunks; `close()` checks completeness."""

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, TensorInfo]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.layout = list(layout)
        self._file = open(self.path, "wb")
        self._file.write(_header(self.layout, metadata or {"format": "pt"}))
        self._index = 0
        self._written = 0  # bytes of the current tensor written so far

    def write(self, name: str, values: torch.Tensor) -> None:
        """Append `values`: the whole tensor `name`, or its next rows (any shape with matching trailing dims)."""
        expected, info = self.layout[self._index] if self._index < len(self.layout) else (None, None)
        if name != expected:
            raise ValueError(f"{self.path}: expected tensor {expected}, got {name}")
        if values.dtype != info.dtype:
            raise ValueError(f"{self.path}: tensor {name} is {info.dtype}, got {values.dtype}")
        data = values.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        self._file.write(memoryview(data))
        self._written += data.nbytes
        total = tensor_bytes(info)
        if self._written > total:
            raise ValueError(f"{self.path}: more values than shape {info.shape} for tensor {name}")
        if self._written == total:
            self._index += 1
            self._written = 0

    @property
    def complete(self) -> bool:
        return self._index == len(self.layout)

    def close(self) -> None:
        if self._index != len(self.layout):
            missing = self.layout[self._index][0]
            self._file.close()
            raise ValueError(f"{self.path}: closed before tensor {missing} was complete")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class WriteBehind:
    """Writes done in a thread of their own, so that the caller computes the next block meanwhile.

    `put(args, nbytes)` hands `write(*args)` to the thread; at most `max_bytes` of handed-over values wait at once
    (a larger item waits until the thread is idle, so memory holds one more block at most). An error in the thread
    is raised in the caller at its next `put` or at `close`, which waits for every write. As a context manager it
    closes at the end, and on the caller's error drops what waits and ends the thread.
    """

    def __init__(self, write, max_bytes: int = 64 * 2**20):
        self.write, self.max_bytes = write, max_bytes
        self.waiting = 0  # bytes handed over and not yet written
        self.error: BaseException | None = None
        self.idle = threading.Condition()
        self.items: collections.deque = collections.deque()
        self.closing = self.abandoned = False
        self.thread = threading.Thread(target=self._run, name="relex-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self.idle:
                self.idle.wait_for(lambda: self.items or self.closing)
                if not self.items:
                    return
                args, nbytes = self.items[0]
            try:
                if self.error is None and not self.abandoned:
                    self.write(*args)
            except BaseException as error:  # raised in the caller
                self.error = error
            with self.idle:
                self.items.popleft()
                self.waiting -= nbytes
                self.idle.notify_all()

    def put(self, args: tuple, nbytes: int) -> None:
        with self.idle:
            self.idle.wait_for(lambda: not self.items or self.waiting + nbytes <= self.max_bytes)
            self._raise()
            self.items.append((args, nbytes))
            self.waiting += nbytes
            self.idle.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait for every write handed over; raise the first one's error."""
        with self.idle:
            self.closing = True
            self.idle.notify_all()
        self.thread.join()
        self._raise()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
            return
        self.abandoned = True  # the caller failed: what waits is not written, and its error is the one raised
        with self.idle:
            self.closing = True
            self.idle.notify_all()
        self.thread.join()
