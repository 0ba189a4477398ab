"""Direct I/O (O_DIRECT, bypassing the page cache) reads and writes exactly what plain reads and writes do, falls
back to them where the file system refuses it, and is chosen sensibly."""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import relex.store
from relex.errors import RelexError
from relex.fit import FitConfig, fit_store
from relex.io import stream_writer
from relex.io.checkpoint import TensorInfo
from relex.io.safetensors_file import DIRECT_ALIGN, SafetensorsFile
from relex.io.stream_writer import StreamingSafetensorsWriter
from relex.store import Block, TrajectoryStore
from tests.conftest import cli

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="this OS has no O_DIRECT")


@pytest.fixture
def store(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", "--copy") == 0
    return TrajectoryStore.open(tmp_path / "store")


def test_direct_reads_equal_plain_reads_at_any_offset(store, monkeypatch):
    monkeypatch.setattr("relex.io.safetensors_file.DIRECT_PIECE", 2 * DIRECT_ALIGN)  # many pieces per tensor
    path = next((store.path / "deltas").iterdir())
    plain, direct = SafetensorsFile(path), SafetensorsFile(path, direct=True)
    if not direct.direct:
        pytest.skip(f"{path.parent}: the file system refuses O_DIRECT")
    for name in plain.keys():
        rows = plain.shape(name)[0] if plain.shape(name) else 0
        for span in [None, (0, 1), (1, max(2, rows - 1)), (rows // 2, rows)]:
            assert torch.equal(direct.read(name, span), plain.read(name, span)), (name, span)


def test_a_refused_direct_read_falls_back_to_plain_reads_without_closing_under_other_threads(store, monkeypatch):
    path = next((store.path / "deltas").iterdir())
    plain, direct = SafetensorsFile(path), SafetensorsFile(path, direct=True)
    if not direct.direct:
        pytest.skip(f"{path.parent}: the file system refuses O_DIRECT")
    descriptor = direct._direct_fd

    def refused(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(direct, "_read_direct", refused)
    name = plain.keys()[0]
    assert torch.equal(direct.read(name), plain.read(name))
    assert not direct.direct
    os.fstat(descriptor)  # still open: a thread reading through it is not left with a number reused elsewhere
    direct.close()
    with pytest.raises(OSError):
        os.fstat(descriptor)


def test_fit_reads_the_same_values_either_way(store):
    """Direct reads go by blocks of `chunk_elements` values; through the page cache the kernels read the float32
    files themselves, in pieces of their own size (relex.fit.passes), so the float32 sums within a piece group the
    products differently: equal to float32 rounding, not to the bit."""
    direct = fit_store(store, FitConfig(io="direct", chunk_elements=300))
    cached = fit_store(store, FitConfig(io="cached", chunk_elements=300))
    for name in store.trajectory_names:
        np.testing.assert_allclose(direct.grams[name], cached.grams[name], rtol=2e-6, atol=0)


@pytest.mark.parametrize("direct", [True, False])
def test_direct_reads_keep_two_readers_in_flight(store, monkeypatch, direct):
    """Direct reads have no kernel read-ahead: a stream of them gets DIRECT_READERS threads even where the machine
    is small enough for one reader through the page cache; the blocks are the same either way."""
    monkeypatch.setattr(relex.store, "STREAM_READERS", 1)
    reader = store.reader(direct=direct)
    names = store.trajectory_names
    blocks = [Block(name, rows) for name in names for rows in reader.row_blocks(name, 300)]
    counts, got = [], []
    for _, matrix, _ in reader.stream(blocks):
        counts.append(sum(t.name == "relex-reader" for t in threading.enumerate()))
        got.append(matrix.clone())
    assert max(counts) == (relex.store.DIRECT_READERS if direct else 1)
    plain = store.reader()
    for block, matrix in zip(blocks, got):
        assert torch.equal(matrix, plain.read(block.name, block.rows))


def test_auto_reads_direct_only_when_the_store_exceeds_available_memory(store, monkeypatch):
    size = store.data_bytes()
    assert size == sum(f.stat().st_size for f in (store.path / "deltas").iterdir())
    monkeypatch.setattr(relex.store, "memory_available", lambda: size - 1)
    assert store.reads_direct("auto")
    monkeypatch.setattr(relex.store, "memory_available", lambda: size * 10)
    assert not store.reads_direct("auto")
    monkeypatch.setattr(relex.store, "memory_available", lambda: None)
    assert not store.reads_direct("auto")
    assert store.reads_direct("direct") and not store.reads_direct("cached")
    with pytest.raises(RelexError, match="valid: auto, direct, cached"):
        store.reads_direct("mmap")


def test_cli_io_option(store, tmp_path, capsys):
    assert cli("fit", store.path, "--io", "direct", "--out", tmp_path / "fit") == 0
    assert cli("fit", store.path, "--io", "mmap", "--out", tmp_path / "fit2") == 2
    err = capsys.readouterr().err.strip()
    assert "fit.io 'mmap': unknown I/O mode; valid: auto, direct, cached" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "fit2").exists()


# ---- writes -----------------------------------------------------------------------------------------------------
LAYOUT = [(f"t{i}", TensorInfo(shape, torch.float32 if i % 2 else torch.bfloat16))
          for i, shape in enumerate([(1,), (1000,), (3, 7), (5000,), (17,), (2, 2048)])]


def write_file(path, direct: bool) -> StreamingSafetensorsWriter:
    writer = StreamingSafetensorsWriter(path, LAYOUT, direct=direct)
    generator = torch.Generator().manual_seed(0)
    for name, info in LAYOUT:
        values = torch.randn(info.shape, generator=generator).to(info.dtype)
        if len(info.shape) == 2:  # in row chunks, as a pass writes them
            writer.write(name, values[:1])
            writer.write(name, values[1:])
        else:
            writer.write(name, values)
    writer.close()
    return writer


@pytest.mark.parametrize("stage", [DIRECT_ALIGN, 2 * DIRECT_ALIGN, stream_writer.DIRECT_STAGE])
def test_direct_writes_equal_plain_writes(tmp_path, monkeypatch, stage):
    """Through a staging buffer of whole blocks, across its boundaries, the last block padded and cut off again."""
    monkeypatch.setattr(stream_writer, "DIRECT_STAGE", stage)
    plain, direct = tmp_path / "plain.safetensors", tmp_path / "direct.safetensors"
    assert not write_file(plain, direct=False).direct
    if not write_file(direct, direct=True).direct:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    assert direct.stat().st_size % DIRECT_ALIGN  # the last block was a partial one
    assert direct.read_bytes() == plain.read_bytes()
    loaded = load_file(direct)
    assert [loaded[name].shape for name, _ in LAYOUT] == [torch.Size(info.shape) for _, info in LAYOUT]


def test_a_file_system_that_refuses_direct_writes_gets_plain_ones(tmp_path, monkeypatch):
    plain = tmp_path / "plain.safetensors"
    write_file(plain, direct=False)
    real_open = os.open

    def no_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    assert not write_file(tmp_path / "at-open.safetensors", direct=True).direct
    assert (tmp_path / "at-open.safetensors").read_bytes() == plain.read_bytes()
    monkeypatch.setattr(os, "open", real_open)

    # taken at open, refused at the first write (some network and FUSE file systems)
    monkeypatch.setattr(stream_writer, "DIRECT_STAGE", DIRECT_ALIGN)
    real_pwrite, refused = os.pwrite, []

    def no_direct_pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", no_direct_pwrite)
    assert not write_file(tmp_path / "at-write.safetensors", direct=True).direct
    if not refused:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT at open")
    assert refused == [0]
    assert (tmp_path / "at-write.safetensors").read_bytes() == plain.read_bytes()


def test_a_failed_direct_write_is_raised_and_the_file_removed(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = StreamingSafetensorsWriter(tmp_path / "full.safetensors", LAYOUT, direct=True)
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):  # plain writes fail at once, direct ones when the stage is full
        for name, info in LAYOUT:
            writer.write(name, torch.zeros(info.shape, dtype=info.dtype))
        writer.close()
    writer.abort()
    assert not (tmp_path / "full.safetensors").exists()


@pytest.fixture
def stage_writes(monkeypatch) -> list[tuple[int, str]]:
    """(offset, thread name) of every full stage a direct file writes, stages one block (DIRECT_ALIGN) long."""
    monkeypatch.setattr(stream_writer, "DIRECT_STAGE", DIRECT_ALIGN)
    seen, real = [], stream_writer._write_all

    def spy(fd, data, offset):
        if len(data) == DIRECT_ALIGN and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append((offset, threading.current_thread().name))
        real(fd, data, offset)

    monkeypatch.setattr(stream_writer, "_write_all", spy)
    return seen


def test_full_stages_after_the_first_are_written_behind(tmp_path, stage_writes):
    """The first block is written by the caller (where a file system refuses O_DIRECT writes, it says so there), the
    later full ones by the write-behind threads, one at a time per file, in order, while the caller fills the other
    stage; the last one, padded, by the caller at close."""
    plain, direct = tmp_path / "plain.safetensors", tmp_path / "direct.safetensors"
    write_file(plain, direct=False)
    if not write_file(direct, direct=True).direct:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    assert direct.read_bytes() == plain.read_bytes()
    offsets = [offset for offset, _ in stage_writes]
    assert offsets == [k * DIRECT_ALIGN for k in range(len(offsets))] and len(offsets) >= 8
    caller, threads = threading.current_thread().name, [name for _, name in stage_writes]
    assert threads[0] == threads[-1] == caller
    assert all(name.startswith("relex-write-behind") for name in threads[1:-1])


def record_closes(monkeypatch, events: list[str]) -> None:
    """From here on, "closed" goes into `events` each time a descriptor is closed."""
    real_close = os.close

    def close(fd):
        events.append("closed")
        real_close(fd)

    monkeypatch.setattr(os, "close", close)


def slow_writes_behind(monkeypatch, events: list[str], seconds: float) -> None:
    """Each stage written behind takes `seconds` longer, and "wrote" goes into `events` when it is written."""
    real = stream_writer._write_all

    def slow(fd, data, offset):
        if threading.current_thread().name.startswith("relex-write-behind"):
            time.sleep(seconds)
            events.append("wrote")
        real(fd, data, offset)

    monkeypatch.setattr(stream_writer, "_write_all", slow)


@pytest.mark.parametrize("failing", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_behind_is_raised_in_the_writer_and_the_file_removed(tmp_path, stage_writes, monkeypatch, failing):
    """A stage written in the background fails: the error reaches the caller at its next write or at close, the
    file is removed, and its descriptor is closed only after the background write has returned."""
    real, calls, events = stream_writer._write_all, [], []

    def third_fails(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            time.sleep(0.05)  # still writing when the caller comes back for the stage
            events.append("failed")
            raise OSError(failing, os.strerror(failing))
        real(fd, data, offset)

    monkeypatch.setattr(stream_writer, "_write_all", third_fails)
    writer = StreamingSafetensorsWriter(tmp_path / "failing.safetensors", LAYOUT, direct=True)
    if not writer.direct:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    record_closes(monkeypatch, events)
    with pytest.raises(OSError, match=os.strerror(failing)):
        for name, info in LAYOUT:
            writer.write(name, torch.zeros(info.shape, dtype=info.dtype))
        writer.close()
    writer.abort()
    assert events[:2] == ["failed", "closed"]
    assert not (tmp_path / "failing.safetensors").exists()


def test_an_abandoned_file_waits_for_its_write_behind_before_closing(tmp_path, stage_writes, monkeypatch):
    events = []
    slow_writes_behind(monkeypatch, events, 0.05)
    writer = StreamingSafetensorsWriter(tmp_path / "abandoned.safetensors", LAYOUT, direct=True)
    if not writer.direct:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    writer.write("t0", torch.zeros(1, dtype=torch.bfloat16))
    writer.write("t1", torch.zeros(1000))  # 4002 bytes and the header: the first stage, written at once
    writer.write("t2", torch.zeros((3, 7), dtype=torch.bfloat16))
    writer.write("t3", torch.zeros(5000))  # the next ones, written behind
    record_closes(monkeypatch, events)
    writer.abort()
    assert events[-1] == "closed" and "wrote" in events[:-1]
    assert not (tmp_path / "abandoned.safetensors").exists()


def test_an_interrupted_wait_for_a_write_behind_still_waits_before_closing(tmp_path, stage_writes, monkeypatch):
    """Ctrl-C while the writer waits for a stage written behind: the write is still in flight, so `abort` waits
    for it before closing the descriptor (whose number a later file could otherwise be given mid-write)."""
    events = []
    slow_writes_behind(monkeypatch, events, 0.1)

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    writer = StreamingSafetensorsWriter(tmp_path / "interrupted.safetensors", LAYOUT, direct=True)
    if not writer.direct:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for name, info in LAYOUT:
            writer.write(name, torch.zeros(info.shape, dtype=info.dtype))
    record_closes(monkeypatch, events)
    writer.abort()
    assert events == ["wrote", "closed"]
    assert not (tmp_path / "interrupted.safetensors").exists()


def test_without_write_behind_threads_the_caller_writes(tmp_path, stage_writes, monkeypatch):
    """At interpreter shutdown no new thread starts (the pool refuses work): the caller writes every stage itself."""
    class ShutDown:
        def submit(self, *args):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    plain = tmp_path / "plain.safetensors"
    write_file(plain, direct=False)
    monkeypatch.setattr(stream_writer, "_behind", ShutDown)
    if not write_file(tmp_path / "direct.safetensors", direct=True).direct:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    assert (tmp_path / "direct.safetensors").read_bytes() == plain.read_bytes()
    assert {name for _, name in stage_writes} == {threading.current_thread().name}


def _write_in_child(path: str) -> None:
    write_file(Path(path), direct=True)


def test_a_forked_child_writes_behind_with_threads_of_its_own(tmp_path, stage_writes):
    """After a fork the parent's write-behind threads do not exist in the child: it starts its own."""
    write_file(tmp_path / "parent.safetensors", direct=True)
    assert stream_writer._behind_pool is not None
    child = multiprocessing.get_context("fork").Process(target=_write_in_child, args=(str(tmp_path / "child.safetensors"),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert (tmp_path / "child.safetensors").read_bytes() == (tmp_path / "parent.safetensors").read_bytes()


def test_a_direct_write_refused_behind_turns_to_plain_writes(tmp_path, stage_writes, monkeypatch):
    """A file system that takes O_DIRECT at open and at the first write, then refuses one (EINVAL) in the
    background: that block, the staged one and the rest are written plainly, and the file is the same."""
    plain = tmp_path / "plain.safetensors"
    write_file(plain, direct=False)
    real, refused = os.pwrite, []

    def refuse_the_fourth(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset == 3 * DIRECT_ALIGN:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_the_fourth)
    writer = write_file(tmp_path / "refused.safetensors", direct=True)
    if not refused:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    assert not writer.direct
    assert (tmp_path / "refused.safetensors").read_bytes() == plain.read_bytes()


@pytest.fixture
def direct_flags(monkeypatch) -> list[bool]:
    """The `direct` argument of every StreamingSafetensorsWriter made from here on, in order."""
    seen = []
    real_init = StreamingSafetensorsWriter.__init__

    def spy(self, *args, direct=False, **kwargs):
        seen.append(direct)
        real_init(self, *args, direct=direct, **kwargs)

    monkeypatch.setattr(StreamingSafetensorsWriter, "__init__", spy)
    return seen


def test_extrapolate_writes_direct_unless_io_is_cached(store, tmp_path, direct_flags):
    """`--io auto` (the default) and `direct` write checkpoints past the page cache, `cached` through it; the files
    are the same either way."""
    seen = direct_flags
    folders = {}
    for io in ("auto", "direct", "cached"):
        seen.clear()
        out = tmp_path / f"out-{io}"
        assert cli("extrapolate", store.path, "--targets", "20", "--io", io, "--out", out) == 0
        assert seen and set(seen) == {io != "cached"}
        folders[io] = sorted(p.relative_to(out) for p in out.rglob("*.safetensors"))
        for path in folders[io]:
            assert (out / path).read_bytes() == (tmp_path / "out-auto" / path).read_bytes(), path
    assert folders["auto"] == folders["direct"] == folders["cached"] != []


def test_ingest_copy_writes_direct_unless_io_is_cached(planted, tmp_path, direct_flags):
    """`relex ingest --copy` writes the deltas past the page cache by default (`--io auto` or `direct`), through it
    with `--io cached`; the stores' files are the same either way, and torch's thread count is as it was."""
    base, run, _ = planted
    seen = direct_flags
    threads = torch.get_num_threads()
    files = {}
    for io in ("auto", "direct", "cached"):
        seen.clear()
        out = tmp_path / f"store-{io}"
        assert cli("ingest", run, "--base", base, "--out", out, "--copy", "--io", io) == 0
        assert torch.get_num_threads() == threads
        assert seen and set(seen) == {io != "cached"}
        files[io] = {p.name: p.read_bytes() for p in (out / "deltas").iterdir()}
    assert files["auto"] == files["direct"] == files["cached"] and len(files["auto"]) == len(TrajectoryStore.open(out).steps)


def test_ingest_refuses_an_unknown_io_mode_before_reading_anything(planted, tmp_path):
    from relex.ingest import ingest

    base, run, _ = planted
    with pytest.raises(RelexError, match="unknown I/O mode 'cahced'; valid: auto, direct, cached"):
        ingest([run], str(base), tmp_path / "store", copy=True, io="cahced")
    assert not (tmp_path / "store").exists()
