"""CPU kernels for a pass's arithmetic on one block, compiled with numba: the Gram matrix M Mᵀ (T × T, T small,
M's rows long), and the weighted sums W · M (`weighted_sums`, below); and both of them for a tensor whose files
they read themselves (`file_gram`, `file_sums`, at the end).

Why not `M @ M.T`: torch's CPU BLAS (MKL) treats this skinny product (m = n = T ≈ 20, k = millions) like any
other GEMM and, on the AMD EPYC machines we measured, runs it at about a third of the core's float32 FMA
rate, and it computes both triangles. Here each tile of the lower triangle keeps its sums in registers while
one pass streams its rows through them, over column pieces small enough to stay in L2 (`PIECE`), so the
product runs near the FMA rate and does little more than the lower triangle's work (`scripts/bench_gram.py`
measures torch and both tiles).

The tile depends on how many vector registers the CPU has (`TILE`). With AVX-512's 32, a 4 × 4 tile keeps its
16 sums in registers; it measured 149 GFLOP/s (full product) on such a machine. With AVX2's 16, those 16 sums
spill, and a 3 × 3 tile (9 sums) ran 1.07-2.3x faster for T = 6..50 on a Zen 3 machine, one thread
(`scripts/bench_gram.py`, and a loop over 71 MB blocks). Rows past the last whole tile repeat the last row
(their sums are thrown away), so every product goes through a tile.

Sums run in float32 within a piece (vectorised, so each lane adds ~PIECE/8 or /16 products) and in float64
across pieces. Only reassociation and FMA contraction are allowed (not numba's full `fastmath`), so a NaN or
Inf in M still propagates into the Gram. A machine always runs the same tile, so its results are reproducible
there; two machines with different vector units differ in the last bits, as any vectorised sum does.

Importing this module imports numba (about 0.2 s); `relex.fit.gram` does so on first use and falls back to
torch when numba is not installed. The compiled kernels are cached beside this file (numba's `cache=True`), so
only the first process compiles them (about 1 s each). Loading them makes numba import its NumPy implementations,
one of which looks for a BLAS by importing scipy.linalg (0.27 s here, while both of a pass's threads wait), only
to choose how `np.correlate`-like inner products are compiled; none of these kernels uses one, so that module is
imported here with the look skipped (`_import_numba_arraymath`).
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.extending import intrinsic


def _import_numba_arraymath() -> None:
    """Import numba.np.arraymath without its BLAS check importing scipy.linalg, unless scipy's BLAS is already
    loaded (then the check is free). Numba's own `ensure_blas` is put back at once, so `np.dot` and
    `np.linalg` in numba code compile as before; only the inner-product choice above takes numba's loop.
    Where numba's layout differs (another version), the module is imported as numba would."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg.cython_blas" in sys.modules:
        return
    try:
        import numba.np.linalg as linalg

        real = linalg.ensure_blas
    except (ImportError, AttributeError):
        return

    def not_looked_for() -> None:
        raise ImportError("BLAS not looked for (relex.fit.gram_kernel)")

    linalg.ensure_blas = not_looked_for
    try:
        import numba.np.arraymath as arraymath
    finally:
        linalg.ensure_blas = real
    if getattr(arraymath, "ensure_blas", None) is not_looked_for:
        arraymath.ensure_blas = real


_import_numba_arraymath()

_FLAGS = {"reassoc", "contract"}


def _wide_vector_registers() -> bool:
    """Whether the CPU has AVX-512 (32 vector registers), where numba's code keeps 16 sums in registers."""
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get("avx512f", False))
    except Exception:  # an unknown CPU: the tile that fits 16 registers is right on every one
        return False


TILE = 4 if _wide_vector_registers() else 3  # rows (and columns) of a tile of the Gram
# columns per piece: T = 20 rows of float32 are 1.3 MiB at 16384 (a 2 MiB L2, where the 4 × 4 tile was
# measured) and 0.3 MiB at 4096 (a 512 KiB L2, where the 3 × 3 tile was)
PIECES = {4: 16384, 3: 4096}
PIECE = PIECES[TILE]


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
def _tile3(x0, x1, x2, y0, y1, y2, out):  # pragma: no cover - compiled
    """out[3p + q] = ⟨x_p, y_q⟩ for three rows x against three rows y (1-D, equal length)."""
    s00 = s01 = s02 = s10 = s11 = s12 = s20 = s21 = s22 = np.float32(0)
    for k in range(x0.shape[0]):
        a0, a1, a2 = x0[k], x1[k], x2[k]
        b0, b1, b2 = y0[k], y1[k], y2[k]
        s00 += a0 * b0
        s01 += a0 * b1
        s02 += a0 * b2
        s10 += a1 * b0
        s11 += a1 * b1
        s12 += a1 * b2
        s20 += a2 * b0
        s21 += a2 * b1
        s22 += a2 * b2
    out[0], out[1], out[2] = s00, s01, s02
    out[3], out[4], out[5] = s10, s11, s12
    out[6], out[7], out[8] = s20, s21, s22

