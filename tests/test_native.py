"""The CPU kernels compiled ahead of time (relex.fit.native): kept in the user cache, loaded without numba, compiled
again when missing or damaged, and refusing arrays their compiled code cannot take."""

import hashlib
import logging
import subprocess
import sys

import numpy as np
import pytest

from relex.fit import gram as gram_module
from relex.fit import native


@pytest.fixture(scope="module")
def compiled() -> bytes:
    """This CPU's object file, as the suite's cache keeps it (compiled there first if need be)."""
    native.load()
    return native.object_path().read_bytes()[:-32]  # the object, without its checksum


def test_a_process_loads_the_kept_kernels_without_importing_numba(compiled):
    code = (
        "import sys, time, numpy as np\n"
        "from relex.fit import gram\n"
        "started = time.perf_counter(); kernels = gram._kernel(); seconds = time.perf_counter() - started\n"
        "assert kernels is not None\n"
        "g = np.zeros((3, 3)); kernels.accumulate(np.ones((3, 5), np.float32), g)\n"
        "assert g[2, 1] == 5.0, g\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
        "print(f'{seconds:.3f}')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) < 2.0  # 0.01 s here, against 0.6-0.7 s for numba's import and load


def test_a_missing_object_is_compiled_once_and_kept(monkeypatch, tmp_path, compiled):
    monkeypatch.setenv("RELEX_CACHE", str(tmp_path / "cache"))
    compiles = []
    monkeypatch.setattr(native, "compile_object", lambda: compiles.append(1) or compiled)
    path = native.object_path()
    assert not path.exists()
    first = native.load()
    assert compiles == [1] and path.read_bytes()[:-32] == compiled
    second = native.load()  # from the cache: nothing compiled
    assert compiles == [1]
    for kernels in (first, second):
        out = np.empty((1, 4), np.float32)
        kernels.weighted_sums(np.full((1, 2), 0.5, np.float32), np.arange(8, dtype=np.float32).reshape(2, 4), out)
        assert out.tolist() == [[2.0, 3.0, 4.0, 5.0]]


def test_a_damaged_object_is_compiled_again_and_replaced(monkeypatch, tmp_path, caplog, compiled):
    monkeypatch.setenv("RELEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "compile_object", lambda: compiled)
    path = native.object_path()
    path.parent.mkdir(parents=True)
    kept = compiled + hashlib.sha256(compiled).digest()
    path.write_bytes(kept[: len(kept) // 3])  # cut short, as by a full disk outside relex
    with caplog.at_level(logging.WARNING, logger="relex.fit.native"):
        kernels = native.load()
    assert "are damaged (their checksum does not match)" in caplog.text and "compiling them again" in caplog.text
    assert path.read_bytes() == kept
    assert kernels.round_half(np.array([1.0, 2.5], np.float32), np.empty(2, np.uint16), 1) == 0.0


def test_a_cache_that_cannot_be_written_is_no_error(monkeypatch, tmp_path, caplog, compiled):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("RELEX_CACHE", str(blocker))
    monkeypatch.setattr(native, "compile_object", lambda: compiled)
    with caplog.at_level(logging.WARNING, logger="relex.fit.native"):
        kernels = native.load()
    assert "are not kept" in caplog.text and "each process compiles them" in caplog.text
    gram = np.zeros((2, 2))
    kernels.accumulate(np.ones((2, 3), np.float32), gram)
    assert gram[1, 0] == 3.0


def test_the_objects_name_follows_the_cpu(monkeypatch):
    """An object compiled for one CPU is never loaded on another (a home folder shared by a cluster's nodes)."""
    here = native.object_path()
    monkeypatch.setattr(native, "host_cpu", lambda: ("znver4", "+avx2,+fma"))
    assert native.object_path() != here and native.object_path().parent == here.parent


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k: k.accumulate(np.ones((3, 5), np.float64), np.zeros((3, 3))), "float32"),
        (lambda k: k.accumulate(np.ones((3, 10), np.float32)[:, ::2], np.zeros((3, 3))), "C-contiguous"),
        (lambda k: k.accumulate(np.ones((3, 5), np.float32), np.zeros((2, 2))), "shape"),
        (lambda k: k.accumulate(np.ones((3, 5), np.float32), np.zeros((3, 3)), 2, 9), "columns 2:9 of 5"),
        (lambda k: k.weighted_sums(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32), np.zeros((2, 5), np.float32)), "shape"),
        (lambda k: k.weighted_sums(np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), np.zeros((2, 5), np.float32).T.copy().T), "C-contiguous"),
        (lambda k: k.round_half(np.ones(4, np.float32), np.empty(3, np.uint16), 1), "shape"),
        (lambda k: k.round_half(np.ones(4, np.float32), np.empty(4, np.uint16), 0), "dtype code 0"),
        (lambda k: k.round_half(np.ones(4, np.float32), np.frombuffer(bytes(8), np.uint16), 2), "writeable"),
    ],
)
def test_arrays_the_compiled_code_cannot_take_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(gram_module._kernel())


