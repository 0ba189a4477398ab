"""relex accelerate: the train → jump → train loop on configs/tiny.yaml, its guard, optimizer policies, resume,
bad input; and the baselines it shares with relex extrapolate (--scale, --keep, relex-anchored) against closed forms."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from relex.accelerate import AccelerateConfig, run_accelerate
from relex.accelerate.decision import ROLLBACK, Candidate, confirm, decide
from relex.accelerate.loop import read_jumps
from relex.accelerate.optimizer import apply_policy
from relex.accelerate.validation import read_folder, split_confirmation, validation_split
from relex.errors import RelexError
from relex.extrapolate import ExtrapolateConfig, extrapolate_states, extrapolate_store
from relex.fit import FitConfig, FitResult
from relex.store import TrajectoryStore
from relex.sweep import validation_task
from relex.train import load_config
from tests.conftest import cli
from tests.test_fit_extrapolate import OBSERVED, relex64, trajectory64

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def scorer_preferring(candidates: bool):
    """An injected validation scorer: every jump candidate scores 1 and the current weights 0, or the other way round;
    the rollback candidate (offered by default) scores as the current weights, a tie the guard never takes."""
    calls = []

    def score(model, tokenizer, states, restore):
        calls.append(list(states))
        return {name: [float((name != "current" and not name.startswith("rollback")) == candidates)] * 20 for name in states}

    score.calls = calls
    return score


def accelerate_run(tmp_path, scorer, *, max_steps=3, name="run", resume=False, **overrides):
    config = load_config(TINY, out=tmp_path / name, max_steps=max_steps)
    data = {**config.accelerate, "keep_candidates": True, **overrides}
    return run_accelerate(config, AccelerateConfig.from_dict(data), resume=resume, show_progress=False, scorer=scorer)


def tensors_of_store_step(store: TrajectoryStore, step: int) -> dict[str, torch.Tensor]:
    """θ_base + Δ_step of every trajectory tensor of a store (step 0: the base)."""
    base = {}
    for shard in store.base_dir.glob("*.safetensors"):
        base.update(load_file(str(shard)))
    if step == 0:
        return {n: base[n] for n in store.trajectory_names}
    reader = store.reader([step])
    return {n: base[n] + reader.read(n).reshape(base[n].shape) for n in store.trajectory_names}


@pytest.mark.parametrize("policy", ["keep", "reset", "rescale"])
def test_two_segments_with_a_jump(tmp_path, policy):
    scorer = scorer_preferring(candidates=True)
    run = accelerate_run(tmp_path, scorer, optimizer=policy)
    jumps = read_jumps(run)
    assert [j["step"] for j in jumps] == [2, 3]
    first = jumps[0]
    assert first["jumped"] and first["optimizer"] == policy
    # 2 methods × 2 horizons and the way back, scored with the current weights; a tie between candidates goes to
    # the farthest target
    assert len(first["candidates"]) == 5 and len(scorer.calls[0]) == 6 and scorer.calls[0][-1] == "rollback to step 0"
    assert first["chosen"]["target"] == 4 and first["virtual_step_after"] == 4
    assert jumps[1]["reason"] == "the segment has 1 step; a fit needs 2; best candidate (rollback to step 2) gains +0.000 < +0.010"
    assert set(first["seconds"]) == {"fit", "candidates", "validation", "policy"}
    # the second segment starts from the chosen candidate's weights, and its store says so
    second = TrajectoryStore.open(run / "segments" / "001")
    origin = second.manifest["created_by"]["origin"]
    assert origin["jump"] and origin["target"] == 4 and second.manifest["created_by"]["segment_start_step"] == 2
    chosen = read_folder(first["chosen"]["path"])
    for name, value in tensors_of_store_step(second, 0).items():
        torch.testing.assert_close(value, chosen[name], rtol=0, atol=0)
    assert [line["step"] for line in map(json.loads, (run / "log.jsonl").read_text().splitlines())] == [1, 2, 3]
    summary = json.loads((run / "accelerate-summary.json").read_text())
    assert summary["grpo_steps"] == 3 and summary["jumps"] == 1 and summary["virtual_steps"] == 5
    assert (run / "final" / "config.json").is_file()


def test_the_guard_forbids_a_jump_that_scores_worse(tmp_path):
    run = accelerate_run(tmp_path, scorer_preferring(candidates=False), rollback=False)
    first = read_jumps(run)[0]
    assert not first["jumped"] and "gains -1.000" in first["reason"]
    assert first["validation_accuracy_after"] == first["validation_accuracy_before"] == 1.0
    # training went on from the real weights of step 2
    first_store, second = (TrajectoryStore.open(run / "segments" / name) for name in ("000", "001"))
    real = tensors_of_store_step(first_store, 2)
    for name, value in tensors_of_store_step(second, 0).items():
        torch.testing.assert_close(value, real[name], rtol=0, atol=1e-7)
    assert not second.manifest["created_by"]["origin"]["jump"]


def test_resume_across_a_jump(tmp_path):
    scorer = scorer_preferring(candidates=True)
    run = accelerate_run(tmp_path, scorer, max_steps=2)
    assert [j["step"] for j in read_jumps(run)] == [2] and (run / "checkpoints" / "checkpoint-2").is_dir()
    accelerate_run(tmp_path, scorer, max_steps=4, resume=True)
    jumps = read_jumps(run)
    assert [j["step"] for j in jumps] == [2, 4] and all(j["jumped"] for j in jumps)
    lines = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4]
    second = TrajectoryStore.open(run / "segments" / "001")
    assert second.steps == [1, 2] and second.manifest["created_by"]["segment_start_step"] == 2


@pytest.mark.parametrize("confirmed", [True, False])
def test_a_picked_candidate_jumps_only_when_fresh_problems_confirm_it(tmp_path, confirmed):
    scorer = scorer_preferring(candidates=True)
    confirmer = scorer_preferring(candidates=confirmed)
    config = load_config(TINY, out=tmp_path / "run", max_steps=3)
    run = run_accelerate(config, AccelerateConfig.from_dict(config.accelerate), show_progress=False, scorer=scorer,
                         confirmer=confirmer)
    first = read_jumps(run)[0]
    # only the current weights and the picked candidate are scored again, and only when the guard picked one
    farthest = {c["name"] for c in first["candidates"] if c["target"] == 4}
    assert len(confirmer.calls) == 1 and confirmer.calls[0][0] == "current" and confirmer.calls[0][1] in farthest
    confirmation = first["confirmation"]
    assert confirmation["n"] == 20 and confirmation["jump"] is confirmed and first["jumped"] is confirmed
    if confirmed:
        assert confirmation["diff"] == 1.0 and first["virtual_step_after"] == 4
    else:
        assert "; confirmation: gains -1.000 < +0.010 on 20 fresh problems" in first["reason"]
        assert first["chosen"] is None and first["virtual_step_after"] == 2
        assert not TrajectoryStore.open(run / "segments" / "001").manifest["created_by"]["origin"]["jump"]
    summary = json.loads((run / "accelerate-summary.json").read_text())
    assert summary["validation_generations"] == 20 * 6 + 2 * 20 + 2 * 20  # pick: 6 states; confirm: 2; last decision: 2


def test_confirm_is_the_guard_on_fresh_problems():
    chosen = Candidate("relex", 2.0, 1.0, 8)
    passed = confirm(chosen, [1.0] * 30 + [0.0] * 10, [1.0] * 20 + [0.0] * 20, margin=0.05, min_gain=0.01)
    assert passed.jump and passed.diff == pytest.approx(0.25) and passed.accuracy == 0.75 and passed.n == 40
    tied = confirm(chosen, [1.0, 0.0] * 20, [1.0, 0.0] * 20, margin=0.05, min_gain=0.01)
    assert not tied.jump and "gains +0.000 < +0.010 on 40 fresh problems" == tied.reason
    noisy = confirm(chosen, [1.0, 0.0, 0.0, 1.0] * 10, [0.0, 1.0, 0.0, 1.0] * 10, margin=0.0, min_gain=-1.0)
    assert not noisy.jump and noisy.reason.startswith("may lose up to")


def test_the_confirmation_problems_are_the_validation_draw_after_the_first_n():
    config = load_config(TINY)
    drawn = validation_task(config.task, 30)
    pick, fresh = split_confirmation(drawn, 20)
    questions = [r["question"] for r in drawn.rows("eval")]
    assert [r["question"] for r in pick.rows("eval")] == questions[:20]
    assert [r["question"] for r in fresh.rows("eval")] == questions[20:]
    assert pick.verifier == fresh.verifier == drawn.verifier


def test_the_readme_command_runs_with_real_validation(tmp_path):
    run = tmp_path / "run"
    assert cli("accelerate", "--config", TINY, "--out", run, "--no-progress") == 0
    jumps = read_jumps(run)
    assert len(jumps) == 2 and jumps[0]["validation_n"] == 20
    assert len(list((run / "segments").iterdir())) >= 2
    assert not (run / "jumps" / "000" / "candidates").exists()  # scored, then removed
    lines = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert all("reward_slope" in line for line in lines) and lines[0]["reward_slope"] is None  # the train-log warning
    assert cli("plot", "jumps", run, "--out", tmp_path / "jumps.png") == 0 and (tmp_path / "jumps.png").stat().st_size > 0
    assert cli("report", run) == 0
    report = (run / "report.md").read_text()
    assert "## Accelerated training" in report and "| 2 |" in report and (run / "figures" / "jumps.png").is_file()
    assert re.search(r"3 GRPO steps, \d+ jumps? and \d+ rollbacks? in 2 decisions", report)


def test_the_early_warning_stops_the_jump_before_any_candidate_is_written(tmp_path):
    scorer = scorer_preferring(candidates=True)
    run = accelerate_run(tmp_path, scorer, warning={"min_reward_slope": 1e9, "reward_window": 2})
    first = read_jumps(run)[0]
    assert not first["jumped"] and first["reason"].startswith("linearity warning: the reward stopped rising")
    assert [c["name"] for c in first["candidates"]] == ["rollback to step 0"]  # the way back is still judged
    assert scorer.calls[0] == ["current", "rollback to step 0"] and not (run / "jumps" / "000" / "candidates").exists()
    assert first["signals"]["raised"] and first["signals"]["explained_variance"] is not None


def test_warning_signals_against_thresholds():
    from relex.accelerate.config import WarningConfig
    from relex.accelerate.warning import Signals, check, reward_slope

    assert reward_slope([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.1)
    assert reward_slope([0.5]) is None and reward_slope([0.1, 0.2, 0.3]) is None  # fewer than the window: no signal
    config = WarningConfig()
    assert not check(Signals(reward_slope=0.01, explained_variance=0.9, r2=0.9, cosine=0.5), config).raised
    reasons = check(Signals(reward_slope=-0.01, explained_variance=0.3, r2=0.2, cosine=-0.1), config).reasons
    assert len(reasons) == 4
    assert not check(Signals(reward_slope=-1.0), WarningConfig(enabled=False)).raised


# ---- the guard ------------------------------------------------------------------------------------------------------
def candidate(correct, target=4):
    c = Candidate("relex-anchored", target / 2, 1.0, target)
    c.correct, c.accuracy = correct, float(np.mean(correct))
    return c


def test_decide_is_a_paired_non_inferiority_test():
    current = [1.0] * 40 + [0.0] * 24
    better = candidate([1.0] * 46 + [0.0] * 18)  # six more problems right, none lost
    assert decide([better], current, margin=0.05, min_gain=0.0).jump
    noisy = candidate([0.0] * 10 + [1.0] * 30 + [1.0] * 10 + [0.0] * 14)  # +10 and −10: equal mean, wide interval
    decision = decide([noisy], current, margin=0.05, min_gain=0.0)
    assert not decision.jump and "may lose" in decision.reason
    assert not decide([better], current, margin=0.05, min_gain=0.2).jump


def rollback_candidate(correct, start=4):
    c = Candidate(ROLLBACK, 0.0, 1.0, start)
    c.correct, c.accuracy = correct, float(np.mean(correct))
    return c


def test_a_rollback_is_picked_by_the_guard_and_must_lie_above_zero_where_nothing_confirms_it():
    current = [1.0] * 8 + [0.0] * 56
    credible = rollback_candidate([1.0] * 15 + [0.0] * 49)  # seven more problems right, none lost
    taken = decide([credible, candidate(current)], current, margin=0.05, min_gain=0.01, confirmation_follows=False)
    assert taken.jump and taken.chosen.is_rollback and taken.chosen.ci_low > 0
    # +3 and −1: a gain of two problems, picked when fresh problems will confirm it, refused when none will
    noisy = rollback_candidate([0.0] + [1.0] * 7 + [1.0] * 3 + [0.0] * 53)
    assert decide([noisy], current, margin=0.05, min_gain=0.01).jump
    refused = decide([noisy], current, margin=0.05, min_gain=0.01, confirmation_follows=False)
    assert not refused.jump and "reaches zero; a rollback must lie above it" in refused.reason
    assert decide([candidate(noisy.correct, target=8)], current, margin=0.05, min_gain=0.01, confirmation_follows=False).jump


def test_a_rollback_is_confirmed_above_zero_too():
    current = [1.0] * 8 + [0.0] * 56
    noisy = [0.0] + [1.0] * 7 + [1.0] * 3 + [0.0] * 53
    assert confirm(candidate(noisy), noisy, current, margin=0.05, min_gain=0.01).jump
    refused = confirm(rollback_candidate(noisy), noisy, current, margin=0.05, min_gain=0.01)
    assert not refused.jump and refused.reason.endswith("a rollback must lie above it on 64 fresh problems")


# ---- optimizer policies -----------------------------------------------------------------------------------------------
def adam_with_state():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1, betas=(0.9, 0.99))
    for _ in range(2):
        param.grad = torch.tensor([1.0, -2.0, 3.0])
        optimizer.step()
    return param, optimizer


def test_optimizer_policies_against_closed_forms():
    param, optimizer = adam_with_state()
    before = {k: v.clone() for k, v in optimizer.state[param].items()}
    apply_policy(optimizer, "keep", 3)
    for key, value in optimizer.state[param].items():
        torch.testing.assert_close(value, before[key])
    apply_policy(optimizer, "rescale", 3)
    state = optimizer.state[param]
    torch.testing.assert_close(state["exp_avg"], before["exp_avg"] * 0.9**3)
    torch.testing.assert_close(state["exp_avg_sq"], before["exp_avg_sq"] * 0.99**3)
    assert float(state["step"]) == float(before["step"]) + 3
    apply_policy(optimizer, "reset", 3)
    assert not optimizer.state


# ---- bad input --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--segment-steps", "1"], "at least 2 GRPO steps"),
        (["--alphas", "1.0,2"], "each α must be > 1"),
        (["--scales", "0"], "each λ must be > 0"),
        (["--optimizer", "sgd"], "unknown policy 'sgd'"),
        (["--validation-size", "0"], "the validation split is empty"),
        (["--validation-size", "10", "--margin", "0.05"], "cannot resolve margin 0.05"),
        (["--keep", ","], "argument --keep: expected comma-separated str values, e.g. 1,2; got ','"),
        (["--confirm-size", "10"], "confirm_size 10 cannot resolve margin 0.05"),
        (["--methods", "observed"], "does not extrapolate"),
    ],
)
def test_bad_loop_settings_fail_in_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    assert cli("accelerate", "--config", TINY, "--out", run, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not run.exists()


def test_keep_naming_no_module_type_of_the_model_fails_at_the_first_jump(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli("accelerate", "--config", TINY, "--out", run, "--keep", "nothing_like_this") == 2
    assert "names no module type of this store" in capsys.readouterr().err


def test_a_validation_split_overlapping_train_is_refused():
    config = load_config(TINY)
    rows = validation_task(config.task, 20).rows("eval")
    with pytest.raises(RelexError, match="also occur in the train split"):
        validation_split(config.task, 20, train_rows=rows[:3])


# ---- the baselines, closed forms on planted data -------------------------------------------------------------------------
def read_out(folder: Path, name: str) -> torch.Tensor:
    return load_file(str(next(folder.glob("*.safetensors"))))[name].double().reshape(-1)


def test_scale_keep_and_anchored_equal_closed_forms(planted, store, tmp_path):
    base, run, _ = planted
    name, norm = "model.layers.1.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"
    theta0, m = trajectory64(base, run, OBSERVED, name)
    last = m[-1]
    fit = FitConfig(observe_until=OBSERVED[-1], device="cpu")
    outputs = {}
    for label, method, scale, keep in [("anchored", "relex-anchored", 1.0, ()), ("scaled", "relex", 0.4, ("*layernorm.weight",))]:
        config = ExtrapolateConfig(targets=[20, 30], method=method, fit=fit, scale=scale, keep=keep)
        extrapolate_store(store, tmp_path / label, config)
        outputs[label] = tmp_path / label
    for target in (20, 30):
        anchored = theta0 + last + relex64(m, OBSERVED, target) - relex64(m, OBSERVED, OBSERVED[-1])
        torch.testing.assert_close(read_out(outputs["anchored"] / f"step-{target}", name), anchored, rtol=0, atol=2e-6)
        scaled = theta0 + last + 0.4 * (relex64(m, OBSERVED, target) - last)
        torch.testing.assert_close(read_out(outputs["scaled"] / f"step-{target}", name), scaled, rtol=0, atol=2e-6)
        norm0, norm_m = trajectory64(base, run, OBSERVED, norm)
        torch.testing.assert_close(read_out(outputs["scaled"] / f"step-{target}", norm), norm0 + norm_m[-1], rtol=0, atol=1e-6)
    provenance = json.loads((outputs["scaled"] / "step-20" / "relex.json").read_text())
    assert provenance["scale"] == 0.4 and norm in provenance["kept"]


def test_candidates_formed_in_memory_equal_the_written_checkpoints(store, tmp_path):
    """extrapolate_states keeps what extrapolate_store writes, value for value, tied aliases and kept types included
    (small blocks: the pass reads the larger tensors in several, which are joined again)."""
    fit = FitConfig(observe_until=OBSERVED[-1], device="cpu", chunk_elements=2048)
    config = ExtrapolateConfig(targets=[20, 30], method="relex-anchored", fit=fit, scale=0.5,
                               keep=("*layernorm.weight",), cache_elements=4096, overwrite=True)
    written = extrapolate_store(store, tmp_path / "written", config)
    reports, states = extrapolate_states(store, config)
    assert [r.target for r in reports] == [20, 30]
    for report, state, on_disk in zip(reports, states, written):
        folder = read_folder(on_disk.path)
        assert set(state) == set(folder)
        for name, values in folder.items():
            torch.testing.assert_close(state[name], values, rtol=0, atol=0)
        assert report.delta_norm == pytest.approx(on_disk.delta_norm, rel=1e-12)


def test_the_loop_jumps_to_candidates_formed_in_memory(tmp_path):
    """Without keep_candidates no candidate is written; the run jumps to the same weights a written one holds."""
    run = accelerate_run(tmp_path, scorer_preferring(candidates=True), keep_candidates=False)
    first = read_jumps(run)[0]
    assert first["jumped"] and first["chosen"]["path"] is None and not (run / "jumps" / "000" / "candidates").exists()
    segment = TrajectoryStore.open(run / "segments" / "000")
    chosen = first["chosen"]
    config = ExtrapolateConfig(targets=[chosen["target"] - first["segment_start"]], method=chosen["method"],
                               scale=chosen["scale"])
    [written] = extrapolate_store(segment, tmp_path / "check", config, FitResult.load(run / "jumps" / "000" / "fit"))
    expected = read_folder(written.path)
    for name, value in tensors_of_store_step(TrajectoryStore.open(run / "segments" / "001"), 0).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_keep_naming_nothing_and_bad_scale_fail_in_one_line(store, tmp_path, capsys):
    store = store.path
    assert cli("extrapolate", store, "--targets", "20", "--out", tmp_path / "a", "--keep", "no_such_type") == 2
    assert "names no module type" in capsys.readouterr().err
    assert cli("extrapolate", store, "--targets", "20", "--out", tmp_path / "b", "--scale", "-1") == 2
    assert "--scale" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_task_with_fixed_splits_validates_on_problems_carved_from_train(tmp_path):
    from relex.tasks import TaskSpec, load_task

    path = tmp_path / "labelled.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "split": "train" if i < 40 else "eval"} for i in range(50)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = TaskSpec(source="jsonl", name=str(path))
    train = load_task(spec).rows("train")
    task = validation_split(spec, 10, train)
    questions = [r["question"] for r in task.rows("eval")]
    assert questions == [r["question"] for r in train[-10:]]
    with pytest.raises(RelexError, match="would leave too few"):
        validation_split(spec, 30, train)


@pytest.mark.parametrize(
    "settings, message",
    [({"confirm_size": -1}, "confirm_size: expected a non-negative integer"),
     ({"confirm_size": 10, "margin": 0.05}, "confirm_size 10 cannot resolve margin 0.05"),
     ({"confirm_size": "many"}, "confirm_size")],
)
def test_bad_confirmation_sizes_fail_in_one_line(settings, message):
    with pytest.raises(RelexError, match=message):
        AccelerateConfig.from_dict(settings)
    assert AccelerateConfig.from_dict({"confirm_size": 0}).confirm_size == 0  # 0: no confirmation


def test_several_processes_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = tmp_path / "run"
    assert cli("accelerate", "--config", TINY, "--out", run) == 2
    err = capsys.readouterr().err.strip()
    assert "relex accelerate runs in one process, not 2" in err and len(err.splitlines()) == 1
    assert not run.exists()


def scorer_preferring_rollback():
    """An injected validation scorer: the rollback candidate scores 1, the current weights and the jumps 0."""
    calls = []

    def score(model, tokenizer, states, restore):
        calls.append(list(states))
        return {name: [float(name.startswith("rollback"))] * 20 for name in states}

    score.calls = calls
    return score


def test_a_rollback_goes_back_to_the_weights_the_segment_started_from(tmp_path, monkeypatch):
    import relex.accelerate.loop as loop

    policies, apply = [], loop.apply_policy
    monkeypatch.setattr(loop, "apply_policy", lambda optimizer, policy, steps: policies.append((policy, steps)) or apply(optimizer, policy, steps))
    scorer = scorer_preferring_rollback()
    run = accelerate_run(tmp_path, scorer, max_steps=4, rollback=True, optimizer="keep")
    first, second = read_jumps(run)
    assert "rollback to step 0" in scorer.calls[0] and len(scorer.calls[0]) == 6  # current, 4 jumps, the way back
    assert first["jumped"] and first["chosen"]["method"] == "rollback" and first["chosen"]["target"] == 0
    assert first["reason"].startswith("rollback to step 0 gains +1.000")
    assert first["virtual_step_before"] == 2 and first["virtual_step_after"] == 0
    assert second["chosen"]["target"] == 2 and second["virtual_step_after"] == 0  # back to the start of segment 1
    assert policies == [("reset", -2), ("reset", -2)]  # the moments of the steps undone are dropped, whatever the policy
    # segment 1 starts from the weights segment 0 started from
    start, after = (TrajectoryStore.open(run / "segments" / name) for name in ("000", "001"))
    first_weights = tensors_of_store_step(start, 0)
    for name, value in tensors_of_store_step(after, 0).items():
        torch.testing.assert_close(value, first_weights[name], rtol=0, atol=0)
    from relex.present import jumps_table

    assert [row[1] for row in jumps_table(read_jumps(run)).rows] == ["rollback", "rollback"]
    summary = json.loads((run / "accelerate-summary.json").read_text())
    assert summary["rollbacks"] == 2 and summary["jumps"] == 0 and summary["virtual_steps"] == 0 and summary["grpo_steps"] == 4  # back at the start


def test_a_rollback_is_judged_when_the_warning_stops_the_jump(tmp_path):
    scorer = scorer_preferring(candidates=False)
    run = accelerate_run(tmp_path, scorer, rollback=True, warning={"min_reward_slope": 1e9, "reward_window": 2})
    first = read_jumps(run)[0]
    assert scorer.calls[0] == ["current", "rollback to step 0"]
    assert not first["jumped"] and first["reason"].startswith("linearity warning: the reward stopped rising")
    assert "best candidate (rollback to step 0) gains +0.000 < +0.010" in first["reason"]


def test_a_rollback_is_offered_by_default_and_not_without_jumps_or_when_switched_off(tmp_path):
    scorer = scorer_preferring(candidates=True)
    accelerate_run(tmp_path, scorer, name="default")
    assert all(call[-1].startswith("rollback to step") for call in scorer.calls)
    for name, overrides in (("plain", {"jump": False, "rollback": True}), ("off", {"rollback": False})):
        scorer = scorer_preferring(candidates=True)
        accelerate_run(tmp_path, scorer, name=name, **overrides)
        assert not any(state.startswith("rollback") for call in scorer.calls for state in call)


def test_rollback_must_be_true_or_false():
    with pytest.raises(RelexError, match="accelerate.rollback: expected true or false, got 'yes'"):
        AccelerateConfig.from_dict({"rollback": "yes"})


def test_resume_across_a_rollback(tmp_path):
    """The way back is the segment's base folder, which a resumed run reopens: nothing else has to be saved."""
    scorer = scorer_preferring_rollback()
    run = accelerate_run(tmp_path, scorer, max_steps=2, rollback=True)
    accelerate_run(tmp_path, scorer, max_steps=4, rollback=True, resume=True)
    jumps = read_jumps(run)
    assert [(j["step"], j["chosen"]["method"], j["chosen"]["target"]) for j in jumps] == [(2, "rollback", 0), (4, "rollback", 2)]
    start, after = (TrajectoryStore.open(run / "segments" / name) for name in ("000", "001"))
    first_weights = tensors_of_store_step(start, 0)
    for name, value in tensors_of_store_step(after, 0).items():
        torch.testing.assert_close(value, first_weights[name], rtol=0, atol=0)


def test_validation_leaves_the_training_rollouts_as_the_plain_run_draws_them(tmp_path):
    """A loop whose decisions all keep its weights (--no-jump) trains exactly as `relex train`: the validation
    generations, which seed torch's generator, must not reset the stream the next GRPO rollouts are sampled from."""
    assert cli("train", "--config", TINY, "--out", tmp_path / "plain", "--max-steps", "4") == 0
    assert cli("accelerate", "--config", TINY, "--out", tmp_path / "kept", "--max-steps", "4", "--no-jump", "--no-progress") == 0
    assert len(read_jumps(tmp_path / "kept")) == 2  # validation ran at steps 2 and 4

    def fingerprints(run):
        lines = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        return [(line["step"], line["reward"], line["loss"], line["grad_norm"]) for line in lines]

    plain, kept = fingerprints(tmp_path / "plain"), fingerprints(tmp_path / "kept")
    assert len(plain) == 4 and kept == plain
