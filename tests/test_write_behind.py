"""Write-behind: extrapolate's file writes run in a background thread, in order, with bounded memory."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from relex.extrapolate import ExtrapolateConfig, extrapolate_store
from relex.io.hf_folder import HFFolderWriter
from relex.io.write_behind import WriteBehind
from relex.store import TrajectoryStore
from tests.conftest import cli


class Recorder:
    def __init__(self, behind_ref, fail_at=None):
        self.calls, self.fail_at, self.behind_ref, self.pending_seen = [], fail_at, behind_ref, []

    def write(self, name, values):
        time.sleep(random.random() * 0.002)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise OSError(28, "No space left on device")
        self.pending_seen.append(self.behind_ref[0]._pending)
        self.calls.append((name, values.clone()))


def test_writes_run_in_order_for_every_writer():
    ref = []
    writers = [Recorder(ref), Recorder(ref)]
    behind = WriteBehind(writers, max_bytes=64 * 4)
    ref.append(behind)
    sent = [[], []]
    for k in range(200):
        for i in (0, 1):
            values = torch.full((random.randint(1, 40),), float(k * 2 + i))
            sent[i].append((f"t{k}", values))
            behind.write(i, f"t{k}", values)
            assert behind._pending <= 64 * 4  # a caller never runs further ahead than the budget
    behind.drain()
    behind.close()
    for writer, expected in zip(writers, sent):
        assert [n for n, _ in writer.calls] == [n for n, _ in expected]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(writer.calls, expected))
    assert max(max(w.pending_seen) for w in writers) <= 64 * 4


def test_a_value_larger_than_the_budget_waits_for_an_empty_queue():
    ref = []
    writer = Recorder(ref)
    behind = WriteBehind([writer], max_bytes=16)
    ref.append(behind)
    behind.write(0, "small", torch.zeros(2))
    behind.write(0, "large", torch.zeros(100))  # 400 bytes: written alone
    behind.drain()
    behind.close()
    assert [n for n, _ in writer.calls] == ["small", "large"]
    assert writer.pending_seen[1] == 400


def test_an_error_in_the_thread_reaches_the_caller():
    ref = []
    behind = WriteBehind([Recorder(ref, fail_at=3)])
    ref.append(behind)
    with pytest.raises(OSError, match="No space left"):
        for k in range(100):
            behind.write(0, f"t{k}", torch.zeros(4))
            time.sleep(0.001)
        behind.drain()
    behind.close()
    assert not any(t.name == "relex-writer" and t.is_alive() for t in threading.enumerate())


def test_a_failed_write_during_extrapolate_leaves_nothing(planted, tmp_path, monkeypatch, capsys):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    original, calls = HFFolderWriter.write, []

    def full_disk(self, name, values):
        calls.append(name)
        if len(calls) == 7:
            raise OSError(28, "No space left on device")
        original(self, name, values)

    monkeypatch.setattr(HFFolderWriter, "write", full_disk)
    assert cli("extrapolate", tmp_path / "store", "--targets", "30,40", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(tmp_path / "out") in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not any(t.name == "relex-writer" and t.is_alive() for t in threading.enumerate())
    # and the same store still extrapolates once the disk has room
    monkeypatch.setattr(HFFolderWriter, "write", original)
    extrapolate_store(TrajectoryStore.open(tmp_path / "store"), tmp_path / "out", ExtrapolateConfig(targets=[30]))
    assert (tmp_path / "out" / "step-30" / "relex.json").is_file()
