"""The CPU kernels (relex.fit.gram_kernel) compiled ahead of time, loaded without importing numba.

A process that took the kernels from numba spent 0.6-0.7 s on numba before its first product: importing numba
(0.23-0.28 s), gram_kernel's decorators and numba's NumPy implementations (0.13-0.19 s), and its first call, which
sets up numba's compiler to load the cached code (0.24-0.32 s), all holding the GIL. On a pass over the SmolLM2
store of copied deltas that was a sixth of the whole command, with the other core idle. Here the kernels' C entry
points (`gram_kernel.entry_points`, numba cfuncs) are compiled once into one object file for this CPU, kept in
relex's user cache (`kernels/`), and each later process loads that file with llvmlite's JIT linker (the machine
code is not compiled again) and calls it through ctypes, which releases the GIL: 0.008 s, after importing
llvmlite (0.03-0.06 s, which numba's import included).

The object is LLVM's machine code for numba's optimised IR of those entry points: the same loops, vectorised the
same way as numba's own JIT compiles them for this CPU (the same target options as numba's). Its name is a hash
of what went into it: both modules' source, numba's and llvmlite's versions, the CPU's name and features. A
change to any of these compiles a new one (`load`): the first call in a fresh install compiles it (about 20 s;
6 s where numba's own cache of the kernels' callees is warm), and without numba, or where this cannot be done,
relex.fit.gram forms its products with torch.

numba's code for an exception (none of these kernels raises on the arguments the wrappers below check) calls
into numba's and Python's runtime, which a process that has not imported numba lacks; those calls are linked to a
stub that writes one line to stderr and aborts the process, rather than returning a wrong result.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import platform
import threading
from pathlib import Path

import numpy as np

from relex.io.atomic import write_bytes_atomic
from relex.models import cache_dir

LOG = logging.getLogger(__name__)

PIECES = {4: 16384, 3: 4096}  # columns per piece: T = 20 rows of float32 are 1.3 MiB at 16384 (a 2 MiB L2, where
# the 4 × 4 tile was measured) and 0.3 MiB at 4096 (a 512 KiB L2, where the 3 × 3 tile was)
SUM_PIECE = 1024  # columns per piece of W · M: T = 20 rows of it are 80 KiB, in L2 while two rows of W pass over them

# Each entry point's result and arguments: "p" an address (an array's first value), "i" int64, "d" float64.
ENTRIES = {
    # m, steps, columns, gram, start, stop, piece, tile, out (a tile's sums)
    "lower": ("i", "piipiiiip"),
    # w, rows, steps, m, columns, out, start, stop, piece, a, b (room for two rows of sums)
    "sums": ("i", "piipipiiipp"),
    # fds, offsets, bounds, dtypes, subtract, steps, segments, base_fd, base_offset, base_dtype, n, piece, tile,
    # gram, rows, base_row, half, out
    "file_lower": ("i", "ppppp" "iiiiiiii" "ppppp"),
    # w, rows of w, b, len(b), fds, offsets, bounds, dtypes, subtract, steps, segments, base_fd, base_offset,
    # base_dtype, start, stop, piece, out, checks, rows, base_row, half, sa, sb
    "file_sums": ("i", "pipi" "ppppp" "iiiiiiii" "ppppppp"),
    # exact, out, n, dtype
    "round_half": ("d", "ppii"),
}
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "d": ctypes.c_double}
_STUB_PREFIXES = ("numba_", "NRT_", "Py", "_Py")  # numba's and Python's runtime, reached only on an exception
_FAULT = b"relex: a compiled kernel (relex.fit.native) raised an exception; nothing it computed is used\n"


@functools.cache
def host_cpu() -> tuple[str, str]:
    """This CPU's name and features as LLVM sees them (what numba compiles for)."""
    from llvmlite import binding

    return binding.get_host_cpu_name(), binding.get_host_cpu_features().flatten()


