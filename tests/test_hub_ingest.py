"""`relex ingest hf://ORG/REPO --revisions ...` against a hub cache built here in huggingface_hub's own layout, offline.

    CACHE/models--ORG--REPO/blobs/<sha256>                    file contents
    CACHE/models--ORG--REPO/snapshots/<commit>/<file>         links to the blobs
    CACHE/models--ORG--REPO/refs/<branch>                     the commit a branch points to
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relex.errors import RelexError
from relex.io.hub import expand_revisions, revision_step
from relex.store import TrajectoryStore
from relex.synthetic import step_folder, write_planted_run
from tests.conftest import cli

HUB_STEPS = [2, 4, 6, 8]


def add_revision(cache: Path, repo_id: str, branch: str, folder: Path) -> Path:
    """Put `folder`'s files into the cache as the commit that `branch` points to; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_base, monkeypatch):
    """A cache holding org/run at branches step_2 … step_8 (a planted run), with the hub switched off."""
    import huggingface_hub.constants

    run = tmp_path / "run"
    write_planted_run(tiny_base, run, HUB_STEPS, layout="plain", noise=0.02)
    cache = tmp_path / "cache"
    for step in HUB_STEPS:
        add_revision(cache, "org/run", f"step_{step}", step_folder(run, step, "plain"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return tiny_base, run, cache


def test_revisions_expand_like_a_shell():
    assert expand_revisions("step_{1..3}") == ["step_1", "step_2", "step_3"]
    assert expand_revisions("step_{0..100..50}") == ["step_0", "step_50", "step_100"]
    assert expand_revisions("main, step_{1..2}") == ["main", "step_1", "step_2"]
    assert [revision_step(r) for r in ("step_75", "global_step_75", "checkpoint-75")] == ["75", "75", "75"]
    for bad in ("step_{3..1}", "step_{1..}", "step_1,step_1", ","):
        with pytest.raises(RelexError):
            expand_revisions(bad)
    with pytest.raises(RelexError, match="--steps"):
        revision_step("main")


def test_hub_revisions_ingest_like_the_local_folders(hub_cache, tmp_path):
    base, run, cache = hub_cache
    assert cli("ingest", "hf://org/run", "--revisions", "step_{2..8..2}", "--base", base, "--out", tmp_path / "hub") == 0
    local = [step_folder(run, s, "plain") for s in HUB_STEPS]
    assert cli("ingest", *local, "--steps", ",".join(map(str, HUB_STEPS)), "--base", base, "--out", tmp_path / "local") == 0
    store = TrajectoryStore.open(tmp_path / "hub")
    assert store.steps == HUB_STEPS
    snapshots = {store.checkpoint_dir(e).resolve().parent for e in store.entries}
    assert snapshots == {(cache / "models--org--run" / "snapshots").resolve()}  # read in place, not copied
    assert store.manifest["created_by"]["layout"] == ["hub"]
    for name in ("hub", "local"):
        assert cli("fit", tmp_path / name, "--out", tmp_path / f"fit-{name}") == 0
    for file in ("gram.safetensors", "diagnostics.csv"):
        assert (tmp_path / "fit-hub" / file).read_bytes() == (tmp_path / "fit-local" / file).read_bytes()


def test_steps_by_hand_for_revisions_without_numbers(hub_cache, tmp_path, capsys):
    base, run, cache = hub_cache
    add_revision(cache, "org/run", "main", step_folder(run, 8, "plain"))
    assert cli("ingest", "hf://org/run", "--revisions", "main", "--base", base, "--out", tmp_path / "a") == 2
    assert "revision 'main': its name ends in no step number; give the steps" in capsys.readouterr().err
    assert cli("ingest", "hf://org/run@main", "--steps", "8", "--base", base, "--out", tmp_path / "b") == 0
    assert TrajectoryStore.open(tmp_path / "b").steps == [8]


def test_base_from_the_hub_cache(hub_cache, tmp_path):
    base, run, cache = hub_cache
    add_revision(cache, "org/base", "main", base)
    out = tmp_path / "store"
    assert cli("ingest", "hf://org/run", "--revisions", "step_2,step_4", "--base", "hf://org/base", "--out", out) == 0
    assert TrajectoryStore.open(out).base_dir.resolve().parent.name == "snapshots"


def test_offline_without_the_revision_fails_in_one_line(hub_cache, tmp_path):
    base, run, cache = hub_cache
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "TQDM_DISABLE": "1"}
    out = tmp_path / "store"
    command = [sys.executable, "-m", "relex", "ingest", "hf://org/run", "--revisions", "step_{2..10..2}", "--base", str(base), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert lines == [
        f"relex ingest: error: hf://org/run@step_10: not in the hub cache {cache} and HF_HUB_OFFLINE=1 forbids "
        "downloading it; fetch it once with the network (unset HF_HUB_OFFLINE), or point HF_HUB_CACHE at a cache that holds it"
    ]
    assert not out.exists()
    assert sorted(p.name for p in (cache / "models--org--run" / "refs").iterdir()) == [f"step_{s}" for s in HUB_STEPS]