@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _dot(x, y):  # pragma: no cover - compiled
    s = np.float32(0)
    for k in range(x.shape[0]):
        s += x[k] * y[k]
    return s

@numba.njit(nogil=True, cache=True, boundscheck=False)
def _lower(m, gram, start, stop, piece):  # pragma: no cover - compiled
    """gram[i, j] += ⟨m_i, m_j⟩ over columns start:stop, for j ≤ i, in 4 × 4 tiles; m is a C-contiguous float32
    T × n array, gram float64 T × T."""
    steps = m.shape[0]
    tiled = steps - steps % 4
    out = np.zeros(16, np.float32)
    for k0 in range(start, stop, piece):
        k1 = min(stop, k0 + piece)
        for i in range(0, tiled, 4):
            x0, x1, x2, x3 = m[i][k0:k1], m[i + 1][k0:k1], m[i + 2][k0:k1], m[i + 3][k0:k1]
            for j in range(0, i + 1, 4):
                _tile(x0, x1, x2, x3, m[j][k0:k1], m[j + 1][k0:k1], m[j + 2][k0:k1], m[j + 3][k0:k1], out)
                for p in range(4):
                    for q in range(4 if j < i else p + 1):  # a diagonal tile's upper half is not wanted
                        gram[i + p, j + q] += out[4 * p + q]
        for i in range(tiled, steps):  # the last T mod 4 rows, one dot product at a time
            for j in range(i + 1):
                gram[i, j] += _dot(m[i][k0:k1], m[j][k0:k1])

@numba.njit(nogil=True, cache=True, boundscheck=False)
def _lower3(m, gram, start, stop, piece):  # pragma: no cover - compiled
    """As `_lower`, in 3 × 3 tiles; a tile past the last row repeats it, and its sums for rows past the last
    (or above the diagonal) are not added."""
    steps = m.shape[0]
    last = steps - 1
    out = np.zeros(9, np.float32)
    for k0 in range(start, stop, piece):
        k1 = min(stop, k0 + piece)
        for i in range(0, steps, 3):
            x0, x1, x2 = m[i][k0:k1], m[min(i + 1, last)][k0:k1], m[min(i + 2, last)][k0:k1]
            for j in range(0, i + 1, 3):
                _tile3(x0, x1, x2, m[j][k0:k1], m[min(j + 1, last)][k0:k1], m[min(j + 2, last)][k0:k1], out)
                for p in range(min(3, steps - i)):
                    for q in range(3 if j < i else p + 1):  # a diagonal tile's upper half is not wanted
                        gram[i + p, j + q] += out[3 * p + q]


def accumulate(matrix: np.ndarray, gram: np.ndarray, start: int = 0, stop: int | None = None, tile: int | None = None) -> None:
    """Add the lower triangle of M Mᵀ over M's columns start:stop to `gram` (float64, T × T, upper triangle
    untouched). M = `matrix`, float32 and C-contiguous (T × n). Releases the GIL: threads can split the columns.
    `tile`: 4 or 3 (default `TILE`, this CPU's)."""
    tile = tile or TILE
    lower = _lower if tile == 4 else _lower3
    lower(matrix, gram, start, matrix.shape[1] if stop is None else stop, PIECES[tile])


# ---- weighted sums ------------------------------------------------------------------------------------------------
# W · M for a few rows of weights (targets × methods) against T long rows: torch's BLAS (MKL) ran this skinny
# product at 6.8 GB/s of M on the development machine (Zen 3, one thread), this loop at 7.9 GB/s. Each output
# value is a sum over the steps in order, in float32 (FMA contraction allowed), the same on every call.
SUM_PIECE = 1024  # columns per piece: T = 20 rows of it are 80 KiB, in L2 while two rows of W pass over them


