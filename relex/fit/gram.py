"""The Gram matrix G = M Mᵀ of a tensor's trajectory (T × T), accumulated over row blocks (docs/method.md).

G is a sum over any split of the d columns of M, so one block of T × rows values is in memory at a time, on
the chosen device; a block of a few MiB is still in the CPU cache when its product is formed. Each block's
product is formed in float32 (on the CPU by relex.fit.gram_kernel's kernel, compiled ahead of time by
relex.fit.native, which computes the lower triangle only, in tiles sized to the CPU's vector registers; by torch's
matrix multiply on a GPU or without numba) and the blocks are accumulated in float64, so long runs and large
tensors do not lose digits.

The pass that builds G is also where non-finite values are caught (ingest does not read them unless asked to):
a NaN or Inf anywhere in step i's row of M makes G[i, i] = Σ M[i, c]² non-finite, so one look at the diagonal
names the step, at no cost beyond the product itself (`check_finite_gram`).

A pass's other product, a block's weighted sums W · M (`chunk_sums`), is here too, so that the pass gets all its
arithmetic from one place (`GRAM`): on the CPU by the kernel's `weighted_sums`, elsewhere by torch. So are both
products of a tensor whose float32 or bf16 files the kernels read themselves, piece by piece (`file_gram`,
`file_sums`; where they run: `reads_files`), which is how a pass reads such tensors on the CPU (relex.fit.passes).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch

from relex.errors import RelexError
from relex.fit import native
from relex.store import KERNEL_DTYPES, TensorFiles

LOG = logging.getLogger(__name__)

# a block's columns are formed in parts of this many, the unit of work a thread takes; a Gram is the sum of its
# parts' Grams, each formed on its own and added in column order, so its bits do not depend on how many threads
# form it, nor on which of a pass's threads does (a reader with one, the caller with the others: relex.store).
# A whole number of the kernel's column pieces (native.PIECES), within which it sums in float32, so splitting
# changes no float32 sum; float64 sums of float32 values of like size are exact, so the parts almost always give
# the bits of one pass over the whole block too (they did on the SmolLM2 store, for every tensor).
PART_COLUMNS = 1 << 15
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RelexError(f"device {name!r} asked for, but torch sees no CUDA device; use --device cpu or auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise RelexError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N")
    return torch.device(name)


def chunk_gram(chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The Gram contribution of one (T × c) block, as float64 on `device`.

    On the CPU it uses as many threads as torch would (`torch.get_num_threads()` in the calling thread).
    """
    if device.type == "cpu" and chunk.device.type == "cpu" and _kernel() is not None:
        return torch.from_numpy(cpu_gram(chunk.to(torch.float32).contiguous().numpy(), torch.get_num_threads()))
    x = chunk.to(device=device, dtype=torch.float32, non_blocking=True)
    return (x @ x.T).double()


def cpu_gram(matrix: np.ndarray, threads: int = 1, tile: int | None = None) -> np.ndarray:
    """M Mᵀ in float64 for a C-contiguous float32 M (T × n), by the compiled kernel: the Grams of its PART_COLUMNS-wide
    parts, formed by up to `threads` threads and added in order, so the same bits whatever `threads` is (`tile`:
    the kernel's, default this CPU's)."""
    kernel = _kernel()
    steps, n = matrix.shape
    bounds = _parts(n)
    grams = np.zeros((len(bounds) - 1, steps, steps))
    _run_parts(lambda i: kernel.accumulate(matrix, grams[i], bounds[i], bounds[i + 1], tile), len(grams), threads)
    gram = grams[0]
    for part in grams[1:]:  # in column order, as one thread would
        gram += part
    return symmetric(gram)


def symmetric(lower: np.ndarray) -> np.ndarray:
    """The whole Gram from the lower triangle the kernels form (the upper one is not read)."""
    return np.tril(lower) + np.tril(lower, -1).T


def _parts(n: int) -> list[int]:
    """The bounds of a block's column parts: PART_COLUMNS wide from column 0, the last one shorter (one part, empty
    or not, below that)."""
    return [*range(0, n, PART_COLUMNS), n] if n > PART_COLUMNS else [0, n]


def _run_parts(form, parts: int, threads: int) -> None:
    """`form(i)` for every part i: in order on this thread, or on up to `threads` of the pool's threads, each taking
    the next part not yet taken (so a short last part or a slow thread leaves none of them idle for long)."""
    workers = max(1, min(threads, parts))
    if workers == 1:
        for i in range(parts):
            form(i)
        return
    todo, lock = iter(range(parts)), threading.Lock()

    def work(_) -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            form(i)

    list(_thread_pool().map(work, range(workers)))


