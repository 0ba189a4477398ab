"""CPU kernels for a pass's arithmetic on one block, written for numba: the Gram matrix M Mᵀ (T × T, T small,
M's rows long), and the weighted sums W · M (`_sums`, below); both of them for a tensor whose files they read
themselves (`_file_lower`, `_file_sums`); and an output's rounding to 2 bytes (`_round_half`, at the end). relex
does not call them through numba's dispatch: `entry_points` puts them behind C entry points, which relex.fit.native
compiles once into an object file for this CPU and every later process loads without importing numba; its
`Kernels` is the Python face of these kernels (argument checks, the buffers they work in).

Why not `M @ M.T`: torch's CPU BLAS (MKL) treats this skinny product (m = n = T ≈ 20, k = millions) like any
other GEMM and, on the AMD EPYC machines we measured, runs it at about a third of the core's float32 FMA
rate, and it computes both triangles. Here each tile of the lower triangle keeps its sums in registers while
one pass streams its rows through them, over column pieces small enough to stay in L2 (`native.PIECES`), so the
product runs near the FMA rate and does little more than the lower triangle's work (`scripts/bench_gram.py`
measures torch and both tiles).

The tile depends on how many vector registers the CPU has (`native.TILE`). With AVX-512's 32, a 4 × 4 tile keeps its
16 sums in registers; it measured 149 GFLOP/s (full product) on such a machine. With AVX2's 16, those 16 sums
spill, and a 3 × 3 tile (9 sums) ran 1.07-2.3x faster for T = 6..50 on a Zen 3 machine, one thread
(`scripts/bench_gram.py`, and a loop over 71 MB blocks). Rows past the last whole tile repeat the last row
(their sums are thrown away), so every product goes through a tile.

Sums run in float32 within a piece (vectorised, so each lane adds ~PIECE/8 or /16 products) and in float64
across pieces. Only reassociation and FMA contraction are allowed (not numba's full `fastmath`), so a NaN or
Inf in M still propagates into the Gram. A machine always runs the same tile, so its results are reproducible
there; two machines with different vector units differ in the last bits, as any vectorised sum does.

Importing this module imports numba (about 0.25 s), which only compiling the kernels needs. numba's NumPy
implementations, imported with it, look for a BLAS by importing scipy.linalg (0.27 s), only to choose how
`np.correlate`-like inner products are compiled; none of these kernels uses one, so that module is imported here
with the look skipped (`_import_numba_arraymath`). The kernels' callees are cached beside this file (numba's
`cache=True`), so compiling the entry points again (another CPU, a new version) takes seconds, not a minute.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.extending import intrinsic

from relex.fit.native import ENTRIES, SUM_PIECE


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
def _lower(m, gram, start, stop, piece, out):  # pragma: no cover - compiled
    """gram[i, j] += ⟨m_i, m_j⟩ over columns start:stop, for j ≤ i, in 4 × 4 tiles; m is a C-contiguous float32
    T × n array, gram float64 T × T, `out` room for a tile's 16 float32 sums."""
    steps = m.shape[0]
    tiled = steps - steps % 4
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
def _lower3(m, gram, start, stop, piece, out):  # pragma: no cover - compiled
    """As `_lower`, in 3 × 3 tiles (`out`: room for 9 sums); a tile past the last row repeats it, and its sums for
    rows past the last (or above the diagonal) are not added."""
    steps = m.shape[0]
    last = steps - 1
    for k0 in range(start, stop, piece):
        k1 = min(stop, k0 + piece)
        for i in range(0, steps, 3):
            x0, x1, x2 = m[i][k0:k1], m[min(i + 1, last)][k0:k1], m[min(i + 2, last)][k0:k1]
            for j in range(0, i + 1, 3):
                _tile3(x0, x1, x2, m[j][k0:k1], m[min(j + 1, last)][k0:k1], m[min(j + 2, last)][k0:k1], out)
                for p in range(min(3, steps - i)):
                    for q in range(3 if j < i else p + 1):  # a diagonal tile's upper half is not wanted
                        gram[i + p, j + q] += out[3 * p + q]