@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _sums(w, m, out, start, stop, piece):  # pragma: no cover - compiled
    """out[r, c] = Σ_s w[r, s] m[s, c] for columns start:stop, two rows of W at a time over each column piece (an
    odd last row is paired with itself); w float32 R × T, m float32 T × n, out float32 R × n, all C-contiguous."""
    rows, steps = w.shape
    a = np.empty(piece, np.float32)
    b = np.empty(piece, np.float32)
    for k0 in range(start, stop, piece):
        k1 = min(stop, k0 + piece)
        width = k1 - k0
        for r in range(0, rows, 2):
            r1 = min(r + 1, rows - 1)
            x = m[0, k0:k1]
            w0, w1 = w[r, 0], w[r1, 0]
            for k in range(width):
                a[k] = w0 * x[k]
                b[k] = w1 * x[k]
            for s in range(1, steps):
                x = m[s, k0:k1]
                w0, w1 = w[r, s], w[r1, s]
                for k in range(width):
                    v = x[k]
                    a[k] += w0 * v
                    b[k] += w1 * v
            out[r, k0:k1] = a[:width]
            out[r1, k0:k1] = b[:width]


def weighted_sums(w: np.ndarray, matrix: np.ndarray, out: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """out[:, start:stop] = (W · M)[:, start:stop] for float32, C-contiguous W (R × T), M (T × n) and out (R × n).
    Releases the GIL: threads can split the columns."""
    _sums(w, matrix, out, start, matrix.shape[1] if stop is None else stop, SUM_PIECE)


# ---- reading as they go ------------------------------------------------------------------------------------------
# The kernels below read the values themselves, a piece of every step's row at a time, straight from the files
# (pread from the page cache), and form the Gram or W · M of that piece while it is in L2. The pieces go to no
# memory beyond the core's cache: a pass over a buffer the size of a trajectory writes it to memory and reads it
# back once per product, which is what bounded it (docs/performance.md, stop 35). A tensor's row at step s lies in
# one or more runs of values (segments: one for a safetensors file, one per rank for verl's unmerged shards):
# segment k holds the row's values bounds[s, k]..bounds[s, k + 1] - 1, from byte offsets[s, k] of file fds[s, k]
# (an empty segment pads a step that has fewer), in the dtype the step's code in `dtypes` names
# (relex.store.KERNEL_DTYPES: 0 float32, 1 bf16, 2 fp16; the 2-byte ones widened to float32 as read, which loses
# nothing: a bf16 value is the top half of a float32's bits, and every fp16 value is a float32 value). `subtract`
# marks the steps whose row is θ_s (a checkpoint read in place), from which θ₀ (at `base_fd`, `base_offset`, in the
# dtype `base_dtype` codes) is subtracted as it is read. A kernel returns 0, or 1 + the segment whose read came up
# short, counted step by step (s · K + k for K segments a step; T · K: θ₀'s), so that the caller names the file.
# `pread` is libc's, declared by name (resolved in the process, so the compiled kernels are cached); its buffer
# argument is passed as an address (uintp), as a pointer is passed on every 64-bit ABI numba targets.
_pread = numba.types.ExternalFunction("pread", numba.types.intp(numba.types.int32, numba.types.uintp, numba.types.uintp, numba.types.int64))


@intrinsic
def _fp16_to_float32(typingctx, bits):  # pragma: no cover - compiled
    """An fp16 value, given as its 16 bits (uint16), as float32: LLVM's own conversion (`fpext half`), which a
    vectorised loop forms with the CPU's conversion instruction (x86's F16C, which every x86-64 CPU since 2012 has,
    or AVX512-FP16; ARM's FCVT). numba's CPU target has no float16 type, and the same conversion written with
    integer operations ran at a third of the speed (0.72 against 0.21-0.25 ns per value, one core), as a table
    lookup did."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())

    return numba.types.float32(numba.types.uint16), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _read_row(fd, offset, dtype, start, width, row, half):  # pragma: no cover - compiled
    """Values start..start+width of one file's row into row[:width] as float32: True, or False for a short read.
    `dtype`: the file's KERNEL_DTYPES code; a 2-byte one is read into `half`, then widened."""
    size = 2 if dtype else 4
    target = half.ctypes.data if dtype else row.ctypes.data
    nbytes, done = width * size, 0
    while done < nbytes:
        got = _pread(fd, target + done, nbytes - done, offset + start * size + done)
        if got <= 0:
            return False
        done += got
    if dtype == 1:  # bf16
        bits = row.view(np.uint32)
        for k in range(width):
            bits[k] = np.uint32(half[k]) << np.uint32(16)
    elif dtype == 2:  # fp16
        for k in range(width):
            row[k] = _fp16_to_float32(half[k])
    return True


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _read_piece(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, start, width, rows, base_row, half):  # pragma: no cover - compiled
    """Columns start..start+width of every step's row into rows[:, :width] (θ₀ subtracted where marked): 0, or
    the status above. `half`: room for one row of 2-byte values."""
    steps, segments = fds.shape
    stop = start + width
    if base_fd >= 0 and not _read_row(base_fd, base_offset, base_dtype, start, width, base_row, half):
        return steps * segments + 1
    for s in range(steps):
        row = rows[s]
        for k in range(segments):
            first, last = max(start, bounds[s, k]), min(stop, bounds[s, k + 1])
            if first < last and not _read_row(fds[s, k], offsets[s, k], dtypes[s], first - bounds[s, k], last - first,
                                              row[first - start :], half):
                return s * segments + k + 1
        if subtract[s]:
            for k in range(width):
                row[k] -= base_row[k]
    return 0


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _file_lower(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, n, piece, tile, gram):  # pragma: no cover - compiled
    """gram[i, j] += ⟨m_i, m_j⟩ (j ≤ i) over all n columns, read `piece` columns at a time: on each, `_lower` (tile
    4) or `_lower3` (tile 3)."""
    steps = fds.shape[0]
    rows, base_row, half = np.empty((steps, piece), np.float32), np.empty(piece, np.float32), np.empty(piece, np.uint16)
    for start in range(0, n, piece):
        width = min(piece, n - start)
        status = _read_piece(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, start, width, rows, base_row, half)
        if status:
            return status
        if tile == 4:
            _lower(rows, gram, 0, width, piece)
        else:
            _lower3(rows, gram, 0, width, piece)
    return 0


@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _add_base(b, base_row, out, start, width, checks):  # pragma: no cover - compiled
    """out[r, start:start+width] += b[r] · θ₀'s piece (`base_row`) for every row r of `out` (R × n, C-contiguous),
    adding that part's Σ out[r]² before and Σ out[r] after to checks[r] (float64, R × 2). The loop runs over a
    slice of the row, indexed from 0: indexed `start + k` into the whole row, LLVM did not vectorise it, and it
    took 4-5x as long (0.50-0.63 s against 0.10-0.15 s for two rows of the SmolLM2 store, one core)."""
    for r in range(out.shape[0]):
        row, weight = out[r, start : start + width], b[r]
        squares, total = 0.0, 0.0
        for k in range(width):
            v = row[k]
            squares += np.float64(v) * np.float64(v)
            v += weight * base_row[k]
            total += np.float64(v)
            row[k] = v
        checks[r, 0] += squares
        checks[r, 1] += total


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _file_sums(w, b, fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, start, stop, piece, out, checks):  # pragma: no cover - compiled
    """out[:, c - start] = Σ_s w[:, s] m[s, c] for columns start..stop, read `piece` columns at a time: `_sums` on
    each (out: R × (stop − start) float32); then, where `b` has a weight per row of W, θ₀ · b added and `checks`
    (`_add_base`) with θ₀'s piece read beside the steps' (an empty `b`: none)."""
    steps = fds.shape[0]
    rows, base_row, half = np.empty((steps, piece), np.float32), np.empty(piece, np.float32), np.empty(piece, np.uint16)
    for k0 in range(start, stop, piece):
        width = min(piece, stop - k0)
        status = _read_piece(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, k0, width, rows, base_row, half)
        if status:
            return status
        _sums(w, rows, out[:, k0 - start : k0 - start + width], 0, width, SUM_PIECE)
        if b.shape[0]:
            _add_base(b, base_row, out, k0 - start, width, checks)
    return 0


def read_piece_columns(steps: int, tile: int | None = None) -> int:
    """Columns per piece the reading kernels take: `steps` rows of them within the L2 share the tile's pieces were
    measured in (T = 20 rows of PIECE columns), a multiple of 256, at least 256."""
    piece = PIECES[tile or TILE]
    columns = piece * 20 // max(1, steps)
    return max(256, min(piece, columns // 256 * 256))


def _located(files, base: bool = False) -> tuple:
    """A relex.store.TensorFiles as the kernels take it: θ₀ is read where a step subtracts it, or with `base`."""
    reads_base = base or bool(files.subtract.any())
    return (files.descriptors, files.offsets, files.bounds, files.dtypes, files.subtract,
            files.base_descriptor if reads_base else -1, files.base_offset, files.base_dtype)


def file_gram(files, gram: np.ndarray, tile: int | None = None) -> int:
    """Add the lower triangle of M Mᵀ for the tensor at `files` (relex.store.TensorFiles) to `gram` (float64 T × T),
    reading its values as it goes; 0, or the status of a short read (above). Releases the GIL."""
    tile = tile or TILE
    return _file_lower(*_located(files), files.numel, read_piece_columns(len(files.descriptors), tile), tile, gram)


def file_sums(w: np.ndarray, files, out: np.ndarray, start: int = 0, stop: int | None = None,
              base: np.ndarray | None = None, checks: np.ndarray | None = None) -> int:
    """out = (W · M)[:, start:stop] for the tensor at `files`, reading its values as it goes (W float32 R × T, out
    float32 R × (stop − start), C-contiguous rows); 0, or the status of a short read. Releases the GIL.

    With `base` (float32, one weight per row of W) and `checks` (float64 R × 2): out = θ₀ · base + W · M, θ₀'s
    values read beside the steps' (`files.base_descriptor`, which must be open), and checks[r] += (Σ (W · M)[r]²,
    Σ out[r]): the second is finite exactly when every value of out[r] is."""
    stop = files.numel if stop is None else stop
    if base is None:
        base, checks = np.zeros(0, dtype=np.float32), np.zeros((0, 2))
    elif files.base_descriptor < 0:
        raise ValueError(f"tensor {files.name}: θ₀ is not where the kernels can read it (TensorFiles.base_descriptor)")
    return _file_sums(w, base, *_located(files, base=len(base) > 0), start, stop, read_piece_columns(len(files.descriptors)), out, checks)


# ---- an output rounded to 2 bytes ---------------------------------------------------------------------------------
# θ₀ + Δ̂ is formed in float32; a bf16 or fp16 checkpoint gets it rounded (to nearest, ties to even, as torch rounds),
# and the pass keeps Σ (rounded − exact)²: what the rounding lost, reported per target, and finite exactly when every
# output value is (a NaN stays NaN, a value past the dtype's range becomes Inf). One loop over the values, where
# torch took four (the rounding, widening it back, the difference, its dot product) and 3.2-4 ns a value on the
# main thread; here 0.8-1.0 ns, without the GIL (one core, 28.3 M values).
@intrinsic
def _float32_to_fp16(typingctx, value):  # pragma: no cover - compiled
    """A float32 rounded to fp16 (LLVM's `fptrunc`, to nearest even: x86's F16C or AVX512-FP16), as its 16 bits."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.IntType(16))

    return numba.types.uint16(numba.types.float32), codegen


@intrinsic
def _bits_to_float32(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bits are `bits` (uint32)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.FloatType())

    return numba.types.float32(numba.types.uint32), codegen


@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _round_half(exact, out, dtype):  # pragma: no cover - compiled
    """out[k] = exact[k] rounded to bf16 (`dtype` 1) or fp16 (2), as its bits (uint16); returns Σ (out[k] − exact[k])²
    in float64. A bf16 is a float32's top half: the float32's bits plus 0x7FFF and the lowest kept bit, cut to their
    top half, round to nearest even (torch's rounding; a NaN is set to 0x7FC0, as torch sets it). Each difference is
    exact in float32 (the rounded value is within a factor 2 of the exact one), its square summed in float64."""
    lost = 0.0
    if dtype == 1:
        bits = exact.view(np.uint32)
        for k in range(exact.shape[0]):
            u = bits[k]
            kept = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                kept = np.uint32(0x7FC00000)
            out[k] = np.uint16(kept >> np.uint32(16))
            d = _bits_to_float32(np.uint32(kept)) - exact[k]
            lost += np.float64(d) * np.float64(d)
    else:
        for k in range(exact.shape[0]):
            half = _float32_to_fp16(exact[k])
            out[k] = half
            d = _fp16_to_float32(half) - exact[k]
            lost += np.float64(d) * np.float64(d)
    return lost


def round_half(exact: np.ndarray, out: np.ndarray, dtype: int) -> float:
    """`exact` (float32, contiguous) rounded to bf16 or fp16 (`dtype`: relex.store.KERNEL_DTYPES's code, 1 or 2) into
    `out` (uint16, the values' bits, as long); returns Σ (out − exact)² (float64; not finite when an output value is
    not). Releases the GIL."""
    if dtype not in (1, 2):
        raise ValueError(f"round_half rounds to bf16 (1) or fp16 (2), not dtype code {dtype}")
    return _round_half(exact.reshape(-1), out.reshape(-1), dtype)
