"""Crash-safe stores: an interrupted ingest is refused by passes and finished by running it again; a store can drop
steps (truncate) and follow a run that moved (--repoint); relex train --resume after a crash between recording a
step and saving its checkpoint, and on a finished run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relex.cli import main
from relex.store import TrajectoryStore
from tests.conftest import STEPS, cli
from tests.test_bad_input import run_fails
from tests.test_locks import holding

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

KILLED_INGEST = textwrap.dedent(
    """
    import os, signal, sys
    from relex import store
    from relex.cli import main

    original = store.TrajectoryStore.append_deltas
    count = []

    def append(self, *args, **kwargs):
        entry = original(self, *args, **kwargs)
        count.append(entry)
        if len(count) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return entry

    store.TrajectoryStore.append_deltas = append
    sys.exit(main(sys.argv[1:]))
    """
)


def test_killed_ingest_is_refused_then_finished_by_the_same_command(planted, tmp_path, capsys, caplog):
    base, run, _ = planted
    out = tmp_path / "store"
    command = ["ingest", str(run), "--base", str(base), "--out", str(out), "--copy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", KILLED_INGEST, *command], env=env, stderr=subprocess.DEVNULL)
    assert child.returncode == -signal.SIGKILL
    assert not out.exists()
    partial, = [p for p in tmp_path.iterdir() if p.name.startswith(".store.tmp-")]
    store = TrajectoryStore.open(partial)
    assert store.steps == STEPS[:3] and store.pending == STEPS[3:]
    message = run_fails(capsys, "fit", partial, "--out", tmp_path / "fit")
    assert "incomplete store" in message and "again" in message
    with caplog.at_level(logging.WARNING):
        assert cli(*command) == 0
    assert any("continuing" in r.getMessage() for r in caplog.records)
    finished = TrajectoryStore.open(out)
    assert finished.steps == STEPS and finished.pending == []
    assert sorted(p.name for p in (out / "deltas").iterdir()) == [f"step-{s:08d}.safetensors" for s in STEPS]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".store")] == []
    assert cli("fit", out, "--out", tmp_path / "fit") == 0


def test_an_interrupted_ingest_of_another_run_is_not_continued(planted, tmp_path):
    base, run, _ = planted
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    assert cli("ingest", run / "checkpoint-2", "--steps", "2", "--base", base, "--out", tmp_path / "x", "--copy") == 0
    other = tmp_path / f".store.tmp-{pid}-abcdef"
    (tmp_path / "x").rename(other)  # a store of other sources, left under a dead process's temporary name
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", "--copy") == 0
    assert TrajectoryStore.open(tmp_path / "store").steps == STEPS
    assert not other.exists()


def test_truncate_drops_later_steps_and_their_files(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", "--copy") == 0
    store = TrajectoryStore.open(tmp_path / "store")
    assert store.truncate(9) == [13, 20, 30]
    assert TrajectoryStore.open(tmp_path / "store").steps == [2, 4, 6, 9]
    assert sorted(p.name for p in (tmp_path / "store" / "deltas").iterdir()) == [f"step-{s:08d}.safetensors" for s in (2, 4, 6, 9)]
    assert store.truncate(30) == []


# ---- a run that moves -------------------------------------------------------------------------------------------------
def test_a_moved_run_is_named_and_repointed(planted, tmp_path, capsys):
    base, run, _ = planted
    store = tmp_path / "store"
    assert cli("ingest", run, "--base", base, "--out", store) == 0
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    run.rename(moved)
    message = run_fails(capsys, "fit", store, "--out", tmp_path / "fit")
    assert "checkpoint of step 2 is gone" in message and "--repoint" in message and "--copy" in message
    assert cli("ingest", moved, "--base", base, "--out", store, "--repoint") == 0
    assert cli("fit", store, "--out", tmp_path / "fit") == 0


def test_a_run_and_store_moved_together_still_read(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["steps"][0]["path"] == "../run/checkpoint-2"  # relative to the store
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    tmp_path.rename(moved)
    try:
        store = TrajectoryStore.open(moved / "store")
        assert store.reader().read("model.norm.weight").shape[0] == len(STEPS)
    finally:
        moved.rename(tmp_path)


def test_repoint_refuses_a_run_without_the_steps(planted, tmp_path, capsys):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    shutil.rmtree(run / "checkpoint-13")
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "store", "--repoint")
    assert "13" in message


# ---- relex train --resume --------------------------------------------------------------------------------------------
def train(run: Path, *extra: str) -> int:
    return main(["train", "--config", str(TINY), "--out", str(run), "--no-progress", *extra])


def test_resume_after_a_crash_between_record_and_checkpoint(tmp_path, caplog):
    run = tmp_path / "run"
    assert train(run, "--max-steps", "2") == 0
    # what a kill during step 3's checkpoint leaves: step 3 recorded and logged, checkpoint-3 half written
    store = TrajectoryStore.open(run / "trajectory")
    infos = store.tensors
    store.append_deltas(3, lambda name: __import__("torch").zeros(infos[name].shape))
    with open(run / "log.jsonl", "a") as log:
        log.write(json.dumps({"step": 3}) + "\n" + '{"step": 4, "rew')
    partial = run / "checkpoints" / "checkpoint-3"
    shutil.copytree(run / "checkpoints" / "checkpoint-2", partial)
    (partial / "trainer_state.json").unlink()
    with (partial / "model.safetensors").open("r+b") as handle:
        handle.truncate(1000)
    with caplog.at_level(logging.WARNING):
        assert train(run, "--resume", "--max-steps", "3") == 0
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "partial checkpoint" in messages and "dropped" in messages
    store = TrajectoryStore.open(run / "trajectory")
    assert store.steps == [1, 2, 3]
    assert store.reader([3]).read("model.norm.weight").abs().sum() > 0  # recorded again, not the planted zeros
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == [1, 2, 3]

    caplog.clear()
    log_before = (run / "log.jsonl").read_text()
    with caplog.at_level(logging.WARNING):
        assert train(run, "--resume", "--max-steps", "3") == 0  # finished: nothing to do
    assert any("nothing to do" in r.getMessage() for r in caplog.records)
    assert TrajectoryStore.open(run / "trajectory").steps == [1, 2, 3]
    assert (run / "log.jsonl").read_text() == log_before


def test_second_train_on_one_run_names_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    child = holding(run, tmp_path)
    try:
        assert train(run) == 2
        assert f"process {child.pid} is writing it" in capsys.readouterr().err
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_a_step_beyond_int64_is_refused(planted, tmp_path):
    from relex.errors import RelexError

    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", "--copy") == 0
    with pytest.raises(RelexError, match="positive integer"):
        TrajectoryStore.open(tmp_path / "store").append_deltas(2**63, lambda name: None)


def test_full_disk_while_training_is_one_line_and_resumable(tmp_path, capsys, monkeypatch):
    from relex.io.stream_writer import StreamingSafetensorsWriter

    run = tmp_path / "run"
    original = StreamingSafetensorsWriter.write

    def full(self, name, values):
        if "deltas" in str(self.path):
            raise OSError(28, "No space left on device")
        return original(self, name, values)

    monkeypatch.setattr(StreamingSafetensorsWriter, "write", full)
    assert train(run, "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err
    monkeypatch.setattr(StreamingSafetensorsWriter, "write", original)
    assert train(run, "--resume", "--max-steps", "1") == 0
    assert TrajectoryStore.open(run / "trajectory").steps == [1]
