"""relex.io.torch_save: a `torch.save` file taken apart into records without building a tensor.

Each record must say what `torch.load` builds (dtype, shape, strides, storage offset, a DTensor's shape and
placements), its place must hold those values byte for byte, and no global outside torch's tensors is ever called:
a hostile one is refused by name, an unknown torch one handed back to torch.load (`Unknown`)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from relex.errors import RelexError
from relex.io.torch_save import DTensorRecord, Refused, TensorRecord, Unknown, read_records
from relex.io.verl_shards import VerlShardReader
from tests.conftest import Payload


def saved(tmp_path: Path, state, name: str = "state.pt", **kwargs) -> Path:
    path = tmp_path / name
    torch.save(state, path, **kwargs)
    return path


def values_at(path: Path, record: TensorRecord, places) -> bytes:
    offset, _ = places[record.storage.key]
    size = record.dtype.itemsize
    with open(path, "rb") as handle:
        handle.seek(offset + record.storage_offset * size)
        return handle.read(record.numel * size)


def test_records_say_what_torch_load_builds(tmp_path):
    big = torch.arange(60, dtype=torch.float32).reshape(12, 5)
    state = {
        "float32": torch.randn(4, 3),
        "bf16": torch.randn(7, 2).to(torch.bfloat16),
        "fp16": torch.randn(5).to(torch.float16),
        "int64": torch.arange(6),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "rows": big[2:5],  # a view: torch.save writes the whole storage, the record starts at row 2
        "columns": big[:, 1:],  # not contiguous
        "transposed": big.T,
        "parameter": torch.nn.Parameter(torch.ones(2, 2)),
    }
    state["tied"] = state["float32"]  # one storage under two names
    path = saved(tmp_path, state)
    records, places = read_records(path)
    loaded = torch.load(path, weights_only=True)
    assert set(records) == set(loaded)
    for name, tensor in loaded.items():
        record = records[name]
        assert isinstance(record, TensorRecord), name
        assert (record.dtype, record.shape, record.stride, record.storage_offset) == \
            (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()), name
        assert record.is_contiguous() == tensor.is_contiguous(), name
        if tensor.is_contiguous():
            assert values_at(path, record, places) == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), name
    assert records["tied"].storage == records["float32"].storage
    assert records["rows"].storage == records["columns"].storage and records["rows"].storage_offset == 10


def test_a_dtensors_record_holds_its_shape_placements_and_local_part(tmp_path):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        mesh = DeviceMesh("cpu", [0])
        whole = torch.randn(6, 4)
        state = {"sharded": DTensor.from_local(whole, mesh, [Shard(0)]), "replicated": DTensor.from_local(whole[0], mesh, [Replicate()])}
        path = saved(tmp_path, state)
    finally:
        torch.distributed.destroy_process_group()
    records, places = read_records(path)
    sharded, replicated = records["sharded"], records["replicated"]
    assert isinstance(sharded, DTensorRecord) and isinstance(replicated, DTensorRecord)
    assert (sharded.shape, sharded.dtype, sharded.placements) == ((6, 4), torch.float32, (("Shard", {"dim": 0}),))
    assert replicated.shape == (4,) and replicated.placements == (("Replicate", {}),)
    assert values_at(path, sharded.local, places) == whole.numpy().tobytes()


@pytest.mark.parametrize("hostile", [
    lambda marker: Payload(marker),
    lambda marker: {"x": torch.ones(2), "config": Path("/etc")},
])
def test_a_global_outside_torch_is_refused_by_name_and_never_called(tmp_path, hostile):
    marker = tmp_path / "ran"
    path = saved(tmp_path, {"x": torch.ones(2), "extra": hostile(marker)})
    with pytest.raises(Refused) as refused:
        read_records(path)
    assert refused.value.what in {"posix.system", "pathlib.PosixPath"}
    assert not marker.exists()


def test_what_the_records_do_not_know_goes_back_to_torch_load(tmp_path):
    """A torch global this reader has no record for (a module pickled beside the tensors, a tensor carrying a Python
    attribute, pickled as a `torch.Tensor` subclass rebuild) is Unknown; a shard folder holding one is then loaded
    by torch.load, which reads the tensor and refuses the module."""
    module = saved(tmp_path, {"layer": torch.nn.Linear(2, 2)}, "module.pt")
    with pytest.raises(Unknown, match="torch.nn"):
        read_records(module)
    actor = tmp_path / "actor"
    actor.mkdir()
    state = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16)}
    state["w"].note = "an attribute torch.save keeps"
    saved(actor, state, "model_world_size_1_rank_0.pt")
    with pytest.raises(Unknown, match="torch.Tensor"):
        read_records(actor / "model_world_size_1_rank_0.pt")
    reader = VerlShardReader(actor)
    assert reader.names() == ["b", "w"] and reader.segments("w") is None  # read through torch, not at a place
    assert torch.equal(reader.read("w"), state["w"]) and torch.equal(reader.read("b", (1, 3)), state["b"][1:3])
    os.replace(module, actor / "model_world_size_1_rank_0.pt")
    with pytest.raises(RelexError, match="holds a pickled torch.nn.modules.linear.Linear; relex reads only tensors"):
        VerlShardReader(actor).names()


def test_a_storage_record_shorter_than_its_tensor_is_named(tmp_path):
    """A file whose storage record was cut (its zip rewritten with fewer bytes) would read past its values: refused
    in one line naming the file and the tensor, before any read."""
    actor = tmp_path / "actor"
    actor.mkdir()
    path = saved(actor, {"w": torch.randn(8, 4)}, "model_world_size_1_rank_0.pt")
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            archive.writestr(name, data[:64] if name.endswith("/data/0") else data)
    with pytest.raises(RelexError, match=r"model_world_size_1_rank_0.pt: tensor w lies past the end of its storage"):
        VerlShardReader(actor).segments("w")


def test_reads_from_the_places_equal_torch_loads(tmp_path):
    """Blocks a pass reads (rows a..b of a tensor) come from the records' places, as torch.load's tensors hold them."""
    actor = tmp_path / "actor"
    actor.mkdir()
    state = {"w": torch.randn(9, 5), "h": torch.randn(6, 3).to(torch.float16), "v": torch.randn(7)}
    saved(actor, state, "model_world_size_1_rank_0.pt")
    reader = VerlShardReader(actor)
    for name, tensor in state.items():
        assert reader.segments(name) is not None
        assert torch.equal(reader.read(name), tensor)
        assert torch.equal(reader.read(name, (2, 5)), tensor[2:5])
        out = torch.empty(tensor[1:4].numel(), dtype=tensor.dtype)
        reader.read_into(name, out, (1, 4))
        assert torch.equal(out, tensor[1:4].reshape(-1))
    assert reader._states is None  # torch.load was never needed


def test_a_dtensor_on_a_2d_mesh_is_refused_naming_its_placements(tmp_path):
    """HSDP or tensor parallelism places a tensor on a mesh of two dimensions: refused in one line that names the
    placements, before any value is read (merge such checkpoints with verl's model merger)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    actor = tmp_path / "actor"
    actor.mkdir()
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        mesh = DeviceMesh("cpu", [[0]])
        state = {"w": DTensor.from_local(torch.randn(4, 2), mesh, [Shard(0), Replicate()])}
        saved(actor, state, "model_world_size_1_rank_0.pt")
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(RelexError, match=r"tensor w is placed \(Shard\(dim=0\), Replicate\(\)\) on a 2-dimensional device mesh"):
        VerlShardReader(actor).segments("w")
