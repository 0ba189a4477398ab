"""Every ingest layout, tied and untied embeddings, sharded and single-file checkpoints, reference and copy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from relex.io.checkpoint import CheckpointReader
from relex.store import TrajectoryStore
from relex.synthetic import step_folder, write_planted_run
from tests.conftest import cli, make_base

STEPS = [3, 5, 8]


def real_delta(base, folder, name):
    return CheckpointReader(folder).read(name).float() - CheckpointReader(base).read(name).float()


@pytest.mark.parametrize("layout", ["hf-trainer", "verl", "verl-flat", "plain"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shards", [1, 3])
def test_layouts(tmp_path, layout, tied, shards):
    base = make_base(tmp_path / "base", tied=tied)
    run = tmp_path / "run"
    write_planted_run(base, run, STEPS, layout="verl" if layout == "verl-flat" else layout, shards=shards)
    if layout == "verl-flat":  # global_step_N/huggingface/ instead of global_step_N/actor/huggingface/
        for step in STEPS:
            (run / f"global_step_{step}" / "actor" / "huggingface").rename(run / f"global_step_{step}" / "huggingface")
            (run / f"global_step_{step}" / "actor").rmdir()
    args = ["ingest", base, "--out", tmp_path / "store"]
    if layout == "plain":
        args = ["ingest", *[step_folder(run, s, "plain") for s in STEPS], "--steps", ",".join(map(str, STEPS)), "--base", base, "--out", tmp_path / "store"]
    else:
        args = ["ingest", run, "--base", base, "--out", tmp_path / "store"]
    assert cli(*args) == 0
    store = TrajectoryStore.open(tmp_path / "store")
    assert store.steps == STEPS
    assert all(e.kind == "checkpoint" for e in store.entries)
    name = "model.layers.0.self_attn.q_proj.weight"
    reader = store.reader()
    folder = store.checkpoint_dir(store.entries[1])
    torch.testing.assert_close(reader.read(name)[1], real_delta(base, folder, name).reshape(-1))
    assert cli("extrapolate", tmp_path / "store", "--targets", "12", "--out", tmp_path / "out") == 0
    assert (tmp_path / "out" / "step-12" / "config.json").is_file()


def test_alias_in_file_is_tied_once_and_stays_tied(tmp_path):
    base = make_base(tmp_path / "base", alias_in_file=True)
    write_planted_run(base, tmp_path / "run", STEPS)
    assert cli("ingest", tmp_path / "run", "--base", base, "--out", tmp_path / "store") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    assert len(store.tied) == 1
    (alias, canonical), = store.tied.items()
    assert {alias, canonical} == {"lm_head.weight", "model.embed_tokens.weight"}
    assert alias not in store.trajectory_names and canonical in store.trajectory_names
    assert cli("extrapolate", tmp_path / "store", "--targets", "20", "--out", tmp_path / "out") == 0
    out = load_file(str(tmp_path / "out" / "step-20" / "model.safetensors"))
    assert torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])
    assert not torch.equal(out["lm_head.weight"], load_file(str(base / "model.safetensors"))["lm_head.weight"])


@pytest.mark.parametrize("alias_in_file", [False, True])
def test_the_model_is_built_for_ties_only_where_two_stored_tensors_are_equal(tmp_path, monkeypatch, alias_in_file):
    import transformers

    built = []
    from_config = transformers.AutoModelForCausalLM.from_config
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda *a, **k: built.append(1) or from_config(*a, **k))
    base = make_base(tmp_path / "base", alias_in_file=alias_in_file)
    write_planted_run(base, tmp_path / "run", STEPS)
    assert cli("ingest", tmp_path / "run", "--base", base, "--out", tmp_path / "store") == 0
    assert len(built) == int(alias_in_file)  # without the stored alias no two tensors are equal after training
    assert len(TrajectoryStore.open(tmp_path / "store").tied) == int(alias_in_file)


def test_tied_tensors_are_read_whole_once_per_checkpoint(tmp_path, monkeypatch):
    """The tie check reads both tied tensors whole once in the base and in every checkpoint: the last checkpoint's
    comparison, made to find the ties, is not repeated when every checkpoint's ties are checked."""
    from collections import Counter

    original, whole = CheckpointReader.read, Counter()

    def counted(self, name, rows=None):
        if rows is None and name in ("lm_head.weight", "model.embed_tokens.weight"):
            whole[self.folder, name] += 1
        return original(self, name, rows)

    base = make_base(tmp_path / "base", alias_in_file=True)
    write_planted_run(base, tmp_path / "run", STEPS)
    monkeypatch.setattr(CheckpointReader, "read", counted)
    assert cli("ingest", tmp_path / "run", "--base", base, "--out", tmp_path / "store") == 0
    assert len(TrajectoryStore.open(tmp_path / "store").tied) == 1
    assert len(whole) == 2 * (len(STEPS) + 1), whole  # both names, in the base and each checkpoint
    assert set(whole.values()) == {1}, whole