def _wide_vector_registers() -> bool:
    """Whether the CPU has AVX-512 (32 vector registers), where numba's code keeps 16 sums in registers."""
    try:
        return "+avx512f" in host_cpu()[1].split(",")
    except Exception:  # an unknown CPU: the tile that fits 16 registers is right on every one
        return False


def _tile() -> int:
    """`TILE`, this CPU's rows (and columns) of a tile of the Gram: worked out on first use, not at import, since
    asking LLVM for the CPU's features imports llvmlite (0.03-0.16 s here), which commands that import relex.fit
    but run no kernel (`relex ingest`, `relex eval`) need not wait for. Set `TILE` to choose another."""
    if "TILE" not in globals():
        globals()["TILE"] = 4 if _wide_vector_registers() else 3
    return globals()["TILE"]


def __getattr__(name: str):
    if name == "TILE":
        return _tile()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_piece_columns(steps: int, tile: int | None = None) -> int:
    """Columns per piece the reading kernels take: `steps` rows of them within the L2 share the tile's pieces were
    measured in (T = 20 rows of PIECE columns), a multiple of 256, at least 256."""
    piece = PIECES[tile or _tile()]
    columns = piece * 20 // max(1, steps)
    return max(256, min(piece, columns // 256 * 256))


# ---- the object file: compiled once, loaded by every process -------------------------------------------------
def object_path() -> Path:
    """Where this CPU's compiled kernels are kept: relex's user cache, named by what went into them."""
    here = Path(__file__).resolve().parent
    parts = [(here / "gram_kernel.py").read_bytes(), Path(__file__).resolve().read_bytes(),
             importlib.metadata.version("numba").encode(), importlib.metadata.version("llvmlite").encode(),
             platform.machine().encode(), *(part.encode() for part in host_cpu())]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    return cache_dir() / "kernels" / f"{key}.o"


def _target_machine():
    """An LLVM target machine for this CPU with numba's own JIT options (numba.core.codegen's)."""
    from llvmlite import binding

    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    target = binding.Target.from_default_triple()
    reloc = "static" if target.name.startswith("x86") else "pic" if target.name.startswith("ppc") else "default"
    cpu, features = host_cpu()
    return target.create_target_machine(cpu=cpu, features=features, opt=3, reloc=reloc, codemodel="jitdefault", jit=True)


def compile_object() -> bytes:
    """Compile the entry points with numba and emit them as one object file for this CPU, each named
    `relex_<entry>`, numba's exception paths linked to the stub that aborts (above)."""
    from llvmlite import binding, ir

    from relex.fit import gram_kernel  # numba: only to compile

    module = None
    for name, cfunc in gram_kernel.entry_points().items():
        part = binding.parse_assembly(cfunc.inspect_llvm())
        part.get_function(cfunc.native_name).name = f"relex_{name}"
        if module is None:
            module = part
        else:
            module.link_in(part)
    stubs = ir.Module()
    stubs.triple, stubs.data_layout = module.triple, module.data_layout
    fault = ir.Function(stubs, ir.FunctionType(ir.VoidType(), []), "relex_kernel_fault")
    message = ir.GlobalVariable(stubs, ir.ArrayType(ir.IntType(8), len(_FAULT)), "relex_kernel_fault_message")
    message.global_constant, message.initializer = True, ir.Constant(ir.ArrayType(ir.IntType(8), len(_FAULT)), bytearray(_FAULT))
    write = ir.Function(stubs, ir.FunctionType(ir.IntType(64), [ir.IntType(32), message.type, ir.IntType(64)]), "write")
    abort = ir.Function(stubs, ir.FunctionType(ir.VoidType(), []), "abort")
    builder = ir.IRBuilder(fault.append_basic_block())
    builder.call(write, [ir.Constant(ir.IntType(32), 2), message, ir.Constant(ir.IntType(64), len(_FAULT))])
    builder.call(abort, [])
    builder.unreachable()
    for function in module.functions:
        if function.is_declaration and function.name.startswith(_STUB_PREFIXES):
            stub = ir.Function(stubs, ir.FunctionType(ir.VoidType(), [], var_arg=True), function.name)
            builder = ir.IRBuilder(stub.append_basic_block())
            builder.call(fault, [])
            builder.unreachable()
    for variable in module.global_variables:
        if variable.is_declaration and variable.name.startswith(_STUB_PREFIXES):
            ir.GlobalVariable(stubs, ir.IntType(64), variable.name).initializer = ir.Constant(ir.IntType(64), 0)
    module.link_in(binding.parse_assembly(str(stubs)))
    return _target_machine().emit_object(module)


class Kernels:
    """The compiled kernels in this process, behind the arguments relex passes them (arrays, relex.store.TensorFiles).
    Every array is checked for its dtype, shape and layout before its address is passed; each call releases the
    GIL (ctypes), so threads run kernels side by side."""

    def __init__(self, code: bytes):
        from llvmlite import binding

        self._engine = binding.create_mcjit_compiler(binding.parse_assembly(""), _target_machine())
        self._engine.add_object_file(binding.ObjectFileRef.from_data(code))
        self._engine.finalize_object()
        for name, (result, arguments) in ENTRIES.items():
            address = self._engine.get_function_address(f"relex_{name}")
            if not address:
                raise RuntimeError(f"the compiled kernels have no entry point relex_{name}")
            prototype = ctypes.CFUNCTYPE(_CTYPES[result], *(_CTYPES[a] for a in arguments))
            setattr(self, f"_{name}", prototype(address))

    def accumulate(self, matrix: np.ndarray, gram: np.ndarray, start: int = 0, stop: int | None = None, tile: int | None = None) -> None:
        """Add the lower triangle of M Mᵀ over M's columns start:stop to `gram` (float64, T × T, upper triangle
        untouched). M = `matrix`, float32 and C-contiguous (T × n). `tile`: 4 or 3 (default `TILE`, this CPU's)."""
        tile = tile or _tile()
        steps, columns = _checked(matrix, np.float32, 2, written=False).shape
        stop = columns if stop is None else stop
        _columns(start, stop, columns)
        out = aligned_empty(16, np.float32)
        self._lower(matrix.ctypes.data, steps, columns, _checked(gram, np.float64, 2, (steps, steps)).ctypes.data,
                    start, stop, PIECES[tile], tile, out.ctypes.data)

    def weighted_sums(self, w: np.ndarray, matrix: np.ndarray, out: np.ndarray, start: int = 0, stop: int | None = None) -> None:
        """out[:, start:stop] = (W · M)[:, start:stop] for float32, C-contiguous W (R × T), M (T × n) and out (R × n)."""
        rows, steps = _checked(w, np.float32, 2, written=False).shape
        columns = _checked(matrix, np.float32, 2, (steps, None), written=False).shape[1]
        _checked(out, np.float32, 2, (rows, columns))
        stop = columns if stop is None else stop
        _columns(start, stop, columns)
        a, b = aligned_empty(SUM_PIECE, np.float32), aligned_empty(SUM_PIECE, np.float32)
        self._sums(w.ctypes.data, rows, steps, matrix.ctypes.data, columns, out.ctypes.data, start, stop, SUM_PIECE,
                   a.ctypes.data, b.ctypes.data)

    def file_gram(self, files, gram: np.ndarray, tile: int | None = None) -> int:
        """Add the lower triangle of M Mᵀ for the tensor at `files` (relex.store.TensorFiles) to `gram` (float64
        T × T), reading its values as it goes; 0, or the status of a short read (relex.store.TensorFiles.read_failed)."""
        tile = tile or _tile()
        located = _Located(files, reads_base=bool(files.subtract.any()))
        steps, piece = located.steps, read_piece_columns(located.steps, tile)
        room = _Room.of_thread(steps, piece)
        return self._file_lower(*located.arguments, files.numel, piece, tile,
                                _checked(gram, np.float64, 2, (steps, steps)).ctypes.data, *room.addresses[:3], room.tile)

    def file_sums(self, w: np.ndarray, files, out: np.ndarray, start: int = 0, stop: int | None = None,
                  base: np.ndarray | None = None, checks: np.ndarray | None = None) -> int:
        """out = (W · M)[:, start:stop] for the tensor at `files`, reading its values as it goes (W float32 R × T, out
        float32 R × (stop − start), C-contiguous); 0, or the status of a short read.

        With `base` (float32, one weight per row of W) and `checks` (float64 R × 2): out = θ₀ · base + W · M, θ₀'s
        values read beside the steps' (`files.base_descriptor`, which must be open), and checks[r] += (Σ (W · M)[r]²,
        Σ out[r]): the second is finite exactly when every value of out[r] is."""
        stop = files.numel if stop is None else stop
        _columns(start, stop, files.numel)
        if base is None:
            base, checks = np.zeros(0, dtype=np.float32), np.zeros((0, 2))
        elif files.base_descriptor < 0:
            raise ValueError(f"tensor {files.name}: θ₀ is not where the kernels can read it (TensorFiles.base_descriptor)")
        located = _Located(files, reads_base=len(base) > 0 or bool(files.subtract.any()))
        rows = _checked(w, np.float32, 2, (None, located.steps), written=False).shape[0]
        _checked(out, np.float32, 2, (rows, stop - start))
        _checked(base, np.float32, 1, written=False)
        if len(base) not in (0, rows):
            raise ValueError(f"{len(base)} weights of θ₀ for {rows} rows of W")
        _checked(checks, np.float64, 2, (len(base), 2))
        piece = read_piece_columns(located.steps)
        room = _Room.of_thread(located.steps, piece)
        return self._file_sums(w.ctypes.data, rows, base.ctypes.data, len(base), *located.arguments, start, stop,
                               piece, out.ctypes.data, checks.ctypes.data, *room.addresses)

    def round_half(self, exact: np.ndarray, out: np.ndarray, dtype: int) -> float:
        """`exact` (float32, contiguous) rounded to bf16 or fp16 (`dtype`: relex.store.KERNEL_DTYPES's code, 1 or 2)
        into `out` (uint16, the values' bits, as long); returns Σ (out − exact)² (float64; not finite when an output
        value is not)."""
        if dtype not in (1, 2):
            raise ValueError(f"round_half rounds to bf16 (1) or fp16 (2), not dtype code {dtype}")
        _checked(exact, np.float32, exact.ndim, written=False)
        _checked(out, np.uint16, out.ndim, exact.shape)
        return self._round_half(exact.ctypes.data, out.ctypes.data, exact.size, dtype)


class _Located:
    """A relex.store.TensorFiles as the reading kernels take it (its index arrays checked); θ₀ is read where
    `reads_base`."""

    def __init__(self, files, reads_base: bool):
        self.steps, segments = _checked(files.descriptors, np.int32, 2, written=False).shape
        arrays = (files.descriptors, _checked(files.offsets, np.int64, 2, (self.steps, segments), False),
                  _checked(files.bounds, np.int64, 2, (self.steps, segments + 1), False),
                  _checked(files.dtypes, np.uint8, 1, (self.steps,), False), _checked(files.subtract, np.uint8, 1, (self.steps,), False))
        self.arguments = (*(a.ctypes.data for a in arrays), self.steps, segments,
                          files.base_descriptor if reads_base else -1, files.base_offset, files.base_dtype)


class _Room:
    """The buffers a reading kernel works in: a piece of every step's row, θ₀'s piece, a row of 2-byte values, two
    rows of W · M's sums (`addresses`), and a Gram tile's sums (`tile`). They live as long as this object: hold it
    until the kernel returns, or its addresses point at freed memory."""

    _threads = threading.local()

    @classmethod
    def of_thread(cls, steps: int, piece: int) -> _Room:
        """This thread's room for `steps` rows of `piece` columns, made on its first call and reused by the next
        (a pass calls the reading kernels about 1,200 times on SmolLM2, from the same few threads). With fresh
        buffers each call (1.3 MB for T = 20), the kernel threads took 0.03-0.28 CPU-s more in a pass of the
        copied SmolLM2 store, in 4 of 4 alternating pairs (stop 40)."""
        rooms = getattr(cls._threads, "rooms", None)
        if rooms is None:
            rooms = cls._threads.rooms = {}
        room = rooms.get((steps, piece))
        if room is None:
            room = rooms[(steps, piece)] = cls(steps, piece)
        return room

    def __init__(self, steps: int, piece: int):
        self.buffers = (aligned_empty((steps, piece), np.float32), aligned_empty(piece, np.float32),
                        aligned_empty(piece, np.uint16), aligned_empty(SUM_PIECE, np.float32),
                        aligned_empty(SUM_PIECE, np.float32), aligned_empty(16, np.float32))
        self.addresses = tuple(b.ctypes.data for b in self.buffers[:5])
        self.tile = self.buffers[5].ctypes.data


ALIGNMENT = 64  # bytes: a cache line, and an AVX-512 vector


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose first value starts a cache line. NumPy's own start 16 bytes into one (glibc's
    malloc), numba's 32; the kernels' vector loads from such a buffer straddle two cache lines. In a pass over the
    SmolLM2 store the kernels' threads took 0.5-1.0 CPU-s more with NumPy's buffers than with numba's (three
    alternating pairs); aligned, part of that gap remained (docs/performance.md, stop 40)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + count * dtype.itemsize].view(dtype).reshape(shape)


