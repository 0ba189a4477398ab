"""relex eval of a hub id with no network and an empty cache ends in one line, not a transformers traceback."""

from __future__ import annotations

from tests.conftest import cli


def test_eval_of_an_uncached_hub_id_offline_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code = cli("eval", "some-org/not-cached-model", "--task", "chain_sum", "--n", "2", "--out", tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) >= 1
    assert "cannot be reached" in err[-1] and "some-org/not-cached-model" in err[-1]
    assert not (tmp_path / "out").exists()