def test_equal_tensors_are_equal_in_every_reader(tmp_path):
    from safetensors.torch import save_file

    from relex.ingest import equal_tensors

    torch.manual_seed(0)
    a = torch.randn(4, 3)
    first_row_only = a.clone()
    first_row_only[3, 2] += 1
    values = {"a": a, "b": a.clone(), "c": first_row_only, "d": torch.randn(4, 3), "e": a.clone(), "v": torch.ones(3),
              "w": torch.ones(3), "h": a.half(), "i": a.half()}
    later = {**values, "e": a + 1, "w": torch.full((3,), 2.0)}  # e and w part from the others in the second checkpoint
    readers = []
    for folder, tensors in (("one", values), ("two", later)):
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
        readers.append(CheckpointReader(tmp_path / folder))
    infos = readers[0].infos()
    assert sorted(map(sorted, equal_tensors(readers[:1], infos))) == [["a", "b", "e"], ["h", "i"], ["v", "w"]]
    assert sorted(map(sorted, equal_tensors(readers, infos))) == [["a", "b"], ["h", "i"]]
    assert equal_tensors(readers, {n: i for n, i in infos.items() if n in "cdew"}) == []


def test_copy_is_lossless_and_bf16_records_its_error(tmp_path):
    base = make_base(tmp_path / "base", dtype=torch.bfloat16)
    run = tmp_path / "run"
    write_planted_run(base, run, STEPS)
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "ref") == 0
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "copy", "--copy") == 0
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "q", "--copy", "--delta-dtype", "bf16") == 0
    ref, copy, quant = (TrajectoryStore.open(tmp_path / n) for n in ("ref", "copy", "q"))
    assert all(e.kind == "delta" and e.dtype == "float32" and e.source_dtype == "bfloat16" for e in copy.entries)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ref.reader().read(name), copy.reader().read(name))  # bf16 − bf16 is exact in float32
    errors = [e.quantization_error for e in quant.entries]
    assert all(e is not None and 0 <= e < 0.01 for e in errors)
    rel = (quant.reader().read(name) - copy.reader().read(name)).norm() / copy.reader().read(name).norm()
    assert float(rel) < 0.01
    # the source may now be deleted: the copied store does not read it
    for folder in run.iterdir():
        for file in folder.glob("*.safetensors"):
            file.unlink()
    assert cli("extrapolate", tmp_path / "copy", "--targets", "12", "--out", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "step-12" / "config.json").read_text())["dtype"] == "bfloat16"


def test_optimizer_state_and_other_files_are_ignored(planted, tmp_path):
    base, run, _ = planted
    (run / "checkpoint-2" / "scheduler.pt").write_bytes(b"\x80\x04 pickle that must never be loaded")
    (run / "checkpoint-2" / "rng_state.pth").write_bytes(b"\x80\x04 pickle")
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