def test_an_exception_in_compiled_code_stops_the_process_with_one_line(compiled):
    """The Python wrappers never pass what makes a kernel raise; called bare with a piece of 0 columns (`range`'s
    step), numba's exception path reaches the stub, which says so and aborts rather than return a wrong result."""
    code = (
        "import numpy as np\n"
        "from relex.fit import native\n"
        "k = native.load()\n"
        "m, g, out = np.ones((4, 8), np.float32), np.zeros((4, 4)), np.empty(16, np.float32)\n"
        "k._lower(m.ctypes.data, 4, 8, g.ctypes.data, 0, 8, 0, 4, out.ctypes.data)\n"
        "print('returned')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "relex: a compiled kernel (relex.fit.native) raised an exception" in done.stderr


@pytest.mark.parametrize("shape, dtype", [((20, 16384), np.float32), (4096, np.uint16), (16, np.float32), ((3, 5), np.float64)])
def test_the_kernels_buffers_start_a_cache_line(shape, dtype):
    for _ in range(5):
        array = native.aligned_empty(shape, dtype)
        assert array.ctypes.data % native.ALIGNMENT == 0
        assert array.shape == np.empty(shape).shape and array.dtype == dtype
        assert array.flags.c_contiguous and array.flags.writeable


def test_threads_that_load_at_once_compile_once(monkeypatch, tmp_path, compiled):
    """A pass loads the kernels on a thread of its own while its main thread plans: in a fresh install the second
    caller waits for the first and loads what it kept."""
    import threading
    import time

    monkeypatch.setenv("RELEX_CACHE", str(tmp_path / "cache"))
    compiles = []

    def slow_compile():
        compiles.append(1)
        time.sleep(0.5)
        return compiled

    monkeypatch.setattr(native, "compile_object", slow_compile)
    loaded = []
    threads = [threading.Thread(target=lambda: loaded.append(native.load())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compiles == [1] and len(loaded) == 3 and all(isinstance(k, native.Kernels) for k in loaded)


def test_each_thread_reuses_its_own_room_for_the_reading_kernels():
    import threading

    here = native._Room.of_thread(20, 4096)
    assert native._Room.of_thread(20, 4096) is here and native._Room.of_thread(5, 4096) is not here
    assert all(b.ctypes.data % native.ALIGNMENT == 0 for b in here.buffers)
    other = []
    thread = threading.Thread(target=lambda: other.append(native._Room.of_thread(20, 4096)))
    thread.start()
    thread.join()
    assert other[0] is not here and other[0].buffers[0].ctypes.data != here.buffers[0].ctypes.data


def test_importing_relex_fit_leaves_llvmlite_unimported_until_a_kernel_is_used():
    """Commands that import relex.fit but run no kernel (`relex ingest`, `relex eval`) do not wait for llvmlite;
    the tile is worked out when it is first needed."""
    code = (
        "import sys\n"
        "import relex.fit, relex.fit.gram\n"
        "from relex.fit import native\n"
        "assert not any(m.startswith('llvmlite') for m in sys.modules), 'llvmlite imported'\n"
        "assert native.TILE in native.PIECES and 'llvmlite.binding' in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