# ---- weighted sums ------------------------------------------------------------------------------------------------
# W · M for a few rows of weights (targets × methods) against T long rows: torch's BLAS (MKL) ran this skinny
# product at 6.8 GB/s of M on the development machine (Zen 3, one thread), this loop at 7.9 GB/s. Each output
# value is a sum over the steps in order, in float32 (FMA contraction allowed), the same on every call.
@numba.njit(fastmath=_FLAGS, nogil=True, cache=True, boundscheck=False)
def _sums(w, m, out, start, stop, piece, a, b):  # pragma: no cover - compiled
    """out[r, c] = Σ_s w[r, s] m[s, c] for columns start:stop, two rows of W at a time over each column piece (an
    odd last row is paired with itself); w float32 R × T, m float32 T × n, out float32 R × n, all C-contiguous;
    a and b: room for `piece` float32 sums each."""
    rows, steps = w.shape
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
def _file_lower(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, n, piece, tile, gram, rows, base_row, half, out):  # pragma: no cover - compiled
    """gram[i, j] += ⟨m_i, m_j⟩ (j ≤ i) over all n columns, read `piece` columns at a time: on each, `_lower` (tile
    4) or `_lower3` (tile 3). Room: `rows` T × piece and `base_row` piece float32, `half` piece uint16, `out` a
    tile's sums."""
    for start in range(0, n, piece):
        width = min(piece, n - start)
        status = _read_piece(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, start, width, rows, base_row, half)
        if status:
            return status
        if tile == 4:
            _lower(rows, gram, 0, width, piece, out)
        else:
            _lower3(rows, gram, 0, width, piece, out)
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
def _file_sums(w, b, fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, start, stop, piece, out, checks, rows, base_row, half, sa, sb):  # pragma: no cover - compiled
    """out[:, c - start] = Σ_s w[:, s] m[s, c] for columns start..stop, read `piece` columns at a time: `_sums` on
    each (out: R × (stop − start) float32); then, where `b` has a weight per row of W, θ₀ · b added and `checks`
    (`_add_base`) with θ₀'s piece read beside the steps' (an empty `b`: none). Room as `_file_lower`'s, and `sa`,
    `sb` SUM_PIECE float32 each."""
    for k0 in range(start, stop, piece):
        width = min(piece, stop - k0)
        status = _read_piece(fds, offsets, bounds, dtypes, subtract, base_fd, base_offset, base_dtype, k0, width, rows, base_row, half)
        if status:
            return status
        _sums(w, rows, out[:, k0 - start : k0 - start + width], 0, width, SUM_PIECE, sa, sb)
        if b.shape[0]:
            _add_base(b, base_row, out, k0 - start, width, checks)
    return 0


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



# ---- the entry points compiled ahead of time ---------------------------------------------------------------------
def entry_points() -> dict:
    """The kernels above behind C entry points (numba cfuncs, compiled on this call), one for each of
    relex.fit.native.ENTRIES: every array comes as the address of its first value and its sizes, C-contiguous, and
    every buffer a kernel works in comes from the caller, so none allocates (the compiled code needs numba's
    runtime for nothing). relex.fit.native compiles them into one object file, which a process loads without
    importing numba."""
    from numba import carray

    c = {"p": numba.types.voidptr, "i": numba.types.int64, "d": numba.types.float64}

    def cfunc(function):
        result, arguments = ENTRIES[function.__name__]
        return numba.cfunc(c[result](*(c[a] for a in arguments)), error_model="numpy")(function)

    f32, f64 = np.float32, np.float64

    def lower(m, steps, columns, gram, start, stop, piece, tile, out):  # pragma: no cover - compiled
        matrix, sums = carray(m, (steps, columns), f32), carray(gram, (steps, steps), f64)
        if tile == 4:
            _lower(matrix, sums, start, stop, piece, carray(out, 16, f32))
        else:
            _lower3(matrix, sums, start, stop, piece, carray(out, 9, f32))
        return 0

    def sums(w, rows, steps, m, columns, out, start, stop, piece, a, b):  # pragma: no cover - compiled
        _sums(carray(w, (rows, steps), f32), carray(m, (steps, columns), f32), carray(out, (rows, columns), f32),
              start, stop, piece, carray(a, piece, f32), carray(b, piece, f32))
        return 0

    def file_lower(fds, offsets, bounds, dtypes, subtract, steps, segments, base_fd, base_offset, base_dtype, n, piece,
                   tile, gram, rows, base_row, half, out):  # pragma: no cover - compiled
        return _file_lower(carray(fds, (steps, segments), np.int32), carray(offsets, (steps, segments), np.int64),
                           carray(bounds, (steps, segments + 1), np.int64), carray(dtypes, steps, np.uint8),
                           carray(subtract, steps, np.uint8), base_fd, base_offset, base_dtype, n, piece, tile,
                           carray(gram, (steps, steps), f64), carray(rows, (steps, piece), f32), carray(base_row, piece, f32),
                           carray(half, piece, np.uint16), carray(out, 16, f32))

    def file_sums(w, r, b, nb, fds, offsets, bounds, dtypes, subtract, steps, segments, base_fd, base_offset, base_dtype,
                  start, stop, piece, out, checks, rows, base_row, half, sa, sb):  # pragma: no cover - compiled
        return _file_sums(carray(w, (r, steps), f32), carray(b, nb, f32), carray(fds, (steps, segments), np.int32),
                          carray(offsets, (steps, segments), np.int64), carray(bounds, (steps, segments + 1), np.int64),
                          carray(dtypes, steps, np.uint8), carray(subtract, steps, np.uint8), base_fd, base_offset,
                          base_dtype, start, stop, piece, carray(out, (r, stop - start), f32), carray(checks, (nb, 2), f64),
                          carray(rows, (steps, piece), f32), carray(base_row, piece, f32), carray(half, piece, np.uint16),
                          carray(sa, SUM_PIECE, f32), carray(sb, SUM_PIECE, f32))

    def round_half(exact, out, n, dtype):  # pragma: no cover - compiled
        return _round_half(carray(exact, n, f32), carray(out, n, np.uint16), dtype)

    return {function.__name__: cfunc(function) for function in (lower, sums, file_lower, file_sums, round_half)}
