"""relex.present: one table rendered to the terminal, Markdown and plain text, with the same numbers in each."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from relex.present import (
    DASH,
    Table,
    Terminal,
    backtest_tables,
    cell,
    interval,
    jumps_table,
    markdown,
    number,
    percent,
    shown_steps,
    step,
    text,
)

TABLE = Table(
    "relative error, fit on steps ≤ 12",
    ["method", "step 14", "step 20", "tensors", "drift |cos|"],
    [["relex", 0.30149, 2.5e-4, 272, None], ["two-point", 0.0, float("nan"), np.int64(30), np.float32(0.5)]],
    notes=["lower is better"],
)
CELLS = [["relex", "0.301", "2.50e-04", "272", DASH], ["two-point", "0.000", DASH, "30", "0.500"]]


def terminal(table: Table, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width)
    console.print(Terminal(table))
    return console.file.getvalue()


@pytest.mark.parametrize("value, digits, signed, expected", [
    (0.12345, 3, False, "0.123"),
    (2.5e-4, 3, False, "2.50e-04"),
    (0.0, 3, False, "0.000"),
    (12.25, 1, False, "12.2"),
    (0.25, 3, True, "+0.250"),
    (-0.05, 3, True, "-0.050"),
    (None, 3, False, DASH),
    (float("nan"), 3, True, DASH),
    (np.float32("nan"), 3, False, DASH),
    (3, 3, False, "3.000"),
])
def test_number(value, digits, signed, expected):
    assert number(value, digits, signed=signed) == expected


def test_intervals_steps_percent_and_cells():
    assert interval(0.375, 0.125, 0.625) == "0.375 [0.125, 0.625]"
    assert interval(0.25, 0.0, 0.5, signed=True) == "+0.250 [+0.000, +0.500]"
    assert interval(None, None, None) == DASH
    assert step(8.0) == "8" and step(7.5) == "7.5" and step(None) == DASH
    assert percent(0.25) == "25%" and percent(float("nan")) == DASH
    assert [cell(v) for v in ("a|b", True, False, 7, np.int64(7), 0.5, None)] == ["a|b", "yes", "no", "7", "7", "0.500", DASH]
    assert TABLE.cells() == CELLS


def test_plain_text_aligns_the_columns():
    lines = text(TABLE).splitlines()
    assert lines[0] == TABLE.title and lines[-1] == "lower is better"
    header, first, second = lines[1:4]
    assert header.startswith("method     step 14") and first.startswith("relex        0.301") and second.startswith("two-point")
    assert header.endswith("drift |cos|") and first.endswith(DASH) and second.endswith("0.500")  # right-aligned
    assert len({len(header), len(first), len(second)}) == 1


def test_markdown_escapes_pipes_and_aligns_numbers_right():
    out = markdown(TABLE)
    assert out.startswith(TABLE.title + "\n\n| method | step 14 |")
    assert "| drift \\|cos\\| |" in out and "|---|---:|---:|---:|---:|" in out
    assert "| relex | 0.301 | 2.50e-04 | 272 | — |" in out and "| two-point | 0.000 | — | 30 | 0.500 |" in out
    assert out.endswith("\n\nlower is better")


def test_terminal_shows_every_cell_without_cropping():
    out = terminal(TABLE)
    assert out.splitlines()[0] == TABLE.title and out.rstrip().endswith("lower is better")
    assert "…" not in out
    long_label = Table("", ["checkpoint", "greedy acc [95% CI]"], [["/tmp/" + "x" * 70 + "/trajectory@10", "0.375 [0.125, 0.625]"]])
    narrow = terminal(long_label, width=60)
    assert "…" not in narrow and "0.375 [0.125, 0.625]" in narrow and "trajectory@10" in narrow.replace("│", "").replace(" ", "")
    assert "[95% CI]" in narrow  # text, never read as rich markup


def cells_in(rendered: str) -> set[str]:
    return {c.strip() for c in re.split(r"[│┃|\n]|\s{2,}", rendered.replace("\\|", "|")) if c.strip()}


def test_the_same_table_renders_the_same_content_everywhere():
    expected = {c for row in CELLS for c in row} | set(TABLE.columns) - {"drift |cos|"}
    for rendered in (text(TABLE), markdown(TABLE), terminal(TABLE)):
        assert expected <= cells_in(rendered), rendered
        assert "drift |cos|" in rendered.replace("\\|", "|") and TABLE.title in rendered and "lower is better" in rendered


def test_empty_rows_and_no_columns():
    empty = Table("nothing yet", ["checkpoint", "accuracy"])
    assert text(empty).splitlines() == ["nothing yet", "checkpoint  accuracy"]
    assert markdown(empty) == "nothing yet\n\n| checkpoint | accuracy |\n|---|---:|"
    assert "checkpoint" in terminal(empty) and "accuracy" in terminal(empty)
    line = Table("store s: 4 steps", notes=["delta quantization error (bfloat16): max 1.72e-03"])
    for rendered in (text(line), terminal(line)):
        assert rendered.split() == "store s: 4 steps delta quantization error (bfloat16): max 1.72e-03".split()
    assert markdown(line) == "store s: 4 steps\n\ndelta quantization error (bfloat16): max 1.72e-03"
    assert markdown(Table("", ["a"], [["x"]])) == "| a |\n|---|\n| x |"


def test_backtest_tables_from_the_saved_result():
    later = list(range(14, 62, 2))
    errors = {m: {str(s): {"all": s / 100, "mlp.up_proj.weight": 0.1, "self_attn.q_proj.weight": 0.2} for s in later}
              for m in ("relex", "two-point")}
    saved = {"observed_steps": [2, 4, 12], "later_steps": later, "relative_error": errors,
             "drift_cosine_by_module_type": {"mlp.up_proj.weight": 0.99}}
    by_step, by_type = backtest_tables(saved)
    assert by_step.title == "relative error ‖Δ̂ − Δ‖/‖Δ‖, fit on steps ≤ 12 (3 observed)"
    assert by_step.columns[-1] == "step 60" and len(by_step.columns) <= 10 and by_step.rows[0][-1] == 0.6
    assert by_type.columns == ["module type", "relex", "two-point", "drift |cos|"]
    assert by_type.rows == [["mlp.up_proj.weight", 0.1, 0.1, 0.99], ["self_attn.q_proj.weight", 0.2, 0.2, None]]
    assert shown_steps([1, 2, 3]) == [1, 2, 3]


def test_jump_decisions_with_their_reasons():
    jumps = [
        {"step": 2, "jumped": True, "chosen": {"name": "relex α=3"}, "validation_accuracy_before": 0.1,
         "validation_accuracy_after": 0.15, "virtual_step_after": 6.0, "reason": "gains +0.050"},
        {"step": 4, "jumped": False, "chosen": None, "validation_accuracy_before": 0.15,
         "validation_accuracy_after": 0.15, "virtual_step_after": 8.0, "reason": "may lose 0.1"},
    ]
    table = jumps_table(jumps, "jump decisions")
    assert table.cells() == [["2", "jump", "relex α=3", "0.100", "0.150", "6"], ["4", "kept", DASH, "0.150", "0.150", "8"]]
    assert table.notes == ["step 2: gains +0.050", "step 4: may lose 0.1"]


def test_eval_table_and_its_plain_text(monkeypatch):
    from relex.evaluate.report import eval_table, format_table

    def checkpoint(name, accuracy, diff=None):
        return SimpleNamespace(checkpoint=name, n=4, accuracy=accuracy, ci_low=0.0, ci_high=1.0, diff_vs_first=diff,
                               pass_at_k={1: 0.5, 2: math.nan}, maj_at_k=0.25, mean_tokens=3.25, truncated=0.5,
                               completions_per_s=12.0, verifier_failures={"exact": 2})

    result = SimpleNamespace(
        task={"name": "chain_sum", "verifier": "exact"}, settings=SimpleNamespace(seed=5, samples=2),
        checkpoints=[checkpoint("a", 0.5), checkpoint("b", 0.75, {"diff": 0.25, "ci_low": -0.25, "ci_high": 0.5})],
    )
    table = eval_table(result)
    assert table.title == "chain_sum (exact verifier), seed 5"
    assert table.columns[4:7] == ["pass@1", "pass@2", "maj@2"]
    assert table.cells()[1] == ["b", "4", "0.750 [0.000, 1.000]", "+0.250 [-0.250, +0.500]", "0.500", DASH, "0.250",
                                "3.2", "50%", "12.00", "2"]
    assert format_table(result) == text(table)


def test_fit_store_and_extrapolate_summaries():
    from relex.present import extrapolate_table, fit_table, store_summary

    fit = SimpleNamespace(config=SimpleNamespace(rank=2, temporal="linear"), steps=np.array([2, 4, 13]),
                          summary_by_module_type=lambda: [{"module_type": "all", "tensors": 20, "median_explained_variance": 0.95,
                                                           "share_ev_ge_0.9": 1.0, "median_r2": math.nan}])
    table = fit_table(fit)
    assert table.title == "rank-2 fit over steps 2..13 (3 observed), temporal linear"
    assert table.cells() == [["all", "20", "0.950", "1.000", DASH]] and table.columns[2] == "median EV(r=2)"

    entries = [SimpleNamespace(step=s, kind="delta", dtype="bfloat16", quantization_error=e) for s, e in ((10, 1e-3), (20, 1.72e-3))]
    store = SimpleNamespace(path="store", entries=entries, steps=[10, 20], trajectory_names=["a", "b"], tied={},
                            base_dir="base/./", size_bytes=lambda: 2**20)
    assert text(store_summary(store)).splitlines() == [
        "store store: 2 steps (10, 20), 2 trajectory tensors, tied none, copied, 1.0 MiB",
        "delta quantization error (bfloat16): max ‖q(Δ)−Δ‖/‖Δ‖ = 1.72e-03",
    ]
    assert text(store_summary(store, repointed_at=["new-run"])) == "store store: 2 steps re-pointed at new-run (base base)"

    reports = [SimpleNamespace(path=Path("out/step-20"), target=20, horizon_ratio=20 / 13, interpolation=False,
                               delta_norm=0.05, rounding_loss=0.462)]
    table = extrapolate_table(reports, "relex", "out")
    assert table.cells() == [["step-20", "20", "1.538", "no", "0.050", "0.462"]]
    assert table.notes[0].startswith("horizon ratio = step / 13,") and "rounds away 46.2%" in table.notes[1]


def test_the_demo_shows_accuracy_decisions_and_where_things_are(tmp_path):
    import json

    from relex.demo import ACCELERATED, DemoResult

    (tmp_path / ACCELERATED).mkdir()
    (tmp_path / ACCELERATED / "jumps.jsonl").write_text(json.dumps(
        {"step": 2, "jumped": True, "chosen": {"name": "relex α=3"}, "validation_accuracy_before": 0.1,
         "validation_accuracy_after": 0.15, "virtual_step_after": 6.0, "reason": "gains +0.050"}) + "\n")

    def checkpoint(path, accuracy, diff=None):
        return SimpleNamespace(checkpoint=str(path), n=16, accuracy=accuracy, ci_low=0.25, ci_high=0.5, diff_vs_first=diff)

    evaluation = SimpleNamespace(checkpoints=[
        checkpoint(tmp_path / "plain" / "final", 0.375),
        checkpoint(tmp_path / ACCELERATED / "final", 0.4375, {"diff": 0.0625, "ci_low": -0.0625, "ci_high": 0.125}),
        checkpoint("/models/base", 0.3125, {"diff": -0.0625, "ci_low": -0.125, "ci_high": 0.0}),
    ])
    runs = {"plain": {"grpo_steps": 4, "virtual_steps": 4}, ACCELERATED: {"grpo_steps": 4, "virtual_steps": 6.0}}
    result = DemoResult(tmp_path, tmp_path / "report.md", runs, evaluation, {"plain GRPO": 63.0, "accelerated": 108.0})
    accuracy, decisions, where = result.tables()
    assert accuracy.cells() == [
        ["plain GRPO", "4", "4", "0.375 [0.250, 0.500]", DASH],
        ["relex accelerate", "4", "6", "0.438 [0.250, 0.500]", "+0.062 [-0.062, +0.125]"],
        ["base", "0", "0", "0.312 [0.250, 0.500]", "-0.062 [-0.125, +0.000]"],
    ]
    assert decisions.cells() == [["2", "jump", "relex α=3", "0.100", "0.150", "6"]] and decisions.notes == ["step 2: gains +0.050"]
    assert where.title == "time: plain GRPO 63 s, accelerated 108 s (total 2.9 min)" and str(tmp_path / "report.md") in where.notes[0]
