"""The science: planted rank-1 trajectories are recovered, and every method equals an independent computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from relex.extrapolate import ExtrapolateConfig, extrapolate_store
from relex.fit import FitConfig, FitResult, fit_store
from relex.fit import gram as gram_module
from relex.fit.passes import tensor_gram
from tests.conftest import STEPS, cli

OBSERVED = [s for s in STEPS if s <= 13]


def trajectory64(base, run, steps, name):
    """M (T × d) in float64, read independently of relex's reader."""
    theta0 = load_file(str(base / "model.safetensors"))[name].double().reshape(-1)
    rows = [load_file(str(run / f"checkpoint-{s}" / "model.safetensors"))[name].double().reshape(-1) - theta0 for s in steps]
    return theta0, torch.stack(rows)


def relex64(m: torch.Tensor, steps, target, rank=1):
    """RELEX computed another way: a float64 SVD of M, a least-squares line per coefficient."""
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    coefficients = (u * s)[:, :rank].numpy()
    predicted = [np.polyval(np.polyfit(np.asarray(steps, float), coefficients[:, j], 1), target) for j in range(rank)]
    return sum(float(predicted[j]) * vh[j] for j in range(rank))


def test_fit_recovers_planted_direction_and_line(planted, store):
    _, _, truth = planted
    fit = fit_store(store, FitConfig(observe_until=13))
    assert fit.steps.tolist() == OBSERVED
    reader = store.reader(OBSERVED)
    for name, direction in truth.directions.items():
        m = reader.read(name).double()
        v = m.T @ torch.from_numpy(fit.tensors[name].u[:, 0]) / fit.tensors[name].sigma[0]
        cos = float(torch.dot(v, direction) / v.norm())
        assert abs(cos) >= 0.99, (name, cos)
        assert fit.tensors[name].explained_variance(1) > 0.99
        assert fit.tensors[name].r2[0] > 0.99


def test_prediction_of_held_out_step(planted, store, tmp_path):
    base, run, _ = planted
    extrapolate_store(store, tmp_path / "out", ExtrapolateConfig(targets=[30], fit=FitConfig(observe_until=13)))
    out = load_file(str(tmp_path / "out" / "step-30" / "model.safetensors"))
    real = load_file(str(run / "checkpoint-30" / "model.safetensors"))
    theta0 = load_file(str(base / "model.safetensors"))
    err = sum(float((out[n].double() - real[n].double()).pow(2).sum()) for n in real)
    norm = sum(float((real[n].double() - theta0[n].double()).pow(2).sum()) for n in real)
    assert (err / norm) ** 0.5 < 0.05  # planted noise is 2% of each delta


def test_chunked_gram_equals_unchunked(store):
    reader = store.reader()
    for name in store.trajectory_names:
        whole = tensor_gram(reader, name, torch.device("cpu"), max_elements=10**9)
        chunked = tensor_gram(reader, name, torch.device("cpu"), max_elements=7 * len(store.steps))
        np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=0)  # float32 products, float64 sums


def test_a_fit_is_the_same_to_the_bit_with_any_number_of_threads(store, monkeypatch):
    """In a pass each block's Gram is formed by the reader thread (one thread) or the caller (torch's threads less
    one), whichever is free, so its bits must not depend on the thread count. Parts of 64 columns split this
    store's tensors as a model's large ones are."""
    monkeypatch.setattr(gram_module, "PART_COLUMNS", 64)
    before = torch.get_num_threads()
    try:
        fits = []
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            fits.append(fit_store(store, FitConfig(rank=1)))
    finally:
        torch.set_num_threads(before)
    assert any(store.tensors[n].numel > 3 * 64 for n in store.trajectory_names)  # split into several parts
    for fit in fits[1:]:
        for name in store.trajectory_names:
            assert np.array_equal(fit.grams[name], fits[0].grams[name]), name


# small blocks, read twice (from the page cache, when the kept blocks would not reuse their buffer enough) or with
# their first blocks kept for the sums (direct reads keep them)
@pytest.mark.parametrize("chunk,io,reuse", [(10**9, "auto", None), (300, "cached", 10**9), (300, "direct", None)])
def test_weighted_sum_equals_direct_svd(planted, store, tmp_path, chunk, io, reuse, monkeypatch):
    base, run, _ = planted
    if reuse is not None:
        monkeypatch.setattr("relex.fit.passes.KEEP_REUSE", reuse)
    config = ExtrapolateConfig(targets=[20, 60], fit=FitConfig(observe_until=13, chunk_elements=chunk, io=io), cache_elements=chunk)
    extrapolate_store(store, tmp_path / "out", config)
    for target in (20, 60):
        out = load_file(str(tmp_path / "out" / f"step-{target}" / "model.safetensors"))
        for name in store.trajectory_names:
            theta0, m = trajectory64(base, run, OBSERVED, name)
            expected = theta0 + relex64(m, OBSERVED, target)
            delta = expected - theta0
            error = float((out[name].double().reshape(-1) - expected).norm() / delta.norm())
            assert error <= 1e-4, (target, name, error)


