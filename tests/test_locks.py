"""One writer at a time: a store and an output folder are locked for a command's duration; a second writer gets one
line naming the holder's PID, and a store is never blended from two writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from relex.errors import RelexError
from relex.io import atomic
from relex.store import TrajectoryStore
from tests.conftest import cli
from tests.test_bad_input import run_fails

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture
def store(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", "--copy") == 0
    return tmp_path / "store"


APPEND = textwrap.dedent(
    """
    import sys, time, torch
    from relex.errors import RelexError
    from relex.store import TrajectoryStore

    path, step, value, go = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    store = TrajectoryStore.open(path)
    infos = store.tensors
    while not __import__("os").path.exists(go):
        time.sleep(0.01)

    def delta(name):
        time.sleep(0.02)  # slow enough that the two writers overlap
        return torch.full(infos[name].shape, value)

    try:
        store.append_deltas(step, delta)
    except RelexError as error:
        print(error)
        sys.exit(2)
    """
)


def two_appends(store: Path, tmp_path: Path, steps: tuple[int, int]) -> list[tuple[int, str]]:
    go = tmp_path / "go"
    children = [
        subprocess.Popen([sys.executable, "-c", APPEND, str(store), str(step), str(value), str(go)], env=ENV, stdout=subprocess.PIPE, text=True)
        for step, value in zip(steps, (1.0, 2.0))
    ]
    time.sleep(3)  # both have imported torch and opened the store
    go.write_text("")
    return [(child.wait(), child.stdout.read()) for child in children]


def test_two_processes_appending_the_same_step(store, tmp_path):
    results = two_appends(store, tmp_path, (40, 40))
    assert sorted(code for code, _ in results) == [0, 2], results
    message = next(out for code, out in results if code)
    assert "is writing it" in message or "already recorded" in message
    manifest = TrajectoryStore.open(store)
    assert manifest.steps.count(40) == 1
    values = manifest.reader([40]).read("model.layers.0.mlp.up_proj.weight")
    assert values.unique().numel() == 1  # one writer's values, never a blend
    assert [p.name for p in (store / "deltas").iterdir() if p.name.startswith(".")] == []


def test_two_processes_appending_other_steps(store, tmp_path):
    results = two_appends(store, tmp_path, (40, 50))
    codes = [code for code, _ in results]
    assert 0 in codes, results
    recorded = TrajectoryStore.open(store).steps
    for (code, out), step in zip(results, (40, 50)):
        if code == 0:
            assert step in recorded
        else:
            assert "process" in out and "is writing it" in out
            assert step not in recorded
    files = sorted(p.name for p in (store / "deltas").iterdir())
    assert files == sorted(f"step-{s:08d}.safetensors" for s in recorded)  # no orphaned delta file


HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from relex.io.atomic import write_lock

    with write_lock(sys.argv[1]):
        Path(sys.argv[2]).write_text("held")
        time.sleep(600)
    """
)


def holding(target: Path, tmp_path: Path) -> subprocess.Popen:
    marker = tmp_path / "held"
    marker.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(target), str(marker)], env=ENV)
    deadline = time.time() + 60
    while not marker.exists():
        assert child.poll() is None and time.time() < deadline
        time.sleep(0.02)
    return child


def test_second_extrapolate_to_one_out_names_the_holder(store, tmp_path, capsys):
    out = tmp_path / "out"
    child = holding(out, tmp_path)
    try:
        message = run_fails(capsys, "extrapolate", store, "--targets", "40", "--out", out)
        assert f"process {child.pid} is writing it" in message
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert cli("extrapolate", store, "--targets", "40", "--out", out) == 0  # the OS released the dead holder's lock


def test_second_ingest_to_one_out_names_the_holder(planted, tmp_path, capsys):
    base, run, _ = planted
    out = tmp_path / "s"
    child = holding(out, tmp_path)
    try:
        message = run_fails(capsys, "ingest", run, "--base", base, "--out", out)
        assert f"process {child.pid}" in message
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_appending_while_another_process_writes_the_store(store, tmp_path):
    child = holding(store / "manifest.json", tmp_path)
    try:
        with pytest.raises(RelexError, match=f"process {child.pid} is writing it"):
            TrajectoryStore.open(store).append_deltas(40, lambda name: torch.zeros(1))
        assert TrajectoryStore.open(store).reader().steps  # readers are not blocked
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_lock_is_reentrant_and_leaves_no_file(tmp_path):
    target = tmp_path / "out"
    with atomic.write_lock(target):
        with atomic.write_lock(target):
            assert atomic.lock_holder(target) == os.getpid()
        assert atomic.holds_lock(target)
    assert not atomic.holds_lock(target)
    assert list(tmp_path.iterdir()) == []


def test_manifest_reread_before_append(store):
    """Two handles on one store in one process: the second append sees the first one's step."""
    first, second = TrajectoryStore.open(store), TrajectoryStore.open(store)
    infos = first.tensors
    first.append_deltas(40, lambda name: torch.zeros(infos[name].shape))
    second.append_deltas(50, lambda name: torch.zeros(infos[name].shape))
    assert TrajectoryStore.open(store).steps[-2:] == [40, 50]
