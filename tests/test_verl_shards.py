"""verl's unmerged FSDP checkpoints (`global_step_N/actor/model_world_size_W_rank_R.pt`), ingested without a merge.

The shards are written here as verl writes them: FSDP2 (`fully_shard`) on 2 CPU ranks under torchrun (gloo), each
rank `torch.save`-ing its `state_dict()` of DTensors. The store made from them must read exactly the values of the
store made from the merged checkpoints; a `.pt` holding anything but tensors is refused in one line.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from relex.errors import RelexError
from relex.io.verl_shards import VerlShardReader, open_checkpoint
from relex.store import TrajectoryStore
from relex.synthetic import step_folder, write_planted_run, write_sharded_run
from tests.conftest import Payload, cli, make_base

VERL_STEPS = [3, 7, 12]


def shard_run(root: Path, *, tied: bool) -> tuple[Path, Path, Path]:
    """(base, merged run, the same run as 2-rank FSDP2 shards) under `root`: a planted verl run at uneven steps."""
    base = make_base(root / "base", tied=tied)
    write_planted_run(base, root / "merged", VERL_STEPS, layout="verl", noise=0.02)
    write_sharded_run(root / "merged", root / "sharded", VERL_STEPS)
    return base, root / "merged", root / "sharded"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A model whose output layer is its own tensor."""
    return shard_run(tmp_path_factory.mktemp("verl"), tied=False)


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    """A model whose output layer is its embedding (tie_word_embeddings, as SmolLM2, Qwen2.5 up to 3B, Llama 3.2)."""
    return shard_run(tmp_path_factory.mktemp("verl-tied"), tied=True)


def test_shards_read_as_the_merged_checkpoint(runs):
    base, merged, sharded = runs
    folder = sharded / "global_step_7" / "actor"
    reader, expected = open_checkpoint(folder), open_checkpoint(step_folder(merged, 7, "verl"))
    assert isinstance(reader, VerlShardReader)
    assert reader.names() == expected.names()
    for name in expected.names():
        assert reader.info(name) == expected.info(name)
        assert torch.equal(reader.read(name), expected.read(name)), name
    rows = reader.read("model.embed_tokens.weight", (40, 60))  # rows 40..59 span both ranks' halves (48 rows each)
    assert torch.equal(rows, expected.read("model.embed_tokens.weight", (40, 60)))
    assert reader._states is None  # every read came from the places the records name, none through torch.load


def test_an_fsdp2_shards_records_say_what_torch_load_builds(runs):
    """Each DTensor FSDP2 saved, taken apart by relex.io.torch_save: the whole's shape and dtype, its placement, and
    the rank's local part (shape, strides, offset in its storage) as torch.load builds them."""
    import torch.distributed.tensor  # noqa: F401 - lets torch.load build DTensors

    from relex.io.torch_save import DTensorRecord, read_records

    _, _, sharded = runs
    path = sharded / "global_step_7" / "actor" / "model_world_size_2_rank_1.pt"
    records, places = read_records(path)
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert set(records) == set(loaded)
    for name, value in loaded.items():
        record, local = records[name], value.to_local()
        assert isinstance(record, DTensorRecord), name
        assert (record.shape, record.dtype) == (tuple(value.shape), value.dtype), name
        assert record.placements == tuple((type(p).__name__, {"dim": p.dim}) for p in value.placements), name
        assert (record.local.shape, record.local.stride, record.local.storage_offset) == \
            (tuple(local.shape), local.stride(), local.storage_offset()), name
        assert places[record.local.storage.key][1] == local.untyped_storage().nbytes(), name


def test_ingested_shards_equal_the_merged_run(runs, tmp_path):
    base, merged, sharded = runs
    assert cli("ingest", sharded, "--base", base, "--out", tmp_path / "from-shards") == 0
    assert cli("ingest", merged, "--base", base, "--out", tmp_path / "from-merged") == 0
    shards, folders = (TrajectoryStore.open(tmp_path / n) for n in ("from-shards", "from-merged"))
    assert shards.steps == folders.steps == VERL_STEPS
    assert all(e.kind == "checkpoint" for e in shards.entries)  # referenced in place: no second copy
    assert list(shards.checkpoint_dir(shards.entries[0]).glob("*.pt"))
    assert cli("ingest", sharded, "--base", base, "--out", tmp_path / "copied-shards", "--copy") == 0
    copied = TrajectoryStore.open(tmp_path / "copied-shards")
    one, two, three = shards.reader(), folders.reader(), copied.reader()
    for name in folders.trajectory_names:
        assert torch.equal(one.read(name), two.read(name)), name
        assert torch.equal(three.read(name), two.read(name)), name
    for name in ("from-shards", "from-merged"):
        assert cli("fit", tmp_path / name, "--out", tmp_path / f"fit-{name}") == 0
    assert (tmp_path / "fit-from-shards" / "gram.safetensors").read_bytes() == (tmp_path / "fit-from-merged" / "gram.safetensors").read_bytes()


@pytest.mark.parametrize("extra, message", [
    (lambda marker: {"note": "hello"}, "holds a str under 'note'; relex reads only tensors"),
    (lambda marker: {"optimizer": Payload(marker)}, "holds a pickled posix.system; relex reads only tensors"),
])
def test_a_shard_holding_another_object_is_refused_in_one_line(runs, tmp_path, capsys, extra, message):
    base, merged, sharded = runs
    run = tmp_path / "run"
    shutil.copytree(sharded, run)
    marker = tmp_path / "ran"
    actor = run / "global_step_7" / "actor"
    shard = actor / "model_world_size_2_rank_1.pt"
    state = {"model.norm.weight": torch.ones(32), **extra(marker)}
    with open(shard, "wb") as handle:
        torch.save(state, handle, pickle_module=pickle)
    with pytest.raises(RelexError, match="relex reads only tensors"):
        VerlShardReader(actor).names()
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"relex ingest: error: {shard}: {message}"]
    assert not marker.exists() and not (tmp_path / "store").exists()


