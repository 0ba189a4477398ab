"""The CPU kernels (relex.fit.gram_kernel, compiled and loaded by relex.fit.native) against float64 products, and the
torch fallback without them."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relex.fit import gram as gram_module
from relex.fit import native
from relex.fit.gram import chunk_gram, cpu_gram
from relex.io.dtypes import parse_dtype
from relex.store import KERNEL_DTYPES, TensorFiles

CPU = torch.device("cpu")
KERNELS = gram_module._kernel  # this process's compiled kernels (relex.fit.native.Kernels)


def reference(m: np.ndarray) -> np.ndarray:
    x = m.astype(np.float64)
    return x @ x.T


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


# steps around both tiles (T mod 4 and T mod 3 = 0..3, fewer rows than a tile); columns: none, one, fewer than
# a vector, and more than one kernel piece with a remainder; both tiles, whichever this CPU uses
@pytest.mark.parametrize("tile", [3, 4])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 23])
@pytest.mark.parametrize("columns", [0, 1, 15, 2 * max(native.PIECES.values()) + 37])
def test_kernel_equals_float64_product(monkeypatch, tile, steps, columns):
    monkeypatch.setattr(native, "TILE", tile)
    m = np.random.default_rng(steps * 1000 + columns).standard_normal((steps, columns), dtype=np.float32)
    got = cpu_gram(m)
    want = reference(m)
    assert got.shape == (steps, steps)
    assert np.array_equal(got, got.T)
    assert relative_error(got, want) < 1e-6


def test_this_cpu_runs_one_tile_and_each_tile_its_own_sums():
    """The tile is chosen once per machine; the two tiles add in different orders (so their results may differ
    in the last bits), and each is the same every time it runs."""
    assert native.TILE in native.PIECES
    m = np.random.default_rng(1).standard_normal((20, 50_000), dtype=np.float32)
    grams = {}
    for tile in (3, 4):
        first, again = np.zeros((20, 20)), np.zeros((20, 20))
        KERNELS().accumulate(m, first, tile=tile)
        KERNELS().accumulate(m, again, tile=tile)
        assert np.array_equal(first, again)
        grams[tile] = first
    assert relative_error(grams[3], grams[4]) < 1e-6


@pytest.mark.parametrize("threads", [2, 3, 5, 7, 16])
def test_columns_split_over_threads_give_the_same_gram_bits(monkeypatch, threads):
    """A Gram's bits must not depend on the thread count: in a pass a block's Gram is formed by a reader thread
    (one thread) or by the caller (the others), whichever is free, and a refit must give the same fit."""
    monkeypatch.setattr(gram_module, "PART_COLUMNS", 1000)
    m = np.random.default_rng(threads).standard_normal((20, 12_345), dtype=np.float32)
    assert relative_error(cpu_gram(m, threads), reference(m)) < 1e-6
    assert np.array_equal(cpu_gram(m, threads), cpu_gram(m, 1))


@pytest.mark.parametrize("tile", [3, 4])
def test_parts_give_the_bits_of_one_pass_over_the_block(tile):
    """The parts are whole kernel pieces, so splitting changes no float32 sum, and adding the parts' float64 sums of
    float32 values of like size is exact: one thread's pass over the whole block (a fit made before parts
    existed, on two cores) gives the same bits."""
    assert all(gram_module.PART_COLUMNS % piece == 0 for piece in native.PIECES.values())
    m = np.random.default_rng(tile).standard_normal((20, 3 * gram_module.PART_COLUMNS + 123), dtype=np.float32) * 1e-3
    whole = np.zeros((20, 20))
    KERNELS().accumulate(m, whole, tile=tile)
    whole = np.tril(whole) + np.tril(whole, -1).T
    for threads in (1, 3):
        assert np.array_equal(cpu_gram(m, threads, tile), whole)


def test_a_blocks_gram_is_the_same_from_any_thread_of_a_pass(monkeypatch):
    """`chunk_gram` forms a block's Gram with as many threads as torch would use in the calling thread: 1 in a
    reader, the rest in the caller. Column counts off the part width, and of a whole number of parts."""
    monkeypatch.setattr(gram_module, "PART_COLUMNS", 1024)
    before = torch.get_num_threads()
    try:
        for n in (1, 1023, 1024, 1025, 4096, 10_000):
            m = torch.from_numpy(np.random.default_rng(n).standard_normal((20, n), dtype=np.float32))
            torch.set_num_threads(1)
            reader = chunk_gram(m, torch.device("cpu"))
            torch.set_num_threads(7)
            caller = chunk_gram(m, torch.device("cpu"))
            assert torch.equal(reader, caller), n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tile", [3, 4])
@pytest.mark.parametrize("steps", [6, 7])
def test_accumulate_adds_to_the_lower_triangle_only(tile, steps):
    m = np.random.default_rng(0).standard_normal((steps, 100), dtype=np.float32)
    gram = np.full((steps, steps), 7.0)
    KERNELS().accumulate(m, gram, 10, 60, tile=tile)
    want = reference(m[:, 10:60]) + 7.0
    lower = np.tril_indices(steps)
    upper = np.triu_indices(steps, 1)
    assert relative_error(gram[lower], want[lower]) < 1e-6
    assert np.all(gram[upper] == 7.0)


def test_nan_and_inf_reach_the_gram():
    """Only reassociation is allowed in the kernel, so a bad value is not optimised away."""
    m = np.ones((8, 1000), dtype=np.float32)
    m[5, 17] = np.nan
    m[2, 900] = np.inf
    g = cpu_gram(m)
    assert np.isnan(g[5]).all() and np.isnan(g[:, 5]).all()
    assert not np.isfinite(g[2]).any()
    assert g[0, 1] == 1000.0


def test_chunk_gram_takes_views_and_other_dtypes():
    big = torch.randn(12, 5000)
    view = big[:, 1000:3000]  # rows of a column slice are not adjacent
    want = reference(view.numpy().copy())
    assert relative_error(chunk_gram(view, CPU).numpy(), want) < 1e-6
    half = view.to(torch.bfloat16)
    got = chunk_gram(half, CPU).numpy()
    assert got.dtype == np.float64
    assert relative_error(got, reference(half.float().numpy())) < 1e-6


def test_without_numba_torch_forms_the_same_gram(monkeypatch):
    m = torch.randn(20, 40_000)
    with_kernel = chunk_gram(m, CPU)
    monkeypatch.setattr(gram_module, "_kernel", lambda: None)
    without = chunk_gram(m, CPU)
    assert without.dtype == torch.float64
    assert relative_error(without.numpy(), with_kernel.numpy()) < 1e-5


def test_kernels_that_cannot_be_compiled_fall_back_to_torch(monkeypatch, caplog):
    """E.g. numba unable to compile: the fit goes on with torch's product, and says so."""

    def broken():
        raise RuntimeError("cannot compile the entry points")

    monkeypatch.setattr(native, "load", broken)
    gram_module._kernel.cache_clear()
    try:
        m = torch.randn(6, 1000)
        with caplog.at_level("WARNING", logger="relex.fit.gram"):
            got = chunk_gram(m, CPU)
        assert relative_error(got.numpy(), reference(m.numpy())) < 1e-5
        assert "compiled CPU kernels are unavailable" in caplog.text and "cannot compile the entry points" in caplog.text
    finally:
        monkeypatch.undo()
        gram_module._kernel.cache_clear()
    assert isinstance(gram_module._kernel(), native.Kernels)


