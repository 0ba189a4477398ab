"""`relex demo`: its planning helpers, an end-to-end run on the tiny config, and (slow) `relex demo --quick`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relex.errors import RelexError
from tests.conftest import cli

ROOT = Path(__file__).resolve().parent.parent


def test_observed_prefix_is_a_fifth_of_the_steps_and_at_least_three():
    from relex.demo import observed_prefix

    assert observed_prefix(list(range(2, 42, 2)), 0.2) == 8
    assert observed_prefix([1, 2, 3, 4, 5, 6, 7, 8], 0.2) == 3
    with pytest.raises(RelexError, match="too few"):
        observed_prefix([1, 2, 3], 0.2)


def test_horizon_targets():
    from relex.demo import horizon_targets

    assert horizon_targets(40, (1.0, 2.0)) == [40, 80]
    assert horizon_targets(7, (1.0, 1.5, 2.0)) == [7, 10, 14]


def test_overwrite_never_deletes_a_folder_that_is_not_a_run(tmp_path):
    from relex.demo import prepare_out

    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(RelexError, match="not empty"):
        prepare_out(tmp_path, overwrite=False)
    with pytest.raises(RelexError, match="not one"):
        prepare_out(tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").is_file()


def check_demo_folder(run: Path) -> None:
    for part in ("config.yaml", "log.jsonl", "trajectory", "fit/fit.json", "backtest.json", "eval/summary.json", "demo.json"):
        assert (run / part).exists(), part
    report = run / "report.md"
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())
    assert sorted(Path(link).name for link in links) == ["accuracy.png", "rewards.png", "trajectory.png", "variance.png"]
    assert all((report.parent / link).is_file() for link in links)
    demo = json.loads((run / "demo.json").read_text())
    summary = json.loads((run / "eval" / "summary.json").read_text())
    labels = [c["checkpoint"] for c in summary["checkpoints"]]
    assert labels[1].endswith(f"trajectory@{demo['last_step']}")
    assert sum("extrapolated" in label for label in labels) == sum("two-point" in label for label in labels) == len(demo["targets"])


def test_demo_end_to_end_on_the_tiny_config(tmp_path):
    """Every stage on the random tiny Llama of configs/tiny.yaml (seconds per step)."""
    from relex.demo import DemoPlan, run_demo

    plan = DemoPlan(max_steps=4, record_every=1, eval_n=4, max_new_tokens=8, batch_size=8)
    result = run_demo(plan, tmp_path / "demo", config_file=ROOT / "configs" / "tiny.yaml")
    assert result.observe_until == 3 and result.last_step == 4 and result.targets == [4, 8]
    check_demo_folder(result.run_dir)
    assert len(result.evaluation.checkpoints) == 6


@pytest.mark.slow
def test_demo_quick_on_the_embedded_model(tmp_path):
    assert cli("demo", "--quick", "--out", tmp_path / "demo-quick") == 0
    check_demo_folder(tmp_path / "demo-quick")
