"""The trajectory reader's stream: every planned block, in order, with the caller's work on it (a Gram); errors and
early stops are clean."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import relex.fit.gram
from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader, checkpoint_infos
from relex.store import Block, TrajectoryStore
from tests.conftest import STEPS, cli


@pytest.fixture(params=["in place", "copied"])
def store(request, planted, tmp_path):
    base, run, _ = planted
    extra = ["--copy"] if request.param == "copied" else []
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", *extra) == 0
    return TrajectoryStore.open(tmp_path / "store")


def plan(reader, names, max_elements, gram_every=2):
    """Row blocks of `names`, plus each tensor whole; every `gram_every`-th block asks for the caller's work."""
    blocks = [Block(n, rows) for n in names for rows in reader.row_blocks(n, max_elements)] + [Block(n) for n in names]
    return [Block(b.name, b.rows, work=i % gram_every == 0) for i, b in enumerate(blocks)]


def reader_threads() -> int:
    return sum(t.name == "relex-reader" for t in threading.enumerate())


@pytest.mark.parametrize("readers", [1, 2, 3])
@pytest.mark.parametrize("consumer_delay", [0.0, 0.002])
def test_stream_yields_every_planned_block_in_order_with_its_gram(store, readers, consumer_delay):
    reader = store.reader()
    blocks = plan(reader, store.trajectory_names, max_elements=7 * len(store.steps) * 64)  # blocks of a few rows
    sides = []

    def counted_gram(block, matrix):
        sides.append(threading.current_thread().name)
        return relex.fit.gram.chunk_gram(matrix, torch.device("cpu"))

    threads_before = torch.get_num_threads()
    seen = []
    for block, matrix, gram in reader.stream(blocks, readers=readers, work=counted_gram):
        expected = store.reader().read(block.name, block.rows)
        assert torch.equal(matrix, expected), block
        if block.work:
            m = expected.double()
            torch.testing.assert_close(gram, m @ m.T, rtol=1e-5, atol=1e-12)
        else:
            assert gram is None
        seen.append(block)
        time.sleep(consumer_delay)
    assert seen == blocks
    assert len(sides) == sum(b.work for b in blocks)
    if consumer_delay:  # a slow caller leaves the Grams to the readers, which would otherwise wait for buffers
        assert "relex-reader" in sides
    assert reader_threads() == 0
    assert torch.get_num_threads() == threads_before


def test_read_into_fills_a_column_slice_of_a_larger_matrix(store):
    reader = store.reader()
    name = "model.layers.0.mlp.up_proj.weight"
    rows = reader.row_blocks(name, 3 * len(store.steps) * store.tensors[name].shape[1])[1]
    numel = reader.block_numel(name, rows)
    big = torch.full((len(store.steps), numel + 10), -1.0)
    reader.read_into(name, big[:, 5 : 5 + numel], rows)
    assert torch.equal(big[:, 5 : 5 + numel], reader.read(name, rows))
    assert (big[:, :5] == -1).all() and (big[:, 5 + numel :] == -1).all()


def test_a_reading_error_is_raised_at_its_block_and_the_readers_stop(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    bad_name, bad_step = store.trajectory_names[3], STEPS[2]
    path = run / f"checkpoint-{bad_step}" / "model.safetensors"
    tensors = load_file(str(path))
    tensors[bad_name] = tensors[bad_name][:-1].clone()  # the referenced checkpoint changed after ingest
    save_file(tensors, str(path), metadata={"format": "pt"})
    reader = store.reader()
    blocks = [Block(n, work=True) for n in store.trajectory_names]
    threads_before = torch.get_num_threads()
    served = []
    with pytest.raises(RelexError, match=f"tensor {bad_name}: shape .* at step {bad_step}"):
        for block, _, _ in reader.stream(blocks, readers=2, work=lambda block, matrix: matrix.sum()):
            served.append(block.name)
    assert served == store.trajectory_names[:3]
    assert reader_threads() == 0
    assert torch.get_num_threads() == threads_before


def test_stopping_a_stream_early_releases_its_readers(store):
    reader = store.reader()
    blocks = [Block(n) for n in store.trajectory_names] * 20
    threads_before = torch.get_num_threads()
    stream = reader.stream(blocks, readers=2)
    next(stream)
    stream.close()
    assert reader_threads() == 0
    assert torch.get_num_threads() == threads_before


def test_a_checkpoint_reader_closes_its_files_at_the_end_of_a_with_block(tmp_path):
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as reader:
        assert reader.read("w", rows=(1, 2)).tolist() == [[3.0, 4.0, 5.0]]
        assert len(reader._handles) == 1
    assert reader._handles == {}
    assert checkpoint_infos(tmp_path)["w"].shape == (2, 3)


@pytest.mark.parametrize("how", ["step file", "folder"])
def test_a_reader_over_one_file_reads_its_header_once(tmp_path, monkeypatch, how):
    """A store's step file, or a checkpoint folder's one model.safetensors, is opened, and its header read and
    checked, once per reader: for its names and for every read after (a header of a 272-tensor SmolLM2 step took
    ~9 ms to check, twice per step before)."""
    import relex.io.checkpoint as checkpoint

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, str(path))
    opened = []
    real = checkpoint.SafetensorsFile
    monkeypatch.setattr(checkpoint, "SafetensorsFile", lambda path, direct=False: opened.append(path) or real(path, direct))
    with CheckpointReader.from_file(path) if how == "step file" else CheckpointReader(tmp_path) as reader:
        assert reader.names() == ["b", "w"]
        assert reader.read("w", rows=(1, 2)).tolist() == [[3.0, 4.0, 5.0]] and reader.info("b").shape == (3,)
        assert len(opened) == 1
    assert reader._handles == {}
    assert reader.read("b").tolist() == [1.0, 1.0, 1.0] and len(opened) == 2  # opened again after close, as before
    assert checkpoint.weight_files(tmp_path) == {"b": path, "w": path} and len(opened) == 3  # opened and closed