def test_compiling_the_kernels_skips_numbas_blas_look_and_leaves_numba_as_it_was():
    """numba's NumPy implementations import scipy.linalg to look for a BLAS when gram_kernel is imported to compile
    the kernels; relex skips that look (0.27 s) and puts numba's check back, so `np.dot` in numba code still
    compiles and runs."""
    import subprocess
    import sys

    code = (
        "import sys, numba, numpy as np, numba.np.linalg as linalg\n"
        "real = linalg.ensure_blas\n"
        "from relex.fit import gram_kernel\n"
        "gram = np.zeros((5, 5)); gram_kernel._lower(np.ones((5, 7), np.float32), gram, 0, 7, 4096, np.empty(16, np.float32))\n"
        "assert (np.tril(gram) == np.tril(np.full((5, 5), 7.0))).all(), gram  # the lower triangle\n"
        "assert 'scipy.linalg' not in sys.modules, 'scipy.linalg was imported'\n"
        "import numba.np.arraymath as arraymath\n"
        "assert linalg.ensure_blas is real and arraymath.ensure_blas is real\n"
        "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
        "assert dot(np.ones(3), np.full(3, 2.0)) == 6.0\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ---- weighted sums W · M -------------------------------------------------------------------------------------------
def reference_sums(w: np.ndarray, m: np.ndarray) -> np.ndarray:
    return w.astype(np.float64) @ m.astype(np.float64)


@pytest.mark.parametrize("rows", [1, 2, 3, 5])  # pairs of rows of W, and an odd last one paired with itself
@pytest.mark.parametrize("steps", [1, 2, 20])
@pytest.mark.parametrize("columns", [0, 1, 15, 2 * native.SUM_PIECE + 37])
def test_weighted_sums_equal_the_float64_product(rows, steps, columns):
    generator = np.random.default_rng(rows * 100 + steps * 10 + columns)
    w = generator.standard_normal((rows, steps), dtype=np.float32)
    m = generator.standard_normal((steps, columns), dtype=np.float32)
    out = np.full((rows, columns), np.nan, dtype=np.float32)
    KERNELS().weighted_sums(w, m, out)
    want = reference_sums(w, m)
    assert np.abs(out - want).max(initial=0.0) <= 1e-5 * max(1.0, np.abs(want).max(initial=0.0))


def test_weighted_sums_write_only_their_columns():
    m = np.random.default_rng(1).standard_normal((7, 3000), dtype=np.float32)
    w = np.random.default_rng(2).standard_normal((3, 7), dtype=np.float32)
    out = np.full((3, 3000), 7.0, dtype=np.float32)
    KERNELS().weighted_sums(w, m, out, 1000, 2500)
    assert np.all(out[:, :1000] == 7.0) and np.all(out[:, 2500:] == 7.0)
    assert np.abs(out[:, 1000:2500] - reference_sums(w, m[:, 1000:2500])).max() < 1e-4


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_weighted_sums_split_over_threads_are_the_same_bits(monkeypatch, threads):
    monkeypatch.setattr(gram_module, "PART_COLUMNS", 1000)
    m = np.random.default_rng(threads).standard_normal((20, 12_345), dtype=np.float32)
    w = np.random.default_rng(threads + 1).standard_normal((4, 20), dtype=np.float32)
    split, whole = np.empty((4, 12_345), np.float32), np.empty((4, 12_345), np.float32)
    gram_module.cpu_sums(w, m, split, threads)
    gram_module.cpu_sums(w, m, whole, 1)
    assert np.array_equal(split, whole)


def test_nan_and_inf_reach_the_weighted_sums():
    """As in the Gram, only reassociation and contraction are allowed: a bad value in M is not optimised away, even
    under a zero weight (0 · NaN is NaN), so the pass's check of the sums sees it (relex.fit.passes)."""
    m = np.ones((6, 2000), dtype=np.float32)
    m[4, 17] = np.nan
    m[1, 1500] = np.inf
    w = np.array([[1, 2, 3, 4, 0, 6], [0, 0, 0, 0, 0, 1]], dtype=np.float32)
    out = np.empty((2, 2000), np.float32)
    KERNELS().weighted_sums(w, m, out)
    assert np.isnan(out[:, 17]).all()
    assert np.isinf(out[0, 1500]) and np.isnan(out[1, 1500])  # inf · 0 is NaN
    assert out[0, 0] == 16.0 and out[1, 0] == 1.0


def test_chunk_sums_fills_the_given_memory_and_without_numba_torch_gives_the_same_sums(monkeypatch):
    m, w = torch.randn(20, 40_000), torch.randn(2, 20)
    out = torch.empty(2, 40_000)
    got = gram_module.chunk_sums(w, m, out)
    assert got.data_ptr() == out.data_ptr()
    want = reference_sums(w.numpy(), m.numpy())
    assert np.abs(got.numpy() - want).max() < 1e-4
    assert np.abs(gram_module.chunk_sums(w, m).numpy() - got.numpy()).max() == 0  # new memory, same bits
    monkeypatch.setattr(gram_module, "_kernel", lambda: None)
    assert np.abs(gram_module.chunk_sums(w, m, torch.empty(2, 40_000)).numpy() - want).max() < 1e-4
    assert np.abs(gram_module.chunk_sums(w, m).numpy() - want).max() < 1e-4


@pytest.mark.parametrize("tile", [3, 4])
@pytest.mark.parametrize("steps", [1, 5, 20])
def test_the_reading_kernel_equals_float64_with_either_tile(tmp_path, tile, steps):
    """`file_gram` reads a float32 matrix from a file piece by piece (more than one piece, with a remainder) and forms
    its Gram in either tile, whichever this CPU uses."""
    columns = 2 * native.read_piece_columns(steps, tile) + 37
    m = np.random.default_rng(steps).standard_normal((steps, columns), dtype=np.float32)
    path = tmp_path / "rows.bin"
    path.write_bytes(b"\0" * 8 + m.tobytes())  # each step's row after an 8-byte header, one after another
    fd = os.open(path, os.O_RDONLY)
    try:
        file = SimpleNamespace(descriptor=fd)
        files = TensorFiles.of_segments("m", columns, [[(file, 8 + 4 * columns * s, columns)] for s in range(steps)],
                                        [0] * steps, [0] * steps, None)
        lower = np.zeros((steps, steps))
        assert KERNELS().file_gram(files, lower, tile) == 0
    finally:
        os.close(fd)
    got = gram_module.symmetric(lower)
    assert relative_error(got, reference(m)) < 1e-6
    assert np.array_equal(np.triu(lower, 1), np.zeros_like(lower))  # the upper triangle is not written


@pytest.mark.parametrize("base_dtype", ["float32", "bf16", "fp16"])
@pytest.mark.parametrize("subtract", [False, True])
def test_the_reading_sums_add_theta0_and_form_their_checks(tmp_path, base_dtype, subtract):
    """`file_sums` with θ₀'s weights: out = θ₀ · b + W · M over a few column ranges of more than one piece (rows
    whose weight is 0 get W · M alone), and each row's checks, Σ (W · M)² and Σ out, equal float64's; where the steps
    hold θ_s, the same θ₀ read once serves both the subtraction and the sum. θ₀ in float32, bf16 or fp16."""
    steps, columns = 5, 2 * native.read_piece_columns(5) + 37
    rng = np.random.default_rng(7)
    theta = rng.standard_normal(columns, dtype=np.float32)
    if base_dtype == "bf16":  # values a bf16 holds exactly: the top half of a float32's bits
        theta = (theta.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        base_bytes = (theta.view(np.uint32) >> np.uint32(16)).astype(np.uint16).tobytes()
    elif base_dtype == "fp16":
        theta = theta.astype(np.float16).astype(np.float32)
        base_bytes = theta.astype(np.float16).tobytes()
    else:
        base_bytes = theta.tobytes()
    m = rng.standard_normal((steps, columns), dtype=np.float32)
    stored = m + theta if subtract else m
    path = tmp_path / "rows.bin"
    path.write_bytes(stored.tobytes() + base_bytes)
    w = rng.standard_normal((3, steps), dtype=np.float32)
    b = np.array([1, 0, 1], dtype=np.float32)
    fd = os.open(path, os.O_RDONLY)
    try:
        file = SimpleNamespace(descriptor=fd)
        code = KERNEL_DTYPES[parse_dtype(base_dtype)]
        files = TensorFiles.of_segments("m", columns, [[(file, 4 * columns * s, columns)] for s in range(steps)], [0] * steps,
                                        [subtract] * steps, (file, stored.nbytes, code))
        out, checks = [], np.zeros((3, 2))
        for start, stop in [(0, 1000), (1000, columns)]:  # two blocks: less than a piece, and more than one
            out.append(np.zeros((3, stop - start), dtype=np.float32))
            assert KERNELS().file_sums(w, files, out[-1], start, stop, b, checks) == 0
        out = np.concatenate(out, axis=1)
        unbased = files._replace(base_descriptor=-1)
        with pytest.raises(ValueError, match="θ₀ is not where the kernels can read it"):
            KERNELS().file_sums(w, unbased, np.zeros((3, columns), dtype=np.float32), base=b, checks=np.zeros((3, 2)))
    finally:
        os.close(fd)
    update = w.astype(np.float64) @ (stored.astype(np.float64) - (theta if subtract else 0))
    exact = update + b[:, None] * theta.astype(np.float64)
    assert np.abs(out - exact).max() < 1e-4
    np.testing.assert_allclose(checks[:, 0], (update**2).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(checks[:, 1], exact.sum(axis=1), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_reading_kernels_widen_every_2_byte_value_as_torch_does(tmp_path, dtype):
    """Every one of the 65,536 bf16 or fp16 values (zeros, subnormals, the largest, ±Inf, NaNs), read by the kernels
    from a file (`file_sums` with W = 1, which leaves each value as read), is torch's float32 for it, bit for bit;
    a NaN stays a NaN (the CPU's conversion may set its quiet bit)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = torch.from_numpy(bits.view(np.int16).copy()).view(dtype).float().numpy()
    path = tmp_path / "values.bin"
    path.write_bytes(b"\0" * 6 + bits.tobytes())  # at an offset that is not a multiple of 4
    fd = os.open(path, os.O_RDONLY)
    try:
        files = TensorFiles.of_segments("m", bits.size, [[(SimpleNamespace(descriptor=fd), 6, bits.size)]], [KERNEL_DTYPES[dtype]],
                                        [0], None)
        got = np.zeros((1, bits.size), dtype=np.float32)
        assert KERNELS().file_sums(np.ones((1, 1), dtype=np.float32), files, got) == 0
    finally:
        os.close(fd)
    nan = np.isnan(want)
    assert np.isnan(got[0, nan]).all() and nan.sum() == (254 if dtype == torch.bfloat16 else 2046)
    assert np.array_equal(got[0, ~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_the_reading_kernels_join_a_row_from_segments_in_several_files(tmp_path):
    """A row in segments (verl's shards: one per rank): uneven segments in two files, at offsets that are not a
    multiple of the piece, a step with one segment beside steps with three, one bf16 step, one empty segment. The Gram
    and W · M equal float64's; a segment cut short is named by its own file."""
    steps, columns = 3, 3 * native.read_piece_columns(3) + 101
    rng = np.random.default_rng(11)
    m = rng.standard_normal((steps, columns), dtype=np.float32)
    m[2] = (m[2].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # values bf16 holds exactly
    cuts = [0, 1000, 1000, columns - 7, columns]  # step 0: segments of 1000, 0, the middle and 7 values
    one, two = tmp_path / "rank0.bin", tmp_path / "rank1.bin"
    one.write_bytes(b"\0" * 12 + m[0, :1000].tobytes() + m[0, 1000 : columns - 7].tobytes() + m[1].tobytes())
    two.write_bytes(b"\0" * 4 + m[0, columns - 7 :].tobytes() + (m[2].view(np.uint32) >> np.uint32(16)).astype(np.uint16).tobytes())
    fds = [os.open(path, os.O_RDONLY) for path in (one, two)]
    try:
        first, second = (SimpleNamespace(descriptor=fd, short_read=lambda name, path=path: RuntimeError(f"{path}: short"))
                         for fd, path in zip(fds, (one, two)))
        segments = [
            [(first, 12, cuts[1]), (second, 0, 0), (first, 12 + 4 * 1000, cuts[3] - cuts[2]), (second, 4, columns - cuts[3])],
            [(first, 12 + 4 * (columns - 7), columns)],
            [(second, 4 + 28, columns)],
        ]
        files = TensorFiles.of_segments("m", columns, segments, [0, 0, 1], [0, 0, 0], None)
        assert files.descriptors.shape == (3, 4) and list(files.bounds[1]) == [0, columns, columns, columns, columns]
        lower = np.zeros((steps, steps))
        assert KERNELS().file_gram(files, lower) == 0
        w = rng.standard_normal((2, steps), dtype=np.float32)
        out = np.zeros((2, columns), dtype=np.float32)
        assert KERNELS().file_sums(w, files, out) == 0
        os.truncate(two, 4 + 28 + 2 * columns - 2)  # step 2's row, the last segment in rank1.bin, loses its last value
        status = KERNELS().file_gram(files, np.zeros((steps, steps)))
        assert str(files.read_failed(status)) == f"{two}: short"
    finally:
        for fd in fds:
            os.close(fd)
    assert relative_error(gram_module.symmetric(lower), reference(m)) < 1e-6
    assert np.abs(out - w.astype(np.float64) @ m.astype(np.float64)).max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_output_rounded_to_2_bytes_is_torchs_rounding_bit_for_bit(dtype):
    """`rounded` (the kernels' round_half), which extrapolate uses for bf16 and fp16 checkpoints, against torch's own
    `.to(dtype)`: every 251st float32 bit pattern (zeros, subnormals, ties, values past the dtype's range that round
    to ±Inf, NaNs) rounds to the same bits, a NaN to a NaN; its Σ (rounded − exact)² is the float64 sum of torch's
    float32 differences, and not finite exactly when an output is not."""
    patterns = torch.arange(0, 1 << 32, 251, dtype=torch.int64).to(torch.int32).view(torch.float32)
    out, lost = gram_module.rounded(patterns, dtype)
    want = patterns.to(dtype)
    nan = torch.isnan(want)
    assert torch.isnan(out[nan]).all() and nan.any()
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert not np.isfinite(lost)
    finite = patterns[torch.isfinite(want)]
    out, lost = gram_module.rounded(finite, dtype)
    differences = (finite.to(dtype).float() - finite).double()
    assert np.isfinite(lost) and lost == pytest.approx(float((differences * differences).sum()), rel=1e-12)
    assert gram_module.rounded(finite, torch.float64) is None and gram_module.rounded(finite[::2], dtype) is None
