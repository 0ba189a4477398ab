"""A safetensors file written tensor by tensor, so memory holds one tensor (or one chunk of rows) at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range, then the raw little-endian bytes. Since the layout (names, shapes, dtypes) is known before any
value is computed, the header is written first and the bytes follow in header order.

A file can be written past the page cache (`direct=True`, O_DIRECT): the bytes go through one page-aligned
staging buffer and from it to the device in whole blocks, the last block padded and the file then cut to its
size. Every file is synced when it is closed, so the device write is waited for either way; what direct writes
save is copying every byte into the page cache, which the kernel must first find (and zero) fresh pages for. On
the 2-core development machine 1.08 GB in two files took 3.7-5.5 s and 3.1-4.8 CPU-s through the page cache,
0.9-1.2 s and 0.1 CPU-s direct. A file system that refuses O_DIRECT (at open, or at a write) gets plain writes
instead.

A direct write waits for the device, so each full stage after the first is written by a thread of its own
(`_behind`) while the caller fills a second stage: computing the next values and writing the last ones overlap,
and the device does not wait for the caller between two writes. At most one stage per file is being written at a
time, so a file holds two stages; closed files give theirs back for the next (`KEPT_STAGES`). `relex ingest
--copy`, which forms each delta and writes it, took 17.7-21.8 s against 29.8-36.2 s writing in the caller (the
SmolLM2 run, three alternating runs each, docs/performance.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import json
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Sequence

import torch

from relex.io.checkpoint import TensorInfo
from relex.io.dtypes import TORCH_TO_SAFETENSORS
from relex.io.safetensors_file import DIRECT_ALIGN

DIRECT_STAGE = 8 * 2**20  # bytes staged per direct write (a multiple of DIRECT_ALIGN)
BEHIND_THREADS = 2  # threads writing full stages for every direct file of the process, together
# staging buffers of closed files kept for the next ones: with new ones for each file, `relex ingest --copy` took
# 25.2-27.1 s against 13.9-20.8 s here, more than their page faults explain (docs/performance.md)
KEPT_STAGES = 4

_behind_pool: concurrent.futures.ThreadPoolExecutor | None = None
_behind_lock = threading.Lock()


def _behind() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that write full stages to the device while writers fill their next one (made at first use)."""
    global _behind_pool
    with _behind_lock:
        if _behind_pool is None:
            _behind_pool = concurrent.futures.ThreadPoolExecutor(BEHIND_THREADS, "relex-write-behind")
        return _behind_pool


_kept_stages: list[mmap.mmap] = []


def _new_stage() -> mmap.mmap:
    """A page-aligned staging buffer of DIRECT_STAGE bytes: one a closed file gave back, or new memory."""
    with _behind_lock:
        while _kept_stages:
            stage = _kept_stages.pop()
            if len(stage) == DIRECT_STAGE:
                return stage
            stage.close()
    return mmap.mmap(-1, DIRECT_STAGE)


def _give_back(stage: mmap.mmap) -> None:
    with _behind_lock:
        if len(_kept_stages) < KEPT_STAGES:
            _kept_stages.append(stage)
            return
    stage.close()


def _forget_behind_pool() -> None:  # a forked child has none of its parent's threads: it makes its own
    global _behind_pool, _behind_lock
    _behind_pool, _behind_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_behind_pool)


def writes_direct(io: str) -> bool:
    """Whether a pass's outputs go past the page cache, for its I/O mode (relex.store.IO_MODES): all but `cached`.

    Unlike reads (`TrajectoryStore.reads_direct`), `auto` writes direct whatever the size: a file is synced when
    it is closed, so the device write is waited for anyway, and the copy into the page cache only costs CPU.
    """
    return io != "cached"


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
    """Write `layout`'s tensors, in order, each whole or as consecutive row chunks; `close()` checks completeness,
    syncs the file and closes it. `direct`: past the page cache where the file system allows (module docstring)."""

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, TensorInfo]], metadata: dict[str, str] | None = None,
                 direct: bool = False):
        self.path = Path(path)
        self.layout = list(layout)
        self._file = _RawFile(self.path, direct)
        self._file.write(memoryview(_header(self.layout, metadata or {"format": "pt"})))
        self._index = 0
        self._written = 0  # bytes of the current tensor written so far

    @property
    def direct(self) -> bool:
        """Whether the bytes go past the page cache (False where the file system refused O_DIRECT)."""
        return self._file.direct

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
            self._file.abort()
            raise ValueError(f"{self.path}: closed before tensor {missing} was complete")
        self._file.close()

    def abort(self) -> None:
        self._file.abort()
        self.path.unlink(missing_ok=True)