def test_a_reader_works_out_where_a_tensor_lies_once(store, monkeypatch):
    """`tensor_files` is asked when a pass plans and again when it reads: each step's file is looked up once."""
    reader = store.reader()
    name = store.trajectory_names[0]
    looked_up = []
    real = reader._locate
    monkeypatch.setattr(reader, "_locate", lambda n: looked_up.append(n) or real(n))
    first = reader.tensor_files(name)
    assert first is not None and reader.tensor_files(name) is first and looked_up == [name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_read_into_a_given_buffer_is_a_view_of_it_when_the_values_fit(tmp_path, dtype):
    values = torch.randn(6, 5).to(dtype)
    save_file({"w": values, "scalar": torch.tensor(3.0, dtype=dtype)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    nbytes = 3 * 5 * values.element_size()
    buffer = torch.zeros(nbytes + 3, dtype=torch.uint8)
    rows = reader.read("w", (2, 5), buffer)
    assert rows.dtype == dtype and rows.shape == (3, 5) and torch.equal(rows, values[2:5])
    assert rows.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # no new memory
    assert torch.equal(reader.read("scalar", None, buffer), torch.tensor(3.0, dtype=dtype))
    small = reader.read("w", None, buffer)  # 30 values do not fit: new memory, the same values
    assert torch.equal(small, values) and small.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert torch.equal(reader.read("w", (0, 0), buffer), values[:0])


@pytest.mark.parametrize("with_bf16", [False, True])
def test_a_store_mixing_copied_deltas_float32_and_bf16_checkpoints_reads_each_step_as_its_delta(tmp_path, with_bf16):
    """Rows of float32 files are read straight into the block (every step float32), or each step's tensor is
    converted (a bf16 checkpoint among them); θ₀ comes off the referenced rows only, row by row for long rows and
    all at once for short ones (relex.store.SUBTRACT_ROW_BYTES)."""
    from relex.store import SUBTRACT_ROW_BYTES

    long_row = SUBTRACT_ROW_BYTES // 4 + 3  # float32 values per row: subtracted one row at a time
    generator = torch.Generator().manual_seed(0)
    base = {"long": torch.randn(3, long_row, generator=generator), "short": torch.randn(4, 8, generator=generator)}
    (tmp_path / "base").mkdir()
    save_file(base, str(tmp_path / "base" / "model.safetensors"))
    delta = {n: torch.randn(t.shape, generator=generator) * 0.01 for n, t in base.items()}
    theta = {n: t + torch.randn(t.shape, generator=generator) * 0.01 for n, t in base.items()}
    theta_bf16 = {n: (t + torch.randn(t.shape, generator=generator) * 0.01).to(torch.bfloat16) for n, t in base.items()}
    for name, values in (("step-4", theta), ("step-6", theta_bf16)):
        (tmp_path / name).mkdir()
        save_file(values, str(tmp_path / name / "model.safetensors"))
    store = TrajectoryStore.create(tmp_path / "store", base_dir=tmp_path / "base", tensors=checkpoint_infos(tmp_path / "base"))
    store.append_deltas(2, lambda name: delta[name])
    store.append_checkpoint(4, tmp_path / "step-4", torch.float32)
    if with_bf16:
        store.append_checkpoint(6, tmp_path / "step-6", torch.bfloat16)
    reader = TrajectoryStore.open(tmp_path / "store").reader()
    for name in base:
        for rows in (None, (1, 3)):
            part = slice(None) if rows is None else slice(*rows)
            want = torch.stack([
                delta[name][part].reshape(-1),
                (theta[name][part] - base[name][part]).reshape(-1),
                (theta_bf16[name][part].float() - base[name][part]).reshape(-1),
            ][: 3 if with_bf16 else 2])
            assert torch.equal(reader.read(name, rows), want), (name, rows)


def test_a_store_of_float32_checkpoints_only_subtracts_theta0_from_every_row(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    assert {entry.kind for entry in store.entries} == {"checkpoint"}
    reader = store.reader()
    base = CheckpointReader(store.base_dir)
    for name in store.trajectory_names:  # short rows (norms) and long ones alike
        got = reader.read(name)
        for i, entry in enumerate(store.entries):
            theta = CheckpointReader(store.checkpoint_dir(entry)).read(name).float()
            assert torch.equal(got[i], (theta - base.read(name).float()).reshape(-1)), (name, entry.step)


def test_theta0_is_read_into_one_buffer_per_thread_reused_from_block_to_block(planted, tmp_path):
    """θ₀'s rows go into a buffer of the reading thread's, grown to the largest block and then reused: no new memory
    per block, and two threads reading at once do not share one."""
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    reader, names = store.reader(), store.trajectory_names
    theta0 = CheckpointReader(store.base_dir)
    first = {name: reader.read(name) for name in names}
    buffer = reader._local.base
    assert buffer.numel() == max(info.numel * info.dtype.itemsize for info in store.tensors.values())
    for name in names:
        assert torch.equal(reader.read(name, (0, 1)), first[name][:, : reader.block_numel(name, (0, 1))])
        theta = CheckpointReader(store.checkpoint_dir(store.entries[-1])).read(name).float()
        assert torch.equal(first[name][-1], (theta - theta0.read(name).float()).reshape(-1)), name
    assert reader._local.base is buffer

    results, start = {}, threading.Barrier(2)

    def read_all(k: int) -> None:
        start.wait()
        for _ in range(3):
            for name in names:
                results[k, name] = reader.read(name)

    threads = [threading.Thread(target=read_all, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[k, name], first[name]) for k in range(2) for name in names)
