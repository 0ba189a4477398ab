"""Direct I/O (O_DIRECT, bypassing the page cache) reads exactly what plain reads do, and is chosen sensibly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import relex.store
from relex.errors import RelexError
from relex.fit import FitConfig, fit_store
from relex.io.safetensors_file import DIRECT_ALIGN, SafetensorsFile
from relex.store import TrajectoryStore
from tests.conftest import cli

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="this OS has no O_DIRECT")


@pytest.fixture
def store(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store", "--copy") == 0
    return TrajectoryStore.open(tmp_path / "store")


def test_direct_reads_equal_plain_reads_at_any_offset(store, monkeypatch):
    monkeypatch.setattr("relex.io.safetensors_file.DIRECT_PIECE", 2 * DIRECT_ALIGN)  # many pieces per tensor
    path = next((store.path / "deltas").iterdir())
    plain, direct = SafetensorsFile(path), SafetensorsFile(path, direct=True)
    if not direct.direct:
        pytest.skip(f"{path.parent}: the file system refuses O_DIRECT")
    for name in plain.keys():
        rows = plain.shape(name)[0] if plain.shape(name) else 0
        for span in [None, (0, 1), (1, max(2, rows - 1)), (rows // 2, rows)]:
            assert torch.equal(direct.read(name, span), plain.read(name, span)), (name, span)


def test_a_refused_direct_read_falls_back_to_plain_reads_without_closing_under_other_threads(store, monkeypatch):
    path = next((store.path / "deltas").iterdir())
    plain, direct = SafetensorsFile(path), SafetensorsFile(path, direct=True)
    if not direct.direct:
        pytest.skip(f"{path.parent}: the file system refuses O_DIRECT")
    descriptor = direct._direct_fd

    def refused(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(direct, "_read_direct", refused)
    name = plain.keys()[0]
    assert torch.equal(direct.read(name), plain.read(name))
    assert not direct.direct
    os.fstat(descriptor)  # still open: a thread reading through it is not left with a number reused elsewhere
    direct.close()
    with pytest.raises(OSError):
        os.fstat(descriptor)


def test_fit_reads_the_same_values_either_way(store):
    direct = fit_store(store, FitConfig(io="direct", chunk_elements=300))
    cached = fit_store(store, FitConfig(io="cached", chunk_elements=300))
    for name in store.trajectory_names:
        np.testing.assert_array_equal(direct.grams[name], cached.grams[name])


def test_auto_reads_direct_only_when_the_store_exceeds_available_memory(store, monkeypatch):
    size = store.data_bytes()
    assert size == sum(f.stat().st_size for f in (store.path / "deltas").iterdir())
    monkeypatch.setattr(relex.store, "memory_available", lambda: size - 1)
    assert store.reads_direct("auto")
    monkeypatch.setattr(relex.store, "memory_available", lambda: size * 10)
    assert not store.reads_direct("auto")
    monkeypatch.setattr(relex.store, "memory_available", lambda: None)
    assert not store.reads_direct("auto")
    assert store.reads_direct("direct") and not store.reads_direct("cached")
    with pytest.raises(RelexError, match="valid: auto, direct, cached"):
        store.reads_direct("mmap")


def test_cli_io_option(store, tmp_path, capsys):
    assert cli("fit", store.path, "--io", "direct", "--out", tmp_path / "fit") == 0
    assert cli("fit", store.path, "--io", "mmap", "--out", tmp_path / "fit2") == 2
    err = capsys.readouterr().err.strip()
    assert "fit.io 'mmap': unknown I/O mode; valid: auto, direct, cached" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "fit2").exists()
