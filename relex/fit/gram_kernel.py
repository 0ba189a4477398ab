"""A CPU kernel for one block's Gram matrix M Mᵀ (T × T, T small, M's rows long), compiled with numba.

Why not `M @ M.T`: torch's CPU BLAS (MKL) treats this skinny product (m = n = T ≈ 20, k = millions) like any
other GEMM and, on the AMD EPYC machines we measured, runs it at about a third of the core's float32 FMA
rate, and it computes both triangles. Here each 4 × 4 tile of the lower triangle keeps its 16 sums in
registers while one pass streams 8 rows through them, over column pieces small enough to stay in L2
(`PIECE`), so the product runs near the FMA rate and does 60% of the work for T = 20
(`scripts/bench_gram.py` measures both).

Sums run in float32 within a piece (vectorised: 16 lanes, so each lane adds ~PIECE/16 products) and in
float64 across pieces. Only reassociation and FMA contraction are allowed (not numba's full `fastmath`), so
a NaN or Inf in M still propagates into the Gram.

The kernels take a matrix's rows as addresses (`rows`, one per step), not as one array: a block in a buffer
and a tensor's rows in T memory-mapped files (relex.fit.passes reads a store's float32 values in place, without
copying them) are the same to them. With `base` non-zero, every row is taken minus the row at `base` (θ_s − θ₀ of
a checkpoint referenced in place), staged piece by piece into a scratch block in L2 first.
`weighted_sum` forms W · M for a few rows of weights the same way, for the extrapolated checkpoints.

Importing this module imports numba (about 0.2 s); `relex.fit.gram` does so on first use and falls back to
torch when numba is not installed. The compiled kernels are cached beside this file (numba's `cache=True`), so
only the first process compiles them (a few seconds).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

PIECE = 16384  # columns per pass: T = 20 rows of float32 are 1.3 MiB, inside a 2 MiB L2
SUM_PIECE = 1024  # columns per pass of a weighted sum: its k rows of sums stay in L1 while every step adds in
_FLAGS = {"reassoc", "contract"}


@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _tile(x0, x1, x2, x3, y0, y1, y2, y3, out):  # pragma: no cover - compiled
    """out[4p + q] = ⟨x_p, y_q⟩ for four rows x against four rows y (1-D, equal length)."""
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0)
    for k in range(x0.shape[0]):
        a0, a1, a2, a3 = x0[k], x1[k], x2[k], x3[k]
        b0, b1, b2, b3 = y0[k], y1[k], y2[k], y3[k]
        s00 += a0 * b0
        s01 += a0 * b1
        s02 += a0 * b2
        s03 += a0 * b3
        s10 += a1 * b0
        s11 += a1 * b1
        s12 += a1 * b2
        s13 += a1 * b3
        s20 += a2 * b0
        s21 += a2 * b1
        s22 += a2 * b2
        s23 += a2 * b3
        s30 += a3 * b0
        s31 += a3 * b1
        s32 += a3 * b2
        s33 += a3 * b3
    out[0], out[1], out[2], out[3] = s00, s01, s02, s03
    out[4], out[5], out[6], out[7] = s10, s11, s12, s13
    out[8], out[9], out[10], out[11] = s20, s21, s22, s23
    out[12], out[13], out[14], out[15] = s30, s31, s32, s33

@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _dot(x, y):  # pragma: no cover - compiled
    s = np.float32(0)
    for k in range(x.shape[0]):
        s += x[k] * y[k]
    return s

@intrinsic
def _pointer(typingctx, address):  # pragma: no cover - compiled
    """An integer address as a void pointer, for numba.carray."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@numba.njit(nogil=True, cache=True)
