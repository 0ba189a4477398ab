"""Writes handed to a background thread, so that copying output bytes to the file system overlaps the arithmetic.

`relex extrapolate` computes each tensor's predictions and then writes one copy per target; a write is a copy
into the page cache (and, at a shard's end, an fsync), work that need not hold up the next tensor's arithmetic.
`WriteBehind` runs the writers' `write` calls in one thread, in the order they were made, and holds at most
`max_bytes` of values not yet written (more only for a single larger tensor), so memory stays bounded.
An error in the thread is raised in the caller at its next call.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

import torch

MAX_PENDING_BYTES = 256 << 20


class WriteBehind:
    """`write(i, name, values)` queues `writers[i].write(name, values)`; `drain()` waits until all have run.

    The caller must not modify `values` after handing them over.
    """

    def __init__(self, writers: Sequence, max_bytes: int = MAX_PENDING_BYTES):
        self.writers = list(writers)
        self.max_bytes = max_bytes
        self._queue: deque = deque()
        self._pending = 0  # bytes queued or being written
        self._error: BaseException | None = None
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="relex-writer", daemon=True)
        self._thread.start()

    def write(self, index: int, name: str, values: torch.Tensor) -> None:
        size = values.numel() * values.element_size()
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or self._pending == 0 or self._pending + size <= self.max_bytes)
            self._raise()
            self._queue.append((index, name, values, size))
            self._pending += size
            self._changed.notify_all()

    def drain(self) -> None:
        """Wait until every queued write has run; raise the first error."""
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or self._pending == 0)
            self._raise()

    def close(self) -> None:
        """Stop the thread; queued writes not yet started are dropped (call `drain` first to keep them)."""
        with self._changed:
            self._stopped = True
            self._queue.clear()
            self._changed.notify_all()
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopped or bool(self._queue))
                if self._stopped:
                    return
                index, name, values, size = self._queue.popleft()
            try:
                self.writers[index].write(name, values)
            except BaseException as error:  # handed to the caller
                with self._changed:
                    self._error = error
                    self._queue.clear()
                    self._pending = 0
                    self._changed.notify_all()
                return
            with self._changed:
                self._pending -= size
                self._changed.notify_all()
