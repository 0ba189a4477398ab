"""scripts/bench_fit.py's own check: what `relex extrapolate` wrote, against RELEX in float64 from the checkpoints.

The benchmark reports its figures and this check in one run (issue 14's goal: equal to a float64 computation within
1e-4). The check must pass on relex's output and must fail on an output that is wrong in one tensor; the whole
benchmark runs on a tiny shape in a slow test.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from relex.synthetic import write_planted_run
from tests.conftest import cli

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_fit.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_fit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def extrapolated(tiny_base, tmp_path):
    """A planted verl run at steps 2, 4, 6, 8 ingested in place and extrapolated to steps 16 and 40."""
    run, store, out = tmp_path / "run", tmp_path / "store", tmp_path / "out"
    write_planted_run(tiny_base, run, [2, 4, 6, 8], layout="verl", noise=0.05)
    assert cli("ingest", run, "--base", tiny_base, "--out", store) == 0
    assert cli("extrapolate", store, "--targets", "16,40", "--out", out) == 0
    return tiny_base, run, out


def test_the_check_passes_on_what_relex_wrote(bench, extrapolated):
    base, run, out = extrapolated
    check = bench.phase_check(str(run), str(base), str(out), "16", "40")
    assert check["tensors"] == len(load_file(str(base / "model.safetensors")))
    assert set(check["worst"]) == {"16", "40"}
    assert all(error <= 1e-4 for error in check["worst"].values()), check
    assert all(loss > 0 for loss in check["format"].values())  # the float32 output format's own rounding


def test_the_check_fails_on_one_wrong_tensor(bench, extrapolated):
    base, run, out = extrapolated
    path = out / "step-40" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.weight"
    theta0 = load_file(str(base / "model.safetensors"))[name]
    tensors[name] = theta0 + (tensors[name] - theta0) * 1.01  # the predicted delta 1% too long
    save_file(tensors, str(path), metadata={"format": "pt"})
    check = bench.phase_check(str(run), str(base), str(out), "16", "40")
    assert check["worst"]["16"] <= 1e-4
    assert check["worst"]["40"] == pytest.approx(0.01, rel=0.05)


def test_the_products_phase_forms_both_products_from_every_stored_value_once(bench, tiny_base, tmp_path):
    """The pass reduced to its reads and products: as many values as a plain read of the store, nothing written."""
    run, store = tmp_path / "run", tmp_path / "store"
    write_planted_run(tiny_base, run, [2, 4, 6, 8], layout="verl", noise=0.05)
    assert cli("ingest", run, "--base", tiny_base, "--out", store, "--copy") == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    products = bench.phase_products(str(store), "cpu", "auto")
    assert products["values"] == bench.phase_read(str(store), "auto")["values"] > 0
    assert products["seconds"] > 0
    assert bench.phase_products(str(store), "cpu", "auto", "blocks")["values"] == products["values"]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "fp16"])
def test_the_benchmark_runs_end_to_end_on_a_tiny_shape(tmp_path, dtype):
    out = subprocess.run([sys.executable, str(SCRIPT), "--layout", "verl", "--shape", "tiny", "--steps", "4", "--repeats", "1",
                          "--dtype", dtype, "--workdir", str(tmp_path / "bench")], check=True, capture_output=True, text=True).stdout
    assert f"T=4 {dtype} checkpoints + base" in out
    assert "(ingest + fit + extrapolate) / read, from the page cache" in out
    assert "fit + extrapolate / read, copied store, page cache" in out
    assert "its reads, Gram and W · M alone / read, copied store" in out
    assert "the same read in blocks / read by the kernels" in out
    assert "referenced: read in blocks / read by the kernels" in out and f"on the {dtype} checkpoints" in out
    assert "as a user runs them" in out and "relex ingest" in out and "× the read" in out
    checks = [line for line in out.splitlines() if line.strip().startswith("step ")]
    assert len(checks) == 4, out  # two targets, two ways
    if dtype == "float32":  # the issue's goal is for float32 checkpoints; fp16's own rounding is printed beside
        assert all("goal <= 1e-4: met" in line for line in checks), out
    else:
        assert all("fp16 itself loses up to" in line and "goal" not in line for line in checks), out