def _row(address, n):  # pragma: no cover - compiled
    """The n float32 values at `address`, as an array (no copy)."""
    return numba.carray(_pointer(address), (n,), dtype=np.float32)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _stage(rows, base, n, k0, k1, scratch):  # pragma: no cover - compiled
    """scratch[i, :k1-k0] = row_i[k0:k1] − base[k0:k1] (exact float32 subtractions: no fastmath here)."""
    b = _row(base, n)
    for i in range(rows.shape[0]):
        r, s = _row(rows[i], n), scratch[i]
        for k in range(k0, k1):
            s[k - k0] = r[k] - b[k]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _piece(rows, i, n, k0, k1, staged, scratch):  # pragma: no cover - compiled
    """Row i's columns k0..k1-1: from the scratch block when the rows were staged, else from its address."""
    if staged:
        return scratch[i, : k1 - k0]
    return _row(rows[i], n)[k0:k1]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _lower(rows, base, n, gram, start, stop, piece):  # pragma: no cover - compiled
    """gram[i, j] += ⟨m_i, m_j⟩ over columns start:stop, for j ≤ i; row i of M is the n float32 values at
    rows[i] (minus those at `base` unless it is 0); gram is float64 T × T."""
    steps = rows.shape[0]
    tiled = steps - steps % 4
    out = np.zeros(16, np.float32)
    staged = base != 0
    scratch = np.empty((steps if staged else 1, piece), np.float32)
    for k0 in range(start, stop, piece):
        k1 = min(stop, k0 + piece)
        if staged:
            _stage(rows, base, n, k0, k1, scratch)
        for i in range(0, tiled, 4):
            x0, x1 = _piece(rows, i, n, k0, k1, staged, scratch), _piece(rows, i + 1, n, k0, k1, staged, scratch)
            x2, x3 = _piece(rows, i + 2, n, k0, k1, staged, scratch), _piece(rows, i + 3, n, k0, k1, staged, scratch)
            for j in range(0, i + 1, 4):
                y0, y1 = _piece(rows, j, n, k0, k1, staged, scratch), _piece(rows, j + 1, n, k0, k1, staged, scratch)
                y2, y3 = _piece(rows, j + 2, n, k0, k1, staged, scratch), _piece(rows, j + 3, n, k0, k1, staged, scratch)
                _tile(x0, x1, x2, x3, y0, y1, y2, y3, out)
                for p in range(4):
                    for q in range(4 if j < i else p + 1):  # a diagonal tile's upper half is not wanted
                        gram[i + p, j + q] += out[4 * p + q]
        for i in range(tiled, steps):  # the last T mod 4 rows, one dot product at a time
            for j in range(i + 1):
                gram[i, j] += _dot(_piece(rows, i, n, k0, k1, staged, scratch), _piece(rows, j, n, k0, k1, staged, scratch))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _difference(x, b, k0, k1, s):  # pragma: no cover - compiled
    """s[:k1-k0] = x[k0:k1] − b[k0:k1], exact float32 subtractions (no fastmath: the same values as a buffer's)."""
    for k in range(k0, k1):
        s[k - k0] = x[k] - b[k]


@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _weighted(rows, base, n, w, out, start, stop, piece):  # pragma: no cover - compiled
    """out[:, start:stop] = W · M over those columns (float32, steps in order), M's rows as in `_lower`. The
    columns go in pieces whose k sums stay in L1 while every step's row adds into them."""
    count, steps = w.shape
    scratch = np.empty(piece if base != 0 else 1, np.float32)
    for k0 in range(start, stop, piece):
        k1 = min(stop, k0 + piece)
        for j in range(count):
            o = out[j]
            for k in range(k0, k1):
                o[k] = 0
        for t in range(steps):
            x = _row(rows[t], n)[k0:k1]
            if base != 0:
                _difference(_row(rows[t], n), _row(base, n), k0, k1, scratch)
                x = scratch[: k1 - k0]
            for j in range(count):
                o, wj = out[j][k0:k1], w[j, t]
                for k in range(k1 - k0):
                    o[k] += wj * x[k]


def row_addresses(matrix: np.ndarray) -> np.ndarray:
    """The address of each row of a float32 matrix whose rows are contiguous (a C-contiguous one, or a view of
    the leading columns of one)."""
    if matrix.dtype != np.float32 or (matrix.shape[1] > 1 and matrix.strides[1] != 4):
        raise ValueError(f"the kernels take float32 rows of contiguous values, not {matrix.dtype} with strides {matrix.strides}")
    return matrix.ctypes.data + np.arange(matrix.shape[0], dtype=np.int64) * matrix.strides[0]


def accumulate(matrix: np.ndarray, gram: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """Add the lower triangle of M Mᵀ over M's columns start:stop to `gram` (float64, T × T, upper triangle
    untouched). M = `matrix`, float32 with contiguous rows (T × n). Releases the GIL: threads can split the columns."""
    accumulate_rows(row_addresses(matrix), 0, matrix.shape[1], gram, start, stop)


def accumulate_rows(rows: np.ndarray, base: int, n: int, gram: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """`accumulate` for the M whose row i is the n float32 values at address rows[i] (int64), minus those at
    `base` unless it is 0. The caller keeps that memory alive and readable for the call."""
    _lower(rows, base, n, gram, start, n if stop is None else stop, PIECE)


def weighted_sum(rows: np.ndarray, base: int, n: int, w: np.ndarray, out: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """out[:, start:stop] = W · M over those columns, M as in `accumulate_rows`; W float32 (k × T), out float32
    (k × n, C-contiguous). Each column is summed over the steps in order, in float32. Releases the GIL."""
    _weighted(rows, base, n, w, out, start, n if stop is None else stop, SUM_PIECE)