def _checked(array: np.ndarray, dtype, ndim: int, shape: tuple | None = None, written: bool = True) -> np.ndarray:
    """`array`, refused unless it is a C-contiguous `dtype` array of `ndim` dimensions (and `shape`, None for any
    size), and writeable where the kernel writes it: its address goes to compiled code that trusts it."""
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != ndim or not array.flags.c_contiguous:
        got = f"{array.dtype} {array.shape}, contiguous {array.flags.c_contiguous}" if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"a kernel takes a C-contiguous {np.dtype(dtype)} array of {ndim} dimensions, not {got}")
    if shape is not None and any(want is not None and want != have for want, have in zip(shape, array.shape)):
        raise ValueError(f"a kernel takes an array of shape {shape} here, not {array.shape}")
    if written and not array.flags.writeable:
        raise ValueError("a kernel's arrays must be writeable")
    return array


def _columns(start: int, stop: int, columns: int) -> None:
    if not 0 <= start <= stop <= columns:
        raise ValueError(f"columns {start}:{stop} of {columns}")


_LOADING = threading.Lock()


def load() -> Kernels:
    """This CPU's compiled kernels: the object in relex's user cache, or compiled now (numba) and kept there. A
    cache that cannot be written is no error (each process compiles them, as without a cache); a kept object whose
    checksum does not match (cut short, damaged) is compiled again: LLVM's loader is never handed bytes relex did
    not write whole. One thread at a time: a pass loads them on a thread of its own while its main thread plans,
    and in a fresh install the second caller then loads what the first compiled instead of compiling too."""
    with _LOADING:
        return _load()


def _load() -> Kernels:
    path = object_path()
    try:
        code = _unsealed(path.read_bytes())
        if code is not None:
            return Kernels(code)
        LOG.warning("%s: the compiled kernels are damaged (their checksum does not match); compiling them again", path)
    except OSError:  # not kept yet, or the cache cannot be read (then it cannot be written either: said below)
        pass
    code = compile_object()
    kernels = Kernels(code)
    try:
        write_bytes_atomic(path, code + hashlib.sha256(code).digest(), make_parents=True)
    except OSError as error:
        LOG.warning("%s: the compiled kernels are not kept (%s); each process compiles them", path, error)
    return kernels


def _unsealed(kept: bytes) -> bytes | None:
    """The object in a kept file (the object, then its SHA-256), or None where the two do not match."""
    code, digest = kept[:-32], kept[-32:]
    return code if len(kept) > 32 and hashlib.sha256(code).digest() == digest else None