def chunk_sums(w: torch.Tensor, matrix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """W · M for one block (W: weights × T, M: T × c, both float32 on one device), into `out` when given (float32,
    on the host, weights × c). On the CPU by the compiled `weighted_sums` with as many threads as torch would use,
    elsewhere (a GPU, or without numba) by torch's matrix multiply."""
    if matrix.device.type == "cpu" and _kernel() is not None and matrix.is_contiguous():
        if out is None:
            out = torch.empty(len(w), matrix.shape[1], dtype=torch.float32)
        cpu_sums(w.numpy(), matrix.numpy(), out.numpy(), torch.get_num_threads())
        return out
    return torch_sums(w, matrix, out)


def cpu_sums(w: np.ndarray, matrix: np.ndarray, out: np.ndarray, threads: int = 1) -> None:
    """W · M into `out` by the compiled `weighted_sums`, M's columns in the parts `cpu_gram` forms, over up to
    `threads` threads (each output value is a sum over the steps of one column: the same bits however split)."""
    kernel = _kernel()
    w = np.ascontiguousarray(w, dtype=np.float32)
    if threads <= 1:
        kernel.weighted_sums(w, matrix, out)
        return
    bounds = _parts(matrix.shape[1])
    _run_parts(lambda i: kernel.weighted_sums(w, matrix, out, bounds[i], bounds[i + 1]), len(bounds) - 1, threads)


def reads_files(device: torch.device) -> bool:
    """Whether a pass on `device` can have the kernels read the values from their files themselves (on the CPU,
    with the compiled kernels: `file_gram`, `file_sums`)."""
    return device.type == "cpu" and _reading_kernel() is not None


def file_gram(files) -> np.ndarray:
    """M Mᵀ in float64 for the tensor at `files` (relex.store.TensorFiles), by the kernel that reads its values as it
    goes, one thread; a read that comes up short is an error naming the file."""
    gram = np.zeros((len(files.descriptors),) * 2)
    status = _reading_kernel().file_gram(files, gram)
    if status:
        raise files.read_failed(status)
    return symmetric(gram)


def file_sums(w: np.ndarray, files, out: np.ndarray, start: int, stop: int, base: np.ndarray | None = None,
              checks: np.ndarray | None = None) -> None:
    """(W · M)[:, start:stop] into `out` (float32, weights × (stop − start)) for the tensor at `files`, by the kernel
    that reads its values as it goes, one thread; with `base` and `checks`, θ₀ · base added and the checks formed
    (native.Kernels.file_sums)."""
    status = _reading_kernel().file_sums(w, files, out, start, stop, base, checks)
    if status:
        raise files.read_failed(status)


def prepare(device: torch.device) -> None:
    """Load (or, in a fresh install, compile) the CPU kernels now, so that the first block does not wait for them."""
    if device.type == "cpu":
        _kernel()


@functools.cache
def _kernel() -> native.Kernels | None:
    """The compiled CPU kernels (relex.fit.native), or None without numba (then torch's matrix multiply forms the
    Gram and W · M).

    Also None, with a warning, when numba is installed but the kernels cannot be compiled or loaded, so that a fit
    never fails for want of the faster path.
    """
    try:
        kernels = native.load()
        # a trial product of each kind, so that a kernel that cannot run here is found now
        kernels.accumulate(np.ones((5, 3), dtype=np.float32), np.zeros((5, 5)))
        kernels.weighted_sums(np.ones((2, 5), dtype=np.float32), np.ones((5, 3), dtype=np.float32), np.zeros((2, 3), dtype=np.float32))
    except ImportError:  # numba is not installed
        return None
    except Exception as error:  # numba's and llvmlite's errors have no common base class
        LOG.warning("the compiled CPU kernels are unavailable (%s); using torch's matrix product", error)
        return None
    return kernels


@functools.cache
def _reading_kernel():
    """The compiled kernels when their reading kernels (`file_gram`, `file_sums`) run here, else None (none, or
    a platform without `pread`: then passes read blocks for the kernels, relex.store). Tried on the null device,
    which every read finds empty."""
    kernel = _kernel()
    if kernel is None:
        return None
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        try:
            files = TensorFiles.of_segments("trial", 3, [[(SimpleNamespace(descriptor=fd), 0, 3)]], [0], [0], None)
            found = (kernel.file_gram(files, np.zeros((1, 1))), kernel.file_sums(np.ones((2, 1), dtype=np.float32), files, np.zeros((2, 3), dtype=np.float32)))
        finally:
            os.close(fd)
    except Exception as error:  # e.g. a platform without pread
        LOG.warning("the kernels that read files are unavailable (%s); passes read blocks for them", error)
        return None
    return kernel if found == (1, 1) else None


def rounded(exact: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
    """`exact` (float32, on the CPU, contiguous) rounded to bf16 or fp16 as torch rounds it, and Σ (rounded − exact)²
    in float64, in one loop without the GIL (native.Kernels.round_half); None where that kernel does not apply (no
    compiled kernels, another dtype or device), for the caller to round with torch."""
    if dtype not in (torch.bfloat16, torch.float16) or exact.device.type != "cpu" or exact.dtype != torch.float32 or not exact.is_contiguous():
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    out = torch.empty(exact.shape, dtype=dtype)
    lost = kernel.round_half(exact.numpy(), out.view(torch.int16).numpy().view(np.uint16), KERNEL_DTYPES[dtype])
    return out, lost


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(thread_name_prefix="relex-gram")
        return _pool


def check_finite_gram(name: str, gram: np.ndarray, steps) -> None:
    """Refuse a Gram whose diagonal is not finite: step i's values of tensor `name` hold a NaN or Inf."""
    diagonal = np.diagonal(gram)
    if not np.isfinite(diagonal).all():
        step = steps[int(np.flatnonzero(~np.isfinite(diagonal))[0])]
        raise RelexError(non_finite_message(name, step))


# a pass's arithmetic (the Gram, its check, W · M, from blocks read for it or from the files), as a pass (relex.fit.passes) and the store's stream
# (`TrajectoryReader.stream`) call it
GRAM = SimpleNamespace(prepare=prepare, chunk_gram=chunk_gram, check=check_finite_gram, chunk_sums=chunk_sums,
                       reads_files=reads_files, file_gram=file_gram, file_sums=file_sums)


def non_finite_message(name: str, step: int) -> str:
    return (f"tensor {name}: NaN or Inf at step {step} (the checkpoint holds non-finite weights, or changed after "
            "ingest; `relex ingest --verify` checks every value up front)")


def torch_sums(w: torch.Tensor, matrix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """W · M by torch's matrix multiply on the matrix's device, on the host: into `out` (float32, weights × c) when
    given, else new memory."""
    if out is None:
        return (w @ matrix).cpu()
    if matrix.device.type == "cpu":
        return torch.matmul(w, matrix, out=out)
    return out.copy_(w @ matrix)
