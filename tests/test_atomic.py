"""Nothing lost: --overwrite never deletes an input, an interrupted write leaves the old output or nothing, and the
leftovers of a killed run are removed by the next one (relex.io.atomic)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relex.errors import RelexError
from relex.io import atomic
from relex.store import TrajectoryStore
from tests.conftest import cli
from tests.test_bad_input import run_fails

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    return tmp_path / "store"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- --overwrite never deletes an input ------------------------------------------------------------------------------
def test_ingest_over_its_own_run_is_refused(planted, capsys):
    base, run, _ = planted
    before = listing(run)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", run, "--overwrite")
    assert "is the input" in message and "--overwrite would delete it" in message
    assert listing(run) == before


def test_ingest_over_the_base_is_refused(planted, capsys):
    base, run, _ = planted
    before = listing(base)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", base, "--overwrite")
    assert str(base) in message and "input" in message
    assert listing(base) == before


def test_ingest_into_a_folder_holding_the_run_is_refused(planted, tmp_path, capsys):
    base, run, _ = planted
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path, "--overwrite")
    assert "contains the input" in message
    assert (run / "checkpoint-2" / "model.safetensors").is_file()


def test_fit_over_its_store_is_refused(store, capsys):
    before = listing(store)
    message = run_fails(capsys, "fit", store, "--out", store, "--overwrite")
    assert "is the input" in message
    assert listing(store) == before and TrajectoryStore.open(store).steps


def test_fit_inside_its_store_is_refused(store, capsys):
    message = run_fails(capsys, "fit", store, "--out", store / "fit", "--overwrite")
    assert "lies inside the input" in message


def test_extrapolate_over_the_store_or_a_checkpoint_is_refused(planted, store, capsys):
    _, run, _ = planted
    for out in (store, run / "checkpoint-30", run):
        before = listing(out)
        message = run_fails(capsys, "extrapolate", store, "--targets", "40", "--out", out, "--overwrite")
        assert "input" in message
        assert listing(out) == before


def test_out_that_is_a_file(store, tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("keep me")
    message = run_fails(capsys, "extrapolate", store, "--targets", "40", "--out", out)
    assert "is a file" in message
    message = run_fails(capsys, "fit", store, "--out", out, "--overwrite")
    assert "is a file" in message
    assert out.read_text() == "keep me"


def test_a_folder_the_os_refuses(store, tmp_path, capsys, monkeypatch):
    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refused)
    message = run_fails(capsys, "fit", store, "--out", tmp_path / "ro" / "fit")
    assert "cannot write there (Permission denied)" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(store, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        message = run_fails(capsys, "fit", store, "--out", parent / "fit")
        assert "cannot write" in message
    finally:
        parent.chmod(0o755)


# ---- replacing and leftovers -------------------------------------------------------------------------------------------
def test_overwrite_replaces_the_output_whole(store, tmp_path):
    out = tmp_path / "out"
    assert cli("extrapolate", store, "--targets", "40,60", "--out", out) == 0
    assert cli("extrapolate", store, "--targets", "50", "--method", "two-point", "--out", out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["step-50"]  # no step-40, step-60 or fit/ of the old method
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_leftovers_of_a_dead_process_are_removed_and_named(store, tmp_path, caplog):
    pid = dead_pid()
    out = tmp_path / "out"
    out.mkdir()
    (out / f".step-40.tmp-{pid}").mkdir()  # what an older relex left inside OUT
    (out / f".step-40.tmp-{pid}" / "model.safetensors").write_bytes(b"x" * 1000)
    stale = tmp_path / f".out.tmp-{pid}-abcdef"
    stale.mkdir()
    (stale / "junk").write_bytes(b"x" * 1000)
    with caplog.at_level(logging.WARNING):
        assert cli("extrapolate", store, "--targets", "40", "--out", out) == 0  # leftovers do not make OUT "not empty"
    assert not stale.exists()
    assert sorted(p.name for p in out.iterdir()) == ["fit", "step-40"]
    assert any(str(pid) in record.getMessage() and "interrupted" in record.getMessage() for record in caplog.records)


def test_leftovers_of_a_live_process_are_kept(tmp_path):
    live = tmp_path / f".out.tmp-{os.getpid()}-abcdef"
    live.mkdir()
    with atomic.atomic_output(tmp_path / "out") as tmp:
        (tmp / "a").write_text("a")
    assert live.is_dir() and (tmp_path / "out" / "a").is_file()


def test_an_old_output_moved_aside_is_put_back(tmp_path):
    """A kill between moving the old output aside and renaming the new one in: the next run restores the old one."""
    pid = dead_pid()
    old = tmp_path / f".out.old-{pid}"
    old.mkdir()
    (old / "a").write_text("old")
    new = tmp_path / f".out.tmp-{pid}-abcdef"
    new.mkdir()
    with pytest.raises(RelexError, match="not empty"):
        with atomic.atomic_output(tmp_path / "out"):
            pass
    assert (tmp_path / "out" / "a").read_text() == "old"
    assert not new.exists() and not old.exists()


def test_a_failure_leaves_the_old_output(tmp_path):
    out = tmp_path / "out"
    with atomic.atomic_output(out) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic.atomic_output(out, overwrite=True) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("interrupted")
    assert (out / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_full_disk_is_one_line(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with pytest.raises(RelexError, match="out: nothing written: No space left on device"):
        with atomic.atomic_output(tmp_path / "out") as tmp:
            monkeypatch.setattr(Path, "write_text", full)
            (tmp / "a").write_text("x")
    assert list(tmp_path.iterdir()) == []


# ---- a SIGKILL in the middle of relex extrapolate ---------------------------------------------------------------------
KILLED = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from relex.io import hf_folder
    from relex.cli import main

    written = []
    original = hf_folder.HFFolderWriter.write

    def slow(self, name, values):
        original(self, name, values)
        written.append(name)
        if len(written) == 8:
            Path(sys.argv[1]).write_text("writing")
            time.sleep(600)

    hf_folder.HFFolderWriter.write = slow
    sys.exit(main(sys.argv[2:]))
    """
)


