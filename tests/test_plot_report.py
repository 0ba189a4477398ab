"""Figures, the Markdown report and the horizon sweep, on a planted trajectory and hand-made logs and summaries."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from relex.errors import RelexError
from relex.synthetic import write_planted_run
from tests.conftest import cli, make_base

STEPS = [2, 4, 6, 9, 13, 20, 30, 40]
OBSERVE_UNTIL = 13


def assert_png_has_content(path: Path) -> None:
    from PIL import Image

    assert path.is_file() and path.stat().st_size > 0, path
    pixels = np.asarray(Image.open(path).convert("L"), dtype=float)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 200
    assert (pixels < 250).mean() > 0.01, f"{path} is (nearly) blank"


@pytest.fixture(scope="module")
def run_parts(tmp_path_factory):
    """A planted run ingested into RUN/trajectory and fitted on the prefix into RUN/fit."""
    root = tmp_path_factory.mktemp("plot")
    base = make_base(root / "base")
    write_planted_run(base, root / "ckpts", STEPS, noise=0.05)
    run = root / "RUN"
    assert cli("ingest", root / "ckpts", "--base", base, "--out", run / "trajectory") == 0
    assert cli("fit", run / "trajectory", "--out", run / "fit", "--observe-until", OBSERVE_UNTIL) == 0
    return root, run


def write_log(path: Path, steps: int = 30) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as handle:
        for step in range(1, steps + 1):
            handle.write(json.dumps({"step": step, "reward": 0.2 + 0.01 * step + rng.normal(0, 0.03), "reward_std": 0.25, "loss": 0.0}) + "\n")


def checkpoint_folder(path: Path, method: str, target: int, observed: list[int]) -> str:
    path.mkdir(parents=True)
    (path / "relex.json").write_text(json.dumps({"method": method, "target_step": target, "window_steps": observed}))
    return str(path)


def entry(checkpoint: str, accuracy: float, n: int = 50) -> dict:
    return {"checkpoint": checkpoint, "n": n, "accuracy": accuracy, "ci_low": accuracy - 0.1, "ci_high": accuracy + 0.1,
            "mean_tokens": 20.0, "diff_vs_first": {"diff": accuracy - 0.3, "ci_low": accuracy - 0.4, "ci_high": accuracy - 0.2}}


def write_eval_summary(run: Path) -> Path:
    observed = [s for s in STEPS if s <= OBSERVE_UNTIL]
    checkpoints = [entry(str(run.parent / "base"), 0.3), entry(f"{run / 'trajectory'}@40", 0.5)]
    checkpoints += [entry(checkpoint_folder(run / "extrapolated" / f"step-{t}", "relex", t, observed), 0.45 + t / 1000) for t in (40, 80)]
    checkpoints += [entry(checkpoint_folder(run / "two-point" / f"step-{t}", "two-point", t, observed), 0.4) for t in (40, 80)]
    path = run / "eval" / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"task": {"name": "planted", "verifier": "exact"}, "settings": {"max_new_tokens": 16}, "checkpoints": checkpoints}))
    return path


# ---- figures ------------------------------------------------------------------------------------------------------
def test_trajectory_figure_default_and_chosen_tensors(run_parts):
    root, run = run_parts
    assert cli("plot", "trajectory", run / "trajectory", "--fit", run / "fit", "--out", root / "t.png") == 0
    assert_png_has_content(root / "t.png")
    name = "model.layers.0.mlp.up_proj.weight"
    assert cli("plot", "trajectory", run / "trajectory", "--fit", run / "fit", "--tensors", name, "--out", root / "t1.png") == 0
    assert_png_has_content(root / "t1.png")
    assert cli("plot", "trajectory", run / "trajectory", "--fit", run / "fit", "--module-types", "mlp.up_proj.weight", "--out", root / "t2.png") == 0


def test_unknown_tensor_or_module_type_is_named(run_parts):
    from relex.fit import FitResult
    from relex.plot import plot_trajectory
    from relex.store import TrajectoryStore

    root, run = run_parts
    store, fit = TrajectoryStore.open(run / "trajectory"), FitResult.load(run / "fit")
    with pytest.raises(RelexError, match="model.layers.9.nope"):
        plot_trajectory(store, fit, root / "x.png", tensors=["model.layers.9.nope"])
    with pytest.raises(RelexError, match="mlp.nope.*valid: "):
        plot_trajectory(store, fit, root / "x.png", module_types=["mlp.nope"])
    assert cli("plot", "trajectory", run / "trajectory", "--fit", run / "fit", "--tensors", "nope", "--out", root / "x.png") == 2


def test_representative_tensors_take_the_middle_layer():
    from relex.plot import representative_tensors

    names = [f"model.layers.{i}.{kind}.weight" for i in range(5) for kind in ("mlp.up_proj", "self_attn.q_proj")] + ["model.norm.weight"]
    assert representative_tensors(names) == ["model.layers.2.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight"]
    assert representative_tensors(names, ["model.norm.weight"]) == ["model.norm.weight"]


def test_held_out_coefficients_are_projections_on_the_fitted_direction(run_parts):
    """c(s_m) = Δ_mᵀ v₁ with v₁ = M_fitᵀ u₁ / σ₁, computed here from the deltas themselves."""
    from relex.fit import FitResult
    from relex.plot import coefficient_series
    from relex.store import TrajectoryStore

    _, run = run_parts
    store, fit = TrajectoryStore.open(run / "trajectory"), FitResult.load(run / "fit")
    name = "model.layers.1.self_attn.o_proj.weight"
    (series,) = coefficient_series(store, fit, [name])
    all_deltas = store.reader(store.steps).read(name).double()
    fitted = torch.stack([all_deltas[store.steps.index(int(s))] for s in fit.steps])
    tensor = fit.tensors[name]
    v = fitted.T @ torch.from_numpy(tensor.u[:, 0]) / tensor.sigma[0]
    np.testing.assert_allclose(series.coefficient, (all_deltas @ v).numpy(), rtol=1e-4, atol=1e-9)
    assert series.observed.tolist() == [s <= OBSERVE_UNTIL for s in STEPS]
    predicted = fit.model.predict(tensor.temporal[0], np.array(STEPS[-1:], dtype=float))
    assert abs(predicted[0] - series.coefficient[-1]) < 0.1 * abs(series.coefficient[-1])  # planted line extrapolates


def test_variance_rewards_and_accuracy_figures(run_parts, tmp_path):
    root, run = run_parts
    assert cli("plot", "variance", run / "fit", "--out", tmp_path / "v.png") == 0
    write_log(tmp_path / "log.jsonl")
    assert cli("plot", "rewards", tmp_path, "--out", tmp_path / "r.png") == 0
    fake_run = tmp_path / "RUN"
    summary = write_eval_summary(fake_run)
    assert cli("plot", "accuracy", summary, "--out", tmp_path / "a.png") == 0
    for name in ("v.png", "r.png", "a.png"):
        assert_png_has_content(tmp_path / name)


def test_accuracy_points_take_step_and_series_from_the_checkpoint(tmp_path):
    from relex.plot import BASE, REAL, read_accuracy_points

    summary = write_eval_summary(tmp_path / "RUN")
    points = {(p.series, p.step): p for p in read_accuracy_points([summary])}
    assert set(points) == {(BASE, 0), (REAL, 40), ("relex", 40), ("relex", 80), ("two-point", 40), ("two-point", 80)}
    assert points[("relex", 80)].observed_until == OBSERVE_UNTIL
    with pytest.raises(RelexError, match="no such evaluation summary"):
        read_accuracy_points([tmp_path / "missing.json"])


def test_moving_average():
    from relex.plot import moving_average

    np.testing.assert_allclose(moving_average(np.array([1.0, 2, 3, 4]), 2), [1, 1.5, 2.5, 3.5])


# ---- report -------------------------------------------------------------------------------------------------------
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def linked_files(report: Path) -> list[Path]:
    return [report.parent / link for link in IMAGE_LINK.findall(report.read_text())]


def test_report_links_every_figure_it_names(run_parts, tmp_path):
    import shutil

    root, planted_run = run_parts
    run = tmp_path / "RUN"
    shutil.copytree(planted_run, run)
    (run / "config.yaml").write_text("task: {source: reasoning_gym, name: chain_sum}\n")
    write_log(run / "log.jsonl")
    assert cli("backtest", run / "trajectory", "--observe-until", OBSERVE_UNTIL, "--out", run / "backtest.json") == 0
    write_eval_summary(run)
    assert cli("report", run) == 0
    report = run / "report.md"
    text = report.read_text()
    for heading in ("## Configuration", "## Training rewards", "## Trajectory fit", "## Backtest", "## Evaluation"):
        assert heading in text
    files = linked_files(report)
    assert sorted(f.name for f in files) == ["accuracy.png", "rewards.png", "trajectory.png", "variance.png"]
    for file in files:
        assert_png_has_content(file)
    assert "| extrapolated/step-80 | relex | 80 |" in text
    assert "_No " not in text


def test_report_of_a_partial_run_names_what_is_missing(tmp_path):
    run = tmp_path / "RUN"
    run.mkdir()
    write_log(run / "log.jsonl")
    out = tmp_path / "elsewhere" / "r.md"
    assert cli("report", run, "--out", out) == 0
    text = out.read_text()
    assert "relex fit" in text and "relex backtest" in text and "relex eval" in text
    assert [f.name for f in linked_files(out)] == ["rewards.png"] and all(f.is_file() for f in linked_files(out))
    assert cli("report", tmp_path / "nothing") == 2


# ---- sweep --------------------------------------------------------------------------------------------------------
TASK = {"source": "reasoning_gym", "name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
        "train_size": 50, "eval_size": 40}


def test_validation_problems_differ_from_the_test_problems():
    from relex.sweep import validation_task
    from relex.tasks import EVAL, load_task

    validation = validation_task(TASK, 30).rows(EVAL)
    test = {row["question"] for row in load_task(TASK).rows(EVAL)}
    assert len(validation) == 30 and not test & {row["question"] for row in validation}


class AnswerFirst:
    """Answers the first `right` problems of the validation split correctly and the others wrongly."""

    def __init__(self, gold: dict[str, str], right: int):
        self.gold, self.right = gold, right

    def generate(self, prompts, *, samples, temperature, seed):
        from relex.evaluate.generate import Completion

        answers = [self.gold[p[-1]["content"]] if i < self.right else "-1" for i, p in enumerate(prompts)]
        return [[Completion(f"\\boxed{{{a}}}", 3)] for a in answers]

    def close(self):
        pass


def test_sweep_recommends_the_best_target_and_says_when_it_is_not_significant(run_parts, tmp_path):
    from relex.fit import FitConfig
    from relex.sweep import SweepConfig, sweep, validation_task
    from relex.tasks import EVAL

    _, run = run_parts
    n = 30
    rows = validation_task(TASK, n).rows(EVAL)
    gold = {row["prompt"][-1]["content"]: row["answer"] for row in rows}
    right = {"base": 12, "@": 12, "step-20": 14, "step-40": 29, "step-80": 13}

    @contextmanager
    def factory(checkpoint):
        key = next((k for k in ("step-20", "step-40", "step-80", "@") if k in checkpoint), "base")
        yield AnswerFirst(gold, right[key])

    config = SweepConfig(targets=[20, 40, 80], task=TASK, n=n, fit=FitConfig(observe_until=OBSERVE_UNTIL))
    result = sweep(run / "trajectory", tmp_path / "sweep", config, generator_factory=factory)
    assert result.best_target == 40 and result.last_step == OBSERVE_UNTIL
    assert result.versus_base.significant and result.versus_last.significant
    assert "significantly better than the base and than the last observed step 13" in result.verdict()
    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert saved["best_target"] == 40 and (tmp_path / "sweep" / "checkpoints" / "step-80" / "relex.json").is_file()
    assert (tmp_path / "sweep" / "validation" / "summary.json").is_file()

    right["step-40"] = 12  # the best (step 20) is now 2 of 30 problems ahead of both references: not significant
    config.overwrite = True
    result = sweep(run / "trajectory", tmp_path / "sweep", config, generator_factory=factory)
    assert result.best_target == 20 and "NOT significantly better than the base or the last observed step 13" in result.verdict()


def test_an_interrupted_sweep_leaves_the_old_output_and_overwrite_spares_the_store(run_parts, tmp_path):
    from relex.errors import RelexError
    from relex.fit import FitConfig
    from relex.sweep import SweepConfig, sweep

    _, run = run_parts
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text("earlier")

    @contextmanager
    def failing(checkpoint):
        raise RuntimeError("interrupted")
        yield

    config = SweepConfig(targets=[20], task=TASK, n=4, fit=FitConfig(observe_until=OBSERVE_UNTIL), overwrite=True)
    with pytest.raises(RuntimeError, match="interrupted"):
        sweep(run / "trajectory", out, config, generator_factory=failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"] and (out / "sweep.json").read_text() == "earlier"
    with pytest.raises(RelexError, match="lies inside the input"):
        sweep(run / "trajectory", run / "trajectory" / "sweep", config, generator_factory=failing)
    assert not (run / "trajectory" / "sweep").exists()