def test_rank2_and_saved_fit_give_the_same_checkpoint(planted, store, tmp_path):
    base, run, _ = planted
    fit = fit_store(store, FitConfig(rank=2, observe_until=13))
    fit.save(tmp_path / "fit")
    loaded = FitResult.load(tmp_path / "fit")
    extrapolate_store(store, tmp_path / "a", ExtrapolateConfig(targets=[40]), fit=loaded)
    extrapolate_store(store, tmp_path / "b", ExtrapolateConfig(targets=[40], fit=FitConfig(rank=2, observe_until=13)))
    a = load_file(str(tmp_path / "a" / "step-40" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "step-40" / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    theta0, m = trajectory64(base, run, OBSERVED, name)
    expected = theta0 + relex64(m, OBSERVED, 40, rank=2)
    assert float((a[name].double().reshape(-1) - expected).norm() / (expected - theta0).norm()) <= 1e-4
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


def test_baselines_equal_independent_formulas(planted, store, tmp_path):
    base, run, _ = planted
    name = "model.layers.1.self_attn.q_proj.weight"
    theta0, m = trajectory64(base, run, OBSERVED, name)
    fit = FitConfig(observe_until=13)
    # two-point through the base and step 13, and through steps 4 and 13
    extrapolate_store(store, tmp_path / "tp", ExtrapolateConfig(targets=[50], method="two-point", fit=fit))
    got = load_file(str(tmp_path / "tp" / "step-50" / "model.safetensors"))[name].double().reshape(-1)
    torch.testing.assert_close(got, theta0 + (50 / 13) * m[-1], rtol=1e-5, atol=1e-6)
    extrapolate_store(store, tmp_path / "tp2", ExtrapolateConfig(targets=[50], method="two-point", fit=fit, anchors=(4, 13)))
    got = load_file(str(tmp_path / "tp2" / "step-50" / "model.safetensors"))[name].double().reshape(-1)
    alpha = (50 - 4) / (13 - 4)
    torch.testing.assert_close(got, theta0 + m[1] + alpha * (m[-1] - m[1]), rtol=1e-5, atol=1e-6)
    provenance = json.loads((tmp_path / "tp2" / "step-50" / "relex.json").read_text())
    assert provenance["anchors"] == [4, 13]  # the method's own anchors; a method without them records null
    # per-parameter least squares
    extrapolate_store(store, tmp_path / "pp", ExtrapolateConfig(targets=[50], method="per-param", fit=fit))
    got = load_file(str(tmp_path / "pp" / "step-50" / "model.safetensors"))[name].double().reshape(-1)
    slope, intercept = np.polyfit(np.asarray(OBSERVED, float), m.numpy(), 1)
    torch.testing.assert_close(got, theta0 + torch.from_numpy(slope * 50 + intercept), rtol=1e-5, atol=1e-6)
    # reconstruction of an observed step is the rank-1 projection; "observed" is the real checkpoint
    extrapolate_store(store, tmp_path / "rc", ExtrapolateConfig(targets=[9], method="reconstruct", fit=fit))
    got = load_file(str(tmp_path / "rc" / "step-9" / "model.safetensors"))[name].double().reshape(-1)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    torch.testing.assert_close(got, theta0 + (m[3] @ vh[0]) * vh[0], rtol=1e-5, atol=1e-6)
    extrapolate_store(store, tmp_path / "ob", ExtrapolateConfig(targets=[20], method="observed"))
    got = load_file(str(tmp_path / "ob" / "step-20" / "model.safetensors"))
    real = load_file(str(run / "checkpoint-20" / "model.safetensors"))
    for key in real:  # θ₀ + (θ_s − θ₀) in float32: equal up to one rounding
        torch.testing.assert_close(got[key], real[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("temporal", ["poly", "robust"])
def test_other_temporal_models(store, tmp_path, temporal):
    fit = fit_store(store, FitConfig(temporal=temporal, observe_until=13))
    assert all(t.r2[0] > 0.99 for t in fit.tensors.values())
    reports = extrapolate_store(store, tmp_path / "o", ExtrapolateConfig(targets=[30], fit=FitConfig(temporal=temporal, observe_until=13)))
    assert reports[0].path.is_dir()


def test_window_uses_last_steps(store):
    fit = fit_store(store, FitConfig(window=3, observe_until=13))
    name = store.trajectory_names[0]
    assert fit.steps[fit.tensors[name].window].tolist() == [6, 9, 13]


def test_backtest_errors_match_written_checkpoints(planted, store, tmp_path):
    from relex.backtest import backtest_store

    base, run, _ = planted
    result = backtest_store(store, 13, ["relex", "two-point", "per-param"], FitConfig())
    assert result.later == [20, 30]
    for method in ("relex", "two-point"):
        extrapolate_store(store, tmp_path / method, ExtrapolateConfig(targets=[30], method=method, fit=FitConfig(observe_until=13)))
        out = load_file(str(tmp_path / method / "step-30" / "model.safetensors"))
        real = load_file(str(run / "checkpoint-30" / "model.safetensors"))
        theta0 = load_file(str(base / "model.safetensors"))
        err = sum(float((out[n].double() - real[n].double()).pow(2).sum()) for n in store.trajectory_names)
        norm = sum(float((real[n].double() - theta0[n].double()).pow(2).sum()) for n in store.trajectory_names)
        assert result.relative_error(method, 30) == pytest.approx((err / norm) ** 0.5, rel=1e-3)
    assert result.relative_error("relex", 30) < result.relative_error("two-point", 30)
    assert min(result.drift.values()) > 0.99  # one planted direction throughout


def test_zero_and_frozen_tensors_keep_base_values(tiny_base, tmp_path):
    from relex.synthetic import write_planted_run

    run = tmp_path / "run"
    write_planted_run(tiny_base, run, [1, 2, 3])
    frozen = "model.norm.weight"
    theta0 = load_file(str(tiny_base / "model.safetensors"))
    for step in (1, 2, 3):  # freeze one tensor: its trajectory is all zero
        path = run / f"checkpoint-{step}" / "model.safetensors"
        tensors = load_file(str(path))
        tensors[frozen] = theta0[frozen].clone()
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    assert cli("ingest", run, "--base", tiny_base, "--out", tmp_path / "s") == 0
    assert cli("extrapolate", tmp_path / "s", "--targets", "10", "--out", tmp_path / "o") == 0
    out = load_file(str(tmp_path / "o" / "step-10" / "model.safetensors"))
    assert torch.equal(out[frozen], theta0[frozen])
    summary = json.loads((tmp_path / "o" / "step-10" / "relex.json").read_text())
    assert summary["fit_summary"]["tensors"] == len(theta0) and summary["anchors"] is None  # relex draws no line through anchors


@pytest.mark.parametrize("method", ["reconstruct", "observed"])
def test_backtest_refuses_methods_that_do_not_extrapolate(store, method):
    from relex.backtest import backtest_store
    from relex.errors import RelexError

    with pytest.raises(RelexError, match=f"method '{method}' predicts observed steps only"):
        backtest_store(store, 13, ["relex", method], FitConfig())


def test_refit_and_backtest_reuse_the_gram(store, tmp_path):
    from relex.backtest import backtest_store
    from relex.fit import refit

    full = fit_store(store, FitConfig(rank=1))
    full.save(tmp_path / "full")
    again = refit(store, FitConfig(rank=2, temporal="poly"), tmp_path / "full")
    direct = fit_store(store, FitConfig(rank=2, temporal="poly"))
    for name in store.trajectory_names:
        np.testing.assert_allclose(abs(again.tensors[name].u), abs(direct.tensors[name].u), rtol=1e-6, atol=1e-9)
    a = backtest_store(store, 13, ["relex", "per-param"], FitConfig(), grams=full.grams)
    b = backtest_store(store, 13, ["relex", "per-param"], FitConfig())
    assert a.relative_error("relex", 30) == pytest.approx(b.relative_error("relex", 30), rel=1e-9)
    assert cli("fit", store.path, "--out", tmp_path / "r4", "--rank", "4", "--gram-from", tmp_path / "full") == 0
    assert cli("fit", store.path, "--out", tmp_path / "bad", "--observe-until", "13", "--gram-from", tmp_path / "full") != 0


def test_backtest_out_is_replaced_whole_and_never_a_folder_or_the_store(store, tmp_path, capsys):
    out = tmp_path / "backtest.json"
    out.write_text("earlier")
    assert cli("backtest", store.path, "--observe-until", "13", "--out", out) == 0
    assert json.loads(out.read_text())["observed_steps"] == [s for s in STEPS if s <= 13]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file, no lock
    capsys.readouterr()
    (tmp_path / "folder").mkdir()
    for bad, words in ((tmp_path / "folder", "is a folder"), (store.path / "backtest.json", "lies inside the input")):
        assert cli("backtest", store.path, "--observe-until", "13", "--out", bad) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (store.path / "backtest.json").exists() and list((tmp_path / "folder").iterdir()) == []


def test_written_checkpoints_equal_the_states_kept_in_memory_with_reused_output_memory(planted, tmp_path, monkeypatch):
    """extrapolate_store reuses its outputs' memory once the writer thread has written them (pooled here down to
    the smallest product, with the writer slowed so that products wait); extrapolate_states keeps new memory per
    output. Both write the same bits, aliases of a tensor included."""
    import time

    import relex.extrapolate.extrapolate as extrapolate_module
    from relex.extrapolate import extrapolate_states
    from relex.fit.passes import ProductBuffers
    from relex.io.checkpoint import CheckpointReader
    from relex.io.stream_writer import StreamingSafetensorsWriter
    from relex.store import TrajectoryStore

    base, run, _ = planted
    canonical, aliases = "model.norm.weight", ["model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
    store = TrajectoryStore.create(tmp_path / "store", base_dir=base, tensors=CheckpointReader(base).infos(),
                                   tied={a: canonical for a in aliases})
    for step in STEPS[:6]:
        store.append_checkpoint(step, run / f"checkpoint-{step}", torch.float32)
    pools: list[ProductBuffers] = []

    def pooled():
        pools.append(ProductBuffers(smallest=1))
        return pools[-1]

    real_write = StreamingSafetensorsWriter.write

    def slow_write(self, name, values):
        time.sleep(0.001)
        real_write(self, name, values)

    monkeypatch.setattr(extrapolate_module, "ProductBuffers", pooled)
    monkeypatch.setattr(StreamingSafetensorsWriter, "write", slow_write)
    config = ExtrapolateConfig(targets=[20, 40], fit=FitConfig(chunk_elements=6 * 40), cache_elements=6 * 100)
    extrapolate_store(store, tmp_path / "out", config)
    assert len(pools) == 1 and pools[0].held == 0 and pools[0]._free  # reused, and every hold let go
    _, states = extrapolate_states(store, config)
    for target, state in zip((20, 40), states):
        written = load_file(str(tmp_path / "out" / f"step-{target}" / "model.safetensors"))
        assert set(written) == set(state)
        for name, values in state.items():
            assert torch.equal(written[name], values), (target, name)
        assert all(torch.equal(written[a], written[canonical]) for a in aliases)


def test_narrow_outputs_are_the_float32_outputs_rounded_and_checked_only_when_not_shown_finite(store, tmp_path, monkeypatch):
    """A bf16 checkpoint is the float32 one rounded, its rounding loss as reported, and a float64 one the float32
    one widened; a block shown finite is not scanned again (relex.extrapolate.extrapolate._Pass.combine): in
    float32 by the sum the pass formed with it, in another dtype by a finite sum of its rounding errors' squares;
    an fp16 output that overflows still is scanned, and is refused."""
    import relex.extrapolate.extrapolate as extrapolate_module

    scanned = []
    real_check = extrapolate_module.check_finite
    monkeypatch.setattr(extrapolate_module, "check_finite", lambda name, values, target: scanned.append(name) or real_check(name, values, target))
    wide = extrapolate_store(store, tmp_path / "f32", ExtrapolateConfig(targets=[40], dtype="float32"))
    assert not set(store.trajectory_names) & set(scanned)  # float32 outputs: shown finite by the pass's sums
    scanned.clear()
    narrow = extrapolate_store(store, tmp_path / "bf16", ExtrapolateConfig(targets=[40], dtype="bf16"))
    assert not set(store.trajectory_names) & set(scanned)
    f32, bf16 = (load_file(str(tmp_path / out / "step-40" / "model.safetensors")) for out in ("f32", "bf16"))
    lost_sq = pred_sq = 0.0
    for name in store.trajectory_names:
        assert torch.equal(bf16[name], f32[name].to(torch.bfloat16)), name
        lost_sq += float((bf16[name].double() - f32[name].double()).pow(2).sum())
    theta0 = load_file(str(store.base_dir / "model.safetensors"))
    pred_sq = sum(float((f32[n].double() - theta0[n].double()).pow(2).sum()) for n in store.trajectory_names)
    assert narrow[0].rounding_loss == pytest.approx((lost_sq / pred_sq) ** 0.5, rel=1e-3)
    assert wide[0].rounding_loss == 0.0
    scanned.clear()
    extrapolate_store(store, tmp_path / "f64", ExtrapolateConfig(targets=[40], dtype="float64"))
    assert not set(store.trajectory_names) & set(scanned)
    f64 = load_file(str(tmp_path / "f64" / "step-40" / "model.safetensors"))
    assert all(torch.equal(f64[name], f32[name].double()) for name in store.trajectory_names)
    with pytest.raises(Exception, match="overflow float16"):
        extrapolate_store(store, tmp_path / "fp16", ExtrapolateConfig(targets=[300_000_000], dtype="fp16"))