def run_until_killed(tmp_path: Path, *args, how: int = signal.SIGKILL) -> None:
    marker = tmp_path / "marker"
    marker.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(marker), *map(str, args)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not marker.exists():
        assert child.poll() is None and time.time() < deadline, "the child ended before it was killed"
        time.sleep(0.05)
    child.send_signal(how)
    child.wait()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_kill_then_the_same_command(store, tmp_path, how):
    out = tmp_path / "out"
    command = ("extrapolate", store, "--targets", "40,60", "--out", out)
    run_until_killed(tmp_path, *command, how=how)
    assert not out.exists()
    assert any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir())  # what the kill left behind
    assert cli(*command) == 0  # the same command, no --overwrite needed
    assert sorted(p.name for p in out.iterdir()) == ["fit", "step-40", "step-60"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_sigkill_during_overwrite_leaves_the_old_output(store, tmp_path):
    out = tmp_path / "out"
    assert cli("extrapolate", store, "--targets", "40", "--out", out) == 0
    before = listing(out)
    run_until_killed(tmp_path, "extrapolate", store, "--targets", "50,70", "--method", "two-point", "--out", out, "--overwrite")
    assert listing(out) == before  # old and new are never mixed
    assert cli("extrapolate", store, "--targets", "50,70", "--method", "two-point", "--out", out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["step-50", "step-70"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


# ---- a full disk in the middle of a command -----------------------------------------------------------------------------
def no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_full_disk_during_fit(store, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("relex.fit.fit.save_file", no_space)
    message = run_fails(capsys, "fit", store, "--out", tmp_path / "fit", out=tmp_path / "fit")
    assert "No space left on device" in message
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fit")] == []


def test_full_disk_during_ingest_copy(planted, tmp_path, capsys, monkeypatch):
    from relex.io.stream_writer import StreamingSafetensorsWriter

    base, run, _ = planted
    monkeypatch.setattr(StreamingSafetensorsWriter, "write", no_space)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", "--copy", out=tmp_path / "s")
    assert "No space left on device" in message
    assert f"{tmp_path / 's'}: step " in message and ".tmp-" not in message  # the output, not its temporary name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".s")] == []


def test_full_disk_during_store_append_keeps_the_store(store, monkeypatch):
    import torch

    from relex.io.stream_writer import StreamingSafetensorsWriter

    opened = TrajectoryStore.open(store)
    infos = opened.tensors
    before = (store / "manifest.json").read_text()
    monkeypatch.setattr(StreamingSafetensorsWriter, "write", no_space)
    with pytest.raises(RelexError, match="step 40 not recorded: No space left on device"):
        opened.append_deltas(40, lambda name: torch.zeros(infos[name].shape))
    assert (store / "manifest.json").read_text() == before
    assert not (store / "deltas").exists() or [p.name for p in (store / "deltas").iterdir()] == []
