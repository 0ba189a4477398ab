"""`relex demo`: its planning helpers, an end-to-end run on the tiny config, and (slow) `relex demo --quick`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relex.errors import RelexError
from tests.conftest import cli

ROOT = Path(__file__).resolve().parent.parent


def test_overwrite_never_deletes_a_folder_that_is_not_a_run(tmp_path):
    from relex.demo import prepare_out

    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(RelexError, match="not empty"):
        prepare_out(tmp_path, overwrite=False)
    with pytest.raises(RelexError, match="not one"):
        prepare_out(tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").is_file()


def test_an_interrupted_overwrite_leaves_the_old_run_intact(tmp_path, monkeypatch):
    from relex import demo

    old = tmp_path / "demo"
    old.mkdir()
    (old / demo.MARKER).write_text('{"earlier": true}')

    def interrupted(plan, run_dir, config_file, *, jump):
        (run_dir / "half-written").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "train", interrupted)
    plan = demo.DemoPlan(max_steps=4, segment_steps=2, validation_size=20, confirm_size=20, eval_n=4, max_new_tokens=8, batch_size=8)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(plan, old, config_file=ROOT / "configs" / "tiny.yaml", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no temporary run, no lock
    assert [p.name for p in old.iterdir()] == [demo.MARKER] and (old / demo.MARKER).read_text() == '{"earlier": true}'


def check_demo_folder(run: Path) -> None:
    for part in ("plain/jumps.jsonl", "accelerated/jumps.jsonl", "plain/final/config.json", "accelerated/final/config.json",
                 "eval/summary.json", "demo.json", "figures/jumps.png"):
        assert (run / part).exists(), part
    report = (run / "report.md").read_text()
    assert "## Accelerated training" in report and "### `plain`" in report and "### `accelerated`" in report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert all((run / link).is_file() for link in links) and any(link.endswith("jumps.png") for link in links)
    plain = [json.loads(line) for line in (run / "plain" / "jumps.jsonl").read_text().splitlines()]
    assert plain and not any(j["jumped"] for j in plain) and all(j["reason"].startswith("jumps are off") for j in plain)
    summary = json.loads((run / "eval" / "summary.json").read_text())
    labels = [c["checkpoint"] for c in summary["checkpoints"]]
    assert labels[0].endswith("plain/final") and labels[1].endswith("accelerated/final")


def test_demo_end_to_end_on_the_tiny_config(tmp_path):
    """Every stage on the random tiny Llama of configs/tiny.yaml (seconds per step)."""
    from relex.demo import DemoPlan, run_demo

    plan = DemoPlan(max_steps=4, segment_steps=2, validation_size=20, confirm_size=20, eval_n=4, max_new_tokens=8, batch_size=8)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.yaml").write_text("an earlier run\n")  # replaced whole with --overwrite
    result = run_demo(plan, tmp_path / "demo", config_file=ROOT / "configs" / "tiny.yaml", overwrite=True)
    check_demo_folder(result.run_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"] and not (tmp_path / "demo" / "config.yaml").exists()
    assert json.loads((tmp_path / "demo" / "demo.json").read_text())["seconds"].keys() >= {"evaluate", "report"}
    records = [p for pattern in ("*.json", "*.jsonl", "*.yaml", "*.md") for p in (tmp_path / "demo").rglob(pattern)]
    assert records and not [p for p in records if ".demo.tmp-" in p.read_text()]  # they name RUN, not where it was written
    assert len(result.evaluation.checkpoints) == 3
    assert result.runs["plain"]["grpo_steps"] == result.runs["accelerated"]["grpo_steps"] == 4
    assert result.runs["plain"]["jumps"] == 0


@pytest.mark.slow
def test_demo_quick_on_the_embedded_model(tmp_path):
    assert cli("demo", "--quick", "--out", tmp_path / "demo-quick") == 0
    check_demo_folder(tmp_path / "demo-quick")