def test_missing_rank_is_named(runs, tmp_path):
    base, merged, sharded = runs
    actor = tmp_path / "actor"
    shutil.copytree(sharded / "global_step_3" / "actor", actor)
    (actor / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(RelexError, match=r"model_world_size_2_rank_R.pt for R = \[1\] missing"):
        VerlShardReader(actor)


def test_a_tied_models_shards_ingest_as_its_merged_run(tied_runs, tmp_path):
    """A tied model's state dict holds its embedding under both names, so its shards do too, as one storage; the base
    and a merged checkpoint (`save_pretrained`) hold one name. The other name is the same values, not a tensor
    missing from the base: ingest reads the base's name, and the store equals the merged run's."""
    base, merged, sharded = tied_runs
    reader = open_checkpoint(sharded / "global_step_7" / "actor")
    assert reader.shared() == [{"lm_head.weight", "model.embed_tokens.weight"}]
    assert "lm_head.weight" not in open_checkpoint(base).names()
    assert open_checkpoint(step_folder(merged, 7, "verl")).shared() == []
    assert cli("ingest", sharded, "--base", base, "--out", tmp_path / "from-shards") == 0
    assert cli("ingest", merged, "--base", base, "--out", tmp_path / "from-merged") == 0
    shards, folders = (TrajectoryStore.open(tmp_path / n) for n in ("from-shards", "from-merged"))
    assert shards.trajectory_names == folders.trajectory_names and "lm_head.weight" not in shards.trajectory_names
    one, two = shards.reader(), folders.reader()
    for name in folders.trajectory_names:
        assert torch.equal(one.read(name), two.read(name)), name


def test_a_weight_the_base_lacks_is_still_refused_when_it_shares_nothing(tied_runs, tmp_path, capsys):
    """Shards whose output layer is its own memory (a model untied in training, or another model) hold a tensor the
    tied base does not have: refused in one line, as before."""
    base, _, sharded = tied_runs
    actor = tmp_path / "actor"
    shutil.copytree(sharded / "global_step_3" / "actor", actor)
    whole = VerlShardReader(actor)
    state = {name: whole.read(name) for name in whole.names()}  # each its own memory
    for rank in range(2):  # plain tensors, the whole of each on every rank (as Replicate() places them)
        torch.save(state, actor / f"model_world_size_2_rank_{rank}.pt")
    assert VerlShardReader(actor).shared() == []
    assert cli("ingest", actor, "--steps", "3", "--base", base, "--out", tmp_path / "store") == 2
    assert capsys.readouterr().err.strip().endswith("tensor lm_head.weight is not in the base checkpoint")


def test_the_kernels_read_the_shards_in_place_and_name_one_cut_short(runs, tmp_path):
    """Each rank's part of a tensor split along its rows is one segment of its row for the reading kernels (the
    shards' own bytes, read at their offsets in the `.pt` files), so a pass over shards reads as one over merged
    safetensors does (the Grams are the same bits: test_ingested_shards_equal_the_merged_run); a shard cut short
    after the pass opened it fails in one line naming that file."""
    from relex.fit.gram import file_gram
    from relex.fit.passes import plan_pass

    base, merged, sharded = runs
    assert cli("ingest", sharded, "--base", base, "--out", tmp_path / "store") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    reader, names = store.reader(), store.trajectory_names
    assert all(t.in_kernel for t in plan_pass(reader, names, grams=names, sums=names).tensors)
    name = "model.layers.1.mlp.up_proj.weight"
    files = reader.tensor_files(name)
    assert files.descriptors.shape == (len(VERL_STEPS), 2)  # two ranks: two segments a step
    merged_store = tmp_path / "merged"
    assert cli("ingest", merged, "--base", base, "--out", merged_store) == 0
    expected = TrajectoryStore.open(merged_store).reader()
    assert np.array_equal(file_gram(files), file_gram(expected.tensor_files(name)))
    shard = sharded / f"global_step_{VERL_STEPS[1]}" / "actor" / "model_world_size_2_rank_1.pt"
    copy = tmp_path / "kept.pt"
    shutil.copy(shard, copy)
    try:
        os.truncate(shard, files.offsets[1, 1] + 8)  # rank 1's part of step 7 keeps 2 values
        with pytest.raises(RelexError, match="short read of tensor model.layers.1.mlp.up_proj.weight") as error:
            file_gram(files)
        named = str(error.value).split(": ")[0]
        assert Path(named).resolve() == shard.resolve() and "\n" not in str(error.value)
    finally:
        shutil.copy(copy, shard)


def test_a_parts_segment_starts_where_its_values_do_in_the_file(tmp_path):
    """A part that is a view into a larger storage (`torch.save` writes the whole storage) starts at its own first
    value; a part that is not contiguous has no segment (read in blocks)."""
    actor = tmp_path / "actor"
    actor.mkdir()
    big = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    torch.save({"rows": big[2:5], "columns": big[:, 1:], "other": torch.ones(3)}, actor / "model_world_size_1_rank_0.pt")
    reader = VerlShardReader(actor)
    [(file, offset, values)] = reader.segments("rows")
    assert values == 15 and os.pread(file.descriptor, 4 * values, offset) == big[2:5].numpy().tobytes()
    assert reader.segments("columns") is None
    [(_, offset, _)] = reader.segments("other")
    assert os.pread(file.descriptor, 12, offset) == torch.ones(3).numpy().tobytes()
    reader.close()
    assert file.descriptor == -1
