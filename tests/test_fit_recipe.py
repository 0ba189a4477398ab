"""A saved fit is its recipe (rank, temporal model, window, steps); how a command runs is never saved."""

from __future__ import annotations

import json

from tests.conftest import cli


def test_a_fit_saves_its_recipe_only_and_extrapolates_on_any_device(store, tmp_path):
    assert cli("fit", store.path, "--out", tmp_path / "fit", "--device", "cpu", "--observe-until", 13) == 0
    payload = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert set(payload["config"]) == {"rank", "temporal", "degree", "window", "observe_until"}
    payload["config"].update(device="cuda:7", io="direct", chunk_elements=7)  # as older fits saved them
    (tmp_path / "fit" / "fit.json").write_text(json.dumps(payload))
    out = tmp_path / "out"
    assert cli("extrapolate", store.path, "--fit", tmp_path / "fit", "--targets", "20", "--out", out, "--device", "cpu") == 0
    assert (out / "step-20" / "config.json").is_file()


def test_recipe_flags_with_a_saved_fit_are_refused_in_one_line(store, tmp_path, capsys):
    assert cli("fit", store.path, "--out", tmp_path / "fit", "--device", "cpu") == 0
    capsys.readouterr()
    assert cli("extrapolate", store.path, "--fit", tmp_path / "fit", "--targets", "40", "--out", tmp_path / "o", "--rank", "2") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--rank with --fit" in err and "--gram-from" in err
    assert not (tmp_path / "o").exists()