class _RawFile:
    """A new file written front to back, synced at `close`: with plain writes, or O_DIRECT through two staging
    buffers, one filled while the other is written in the background (module docstring)."""

    def __init__(self, path: Path, direct: bool):
        self.path, self.size, self.direct = path, 0, False
        self._stage: mmap.mmap | None = None
        self._staged = 0  # bytes in the staging buffer, not yet written
        self._spare: mmap.mmap | None = None  # the second stage, free (made when the first goes behind)
        self._behind: tuple[concurrent.futures.Future, mmap.mmap, int] | None = None  # (write, stage, offset)
        self._flushes = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if not (direct and hasattr(os, "O_DIRECT")):
            self._fd = os.open(path, flags, 0o666)
            return
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
        except OSError:  # e.g. a file system without O_DIRECT: plain writes
            self._fd = os.open(path, flags, 0o666)
            return
        self.direct = True
        self._stage = _new_stage()  # page-aligned, as O_DIRECT wants

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data) and self.direct:
            take = min(len(data), DIRECT_STAGE - self._staged)
            self._stage[self._staged : self._staged + take] = data[:take]
            self._staged += take
            self.size += take
            data = data[take:]
            if self._staged == DIRECT_STAGE:
                self._stage_full()
        if len(data):  # plain writes: from the start, or since the file system refused a direct one
            _write_all(self._fd, data, self.size)
            self.size += len(data)

    def _stage_full(self) -> None:
        """The full stage written: the file's first one here (a file system that refuses O_DIRECT writes says so
        at once), each later one in the background, once the one before it is written; the caller fills the other."""
        self._flushes += 1
        if self._flushes == 1:
            self._flush(DIRECT_STAGE)
            return
        self._wait()
        if not self.direct:  # refused after all: _wait wrote everything staged, plainly
            return
        stage, offset = self._stage, self.size - DIRECT_STAGE
        try:
            future = _behind().submit(_write_stage, self._fd, stage, offset)
        except RuntimeError:  # the interpreter is shutting down and starts no threads: written here
            self._flush(DIRECT_STAGE)
            return
        self._behind = (future, stage, offset)
        self._stage = self._spare if self._spare is not None else _new_stage()
        self._spare, self._staged = None, 0

    def _wait(self) -> None:
        """The stage written in the background done, and free again; its error raised here. Refused with EINVAL,
        it and what is staged are written plainly, and so is everything after."""
        if self._behind is None:
            return
        future, stage, offset = self._behind
        try:
            future.result()  # interrupted here (Ctrl-C), the write stays `_behind`: `abort` waits for it
        except OSError as error:
            self._behind = None
            if error.errno != errno.EINVAL:
                self._spare = stage
                raise
            self._plain()
            with memoryview(stage) as view:
                _write_all(self._fd, view, offset)
            with memoryview(self._stage) as view:
                _write_all(self._fd, view[: self._staged], self.size - self._staged)
            self._spare = stage
            self._release_stage()
            return
        self._behind, self._spare = None, stage

    def _flush(self, length: int) -> None:
        """Write the staging buffer's first `length` bytes (a multiple of DIRECT_ALIGN) at the end of what is on disk."""
        offset, refused = self.size - self._staged, False
        with memoryview(self._stage) as stage:
            try:
                _write_all(self._fd, stage[:length], offset)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                refused = True  # the file system took O_DIRECT at open but refuses the write: plain writes from here
                self._plain()
                _write_all(self._fd, stage[: self._staged], offset)
        self._staged = 0
        if refused:
            self._release_stage()

    def _plain(self) -> None:
        os.close(self._fd)
        self._fd, self.direct = os.open(self.path, os.O_WRONLY), False

    def close(self) -> None:
        try:
            self._wait()
            if self.direct and self._staged:
                staged = self._staged
                self._flush(-(-staged // DIRECT_ALIGN) * DIRECT_ALIGN)  # the last block padded ...
                os.ftruncate(self._fd, self.size)  # ... and cut off again
            os.fsync(self._fd)
            for stage in (self._stage, self._spare):  # no view of them is left: the next file's
                if stage is not None:
                    _give_back(stage)
            self._stage = self._spare = None
        finally:
            self.abort()

    def abort(self) -> None:
        if self._behind is not None:  # its write uses the file: waited for before the file is closed
            future, stage, _ = self._behind
            self._behind = None
            concurrent.futures.wait([future])
            self._spare = stage
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._release_stage()

    def _release_stage(self) -> None:
        for stage in (self._stage, self._spare):
            if stage is not None:
                try:
                    stage.close()
                except BufferError:  # a view of it is still referenced (by an error's traceback): it goes with that
                    pass
        self._stage, self._spare, self._staged = None, None, 0


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _write_stage(fd: int, stage: mmap.mmap, offset: int) -> None:
    """A full stage written at `offset` (in a `_behind` thread)."""
    with memoryview(stage) as view:
        _write_all(fd, view, offset)


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
