"""verl's unmerged FSDP checkpoints (`global_step_N/actor/model_world_size_W_rank_R.pt`), ingested without a merge.

The shards are written here as verl writes them: FSDP2 (`fully_shard`) on 2 CPU ranks under torchrun (gloo), each
rank `torch.save`-ing its `state_dict()` of DTensors. The store made from them must read exactly the values of the
store made from the merged checkpoints; a `.pt` holding anything but tensors is refused in one line.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relex.errors import RelexError
from relex.io.verl_shards import VerlShardReader, open_checkpoint
from relex.store import TrajectoryStore
from relex.synthetic import step_folder, write_planted_run
from tests.conftest import cli, make_base

VERL_STEPS = [3, 7, 12]

# torchrun script: each rank shards the merged checkpoint of every step with FSDP2 and saves its state dict
SHARD = '''
import shutil, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
merged_run, sharded_run, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
for step in steps:
    model = LlamaForCausalLM.from_pretrained(merged_run / f"global_step_{step}" / "actor" / "huggingface")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    actor = sharded_run / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), actor / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        shutil.copy(merged_run / f"global_step_{step}" / "actor" / "huggingface" / "config.json", actor / "huggingface")
    dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(base, merged run, the same run as 2-rank FSDP2 shards): a planted verl run at uneven steps."""
    root = tmp_path_factory.mktemp("verl")
    base = make_base(root / "base", tied=False)
    write_planted_run(base, root / "merged", VERL_STEPS, layout="verl", noise=0.02)
    (root / "shard.py").write_text(SHARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(root / "shard.py"),
               str(root / "merged"), str(root / "sharded"), ",".join(map(str, VERL_STEPS))]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return base, root / "merged", root / "sharded"


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


class Payload:
    """What a hostile shard would run when unpickled freely."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


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
