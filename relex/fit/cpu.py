"""Gram matrices and weighted sums on the CPU: the numba kernels of `gram_kernel`, loaded once and driven over
threads that split a block's columns.

A matrix comes as one float32 array per step, wherever those lie: the rows of a buffer a reader filled, or
views of the store's memory-mapped files (relex.fit.passes reads in place), minus θ₀'s values for checkpoints
referenced in place. Both give the same bits, since it is the same kernel on the same values.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

LOG = logging.getLogger(__name__)

# a block is split across threads only when each gets at least this many columns
THREAD_COLUMNS = 1 << 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@functools.cache
def kernels():
    """relex.fit.gram_kernel, or None without numba (then torch's matrix multiply forms the Gram, and every value
    is read into buffers).

    Also None, with a warning, when numba is installed but cannot compile or cache the kernel (e.g. no writable
    cache folder: set NUMBA_CACHE_DIR), so that a fit never fails for want of the faster path.
    """
    try:
        from relex.fit import gram_kernel  # numba sets up its cache here, at import

        gram_kernel.accumulate(np.ones((5, 3), dtype=np.float32), np.zeros((5, 5)))  # compiles, or loads the cache
        rows = gram_kernel.row_addresses(np.ones((5, 3), dtype=np.float32))
        gram_kernel.weighted_sum(rows, 0, 3, np.ones((2, 5), dtype=np.float32), np.empty((2, 3), dtype=np.float32))
    except ImportError:  # numba is not installed
        return None
    except Exception as error:  # numba's own errors have no common base class
        LOG.warning("the numba Gram kernel is unavailable (%s); using torch's matrix product", error)
        return None
    return gram_kernel


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(thread_name_prefix="relex-gram")
        return _pool


def cpu_gram(matrix: np.ndarray, threads: int = 1) -> np.ndarray:
    """M Mᵀ in float64 for a C-contiguous float32 M (T × n), by `gram_kernel`, its columns split over threads."""
    return _rows_gram(kernels().row_addresses(matrix), 0, matrix.shape[1], threads)


def rows_gram(rows: list[np.ndarray], base: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """(M − θ₀)(M − θ₀)ᵀ in float64 (θ₀ = 0 when `base` is None) for M given as one flat float32 array per step,
    e.g. views of memory-mapped files (relex.fit.passes reads in place), by `gram_kernel`, threads as cpu_gram."""
    n = rows[0].size if rows else 0
    return _rows_gram(_addresses(rows, base), 0 if base is None else base.ctypes.data, n, threads)


def _rows_gram(addresses: np.ndarray, base: int, n: int, threads: int) -> np.ndarray:
    kernel = kernels()
    steps = len(addresses)
    parts = max(1, min(threads, n // THREAD_COLUMNS))
    if parts == 1:
        gram = np.zeros((steps, steps))
        kernel.accumulate_rows(addresses, base, n, gram)
    else:
        bounds = [n * i // parts for i in range(parts + 1)]
        grams = np.zeros((parts, steps, steps))
        list(_thread_pool().map(lambda i: kernel.accumulate_rows(addresses, base, n, grams[i], bounds[i], bounds[i + 1]), range(parts)))
        gram = grams.sum(axis=0)
    lower = np.tril(gram)
    return lower + np.tril(gram, -1).T


def rows_weighted_sum(rows: list[np.ndarray], base: np.ndarray | None, w: np.ndarray, threads: int = 1) -> np.ndarray:
    """W · (M − θ₀) as float32 (k × n) for W float32 (k × T) and M as in `rows_gram`, its columns split over
    threads. Each column is summed over the steps in order, so the result does not depend on the split."""
    kernel = kernels()
    n = rows[0].size if rows else 0
    addresses, base_address = _addresses(rows, base), 0 if base is None else base.ctypes.data
    w = np.ascontiguousarray(w, dtype=np.float32)
    out = np.empty((len(w), n), dtype=np.float32)
    parts = max(1, min(threads, n // THREAD_COLUMNS))
    bounds = [n * i // parts for i in range(parts + 1)]

    def work(i: int) -> None:
        kernel.weighted_sum(addresses, base_address, n, w, out, bounds[i], bounds[i + 1])

    if parts == 1:
        work(0)
    else:
        list(_thread_pool().map(work, range(parts)))
    return out


def _addresses(rows: list[np.ndarray], base: np.ndarray | None = None) -> np.ndarray:
    """Each row's address, after checking that they (and `base`) are float32, contiguous and of one length: the
    kernels trust it."""
    n = rows[0].size if rows else 0
    for row in [*rows, *([] if base is None else [base])]:
        if row.dtype != np.float32 or row.size != n or not row.flags.c_contiguous:
            raise ValueError(f"rows must be contiguous float32 arrays of {n} values, not {row.dtype} {row.shape}")
    return np.array([row.ctypes.data for row in rows], dtype=np.int64)
