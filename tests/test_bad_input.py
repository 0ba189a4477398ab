"""Bad input ends with one line naming the file, tensor or step at fault, a non-zero exit, and no output left."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import cli


def run_fails(capsys, *args, out=None):
    code = cli(*args)
    # a progress bar an earlier test left open draws with cursor movements: keep what follows the last of them
    err = [re.split(r"\r|\x1b\[A", line)[-1].strip() for line in capsys.readouterr().err.strip().splitlines()]
    assert code != 0
    assert err and err[-1].startswith("relex"), err
    assert "Traceback" not in "\n".join(err)
    if out is not None:
        assert not out.exists(), f"{out} left behind"
    return err[-1]


def edit(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture
def store(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    return tmp_path / "store"


def test_shape_differs(planted, tmp_path, capsys):
    base, run, _ = planted
    name = "model.layers.1.mlp.up_proj.weight"
    edit(run / "checkpoint-9", lambda t: t.__setitem__(name, t[name][:-1]))
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert name in message and "checkpoint-9" in message and "(63, 32)" in message


def test_tensor_missing(planted, tmp_path, capsys):
    base, run, _ = planted
    name = "model.layers.0.self_attn.k_proj.weight"
    edit(run / "checkpoint-4", lambda t: t.pop(name))
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert name in message and "checkpoint-4" in message and "missing" in message


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_or_inf_refused_at_ingest_with_verify(planted, tmp_path, capsys, value):
    base, run, _ = planted
    name = "model.layers.1.self_attn.v_proj.weight"

    def poison(t):
        t[name][3, 4] = value

    edit(run / "checkpoint-13", poison)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", "--verify", out=tmp_path / "s")
    assert name in message and "step 13" in message and "NaN or Inf" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_verify_scans_each_dtype_and_refuses_only_non_finite_values(tmp_path, dtype):
    """`--verify` sums each tensor in float32 and looks value by value only when the sum is not finite: values
    whose sum overflows are accepted, one NaN or Inf among them is named, and tensors of integers are skipped."""
    from relex.errors import RelexError
    from relex.ingest import Checkpoint, ValueScan
    from relex.io.checkpoint import CheckpointReader

    big = torch.finfo(dtype).max
    tensors = {
        "a.weight": torch.full((64, 8), big, dtype=dtype),  # finite; in float32 and bf16 their sum overflows
        "b.weight": torch.randn(5, dtype=torch.float32).to(dtype),
        "c.positions": torch.arange(7, dtype=torch.int64),
        "d.scalar": torch.tensor(2.0, dtype=dtype),
    }
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    checkpoint = Checkpoint(step=3, folder=folder, layout="plain")
    scan = ValueScan()
    with CheckpointReader(folder) as reader:
        scan(reader, checkpoint, sorted(tensors))
    for value in (math.nan, math.inf, -math.inf):
        tensors["a.weight"][63, 7] = value
        save_file(tensors, str(folder / "model.safetensors"))
        with CheckpointReader(folder) as reader, pytest.raises(RelexError, match="step 3.*tensor a.weight has NaN or Inf"):
            scan(reader, checkpoint, sorted(tensors))  # the buffer of the earlier scans, reused
        tensors["a.weight"][63, 7] = big


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "command",
    [["fit"], ["extrapolate", "--targets", "50"], ["extrapolate", "--targets", "50", "--method", "two-point"],
     ["extrapolate", "--targets", "50", "--fit", "FIT"], ["backtest", "--observe-until", "13"]],
    ids=["fit", "extrapolate", "two-point", "saved-fit", "backtest"],
)
def test_nan_or_inf_ingested_without_verify_is_refused_by_the_pass(planted, tmp_path, capsys, value, command):
    """Ingest reads headers only; the pass that reads the values names the tensor and step, writing nothing."""
    base, run, _ = planted
    store, fit = tmp_path / "store", tmp_path / "fit"
    assert cli("ingest", run, "--base", base, "--out", store) == 0
    assert cli("fit", store, "--out", fit) == 0  # before the damage: a saved fit lets extrapolate skip the Gram
    name = "model.layers.1.self_attn.v_proj.weight"
    edit(run / "checkpoint-13", lambda t: t[name].__setitem__((3, 4), value))
    out = tmp_path / "o"
    args = [str(fit) if a == "FIT" else a for a in command]
    message = run_fails(capsys, args[0], store, *args[1:], "--out", out, out=out)
    assert message.count("\n") == 0 and name in message and "NaN or Inf at step 13" in message


def test_nan_ingested_without_verify_is_refused_by_the_trajectory_plot(planted, tmp_path, capsys):
    base, run, _ = planted
    store, fit = tmp_path / "store", tmp_path / "fit"
    assert cli("ingest", run, "--base", base, "--out", store) == 0
    assert cli("fit", store, "--out", fit) == 0
    name = "model.layers.1.self_attn.v_proj.weight"
    edit(run / "checkpoint-13", lambda t: t[name].__setitem__((3, 4), math.nan))
    out = tmp_path / "trajectory.png"
    message = run_fails(capsys, "plot", "trajectory", store, "--fit", fit, "--tensors", name, "--out", out, out=out)
    assert name in message and "NaN or Inf at step 13" in message


def test_ingest_without_verify_scans_no_values(planted, tmp_path, monkeypatch):
    """Without --verify ingest reads headers; the only values it reads are first rows (and equal tensors whole) to
    find ties, a small part of the run, where a scan reads every byte."""
    from relex.io.safetensors_file import SafetensorsFile

    base, run, _ = planted
    original, read = SafetensorsFile.read_into, []

    def counted(self, name, out, rows=None):
        read.append(out.numel() * out.element_size())
        return original(self, name, out, rows)

    monkeypatch.setattr(SafetensorsFile, "read_into", counted)
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    stored = sum(f.stat().st_size for root in (base, run) for f in Path(root).rglob("*.safetensors"))
    assert sum(read) < stored / 10, (sum(read), stored)


def test_nan_in_a_referenced_checkpoint_changed_after_ingest(planted, store, tmp_path, capsys):
    _, run, _ = planted
    name = "model.norm.weight"
    edit(run / "checkpoint-6", lambda t: t[name].__setitem__(0, math.nan))
    message = run_fails(capsys, "extrapolate", store, "--targets", "50", "--out", tmp_path / "o", out=tmp_path / "o")
    assert name in message and "step 6" in message


@pytest.mark.parametrize("command", ["fit", "extrapolate"])
def test_a_referenced_checkpoint_deleted_after_ingest(planted, store, tmp_path, capsys, command):
    _, run, _ = planted
    shutil.rmtree(run / "checkpoint-9")
    args = ["--targets", "50"] if command == "extrapolate" else []
    message = run_fails(capsys, command, store, *args, "--out", tmp_path / "o", out=tmp_path / "o")
    assert "checkpoint-9" in message


@pytest.mark.parametrize("command", ["fit", "extrapolate", "backtest"])
@pytest.mark.parametrize(
    "damage,words",
    [
        ("cut short", "corrupt or truncated safetensors file"),
        ("a tensor's shape", "shape (31,) at step 9, (32,) at base"),
        ("saved again in bf16", "step 9's weights are bfloat16 now, float32 when it was ingested"),
    ],
    ids=["cut-short", "shape", "bf16"],
)
def test_a_referenced_checkpoint_changed_after_ingest(planted, store, tmp_path, capsys, command, damage, words):
    _, run, _ = planted
    path = run / "checkpoint-9" / "model.safetensors"
    if damage == "cut short":
        path.write_bytes(path.read_bytes()[:-4096])
    elif damage == "a tensor's shape":
        edit(path.parent, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"][:-1].clone()))
    else:
        edit(path.parent, lambda t: t.update({name: values.bfloat16() for name, values in t.items()}))
    args = {"extrapolate": ["--targets", "50"], "backtest": ["--observe-until", "13"]}.get(command, [])
    out = tmp_path / ("o.json" if command == "backtest" else "o")
    message = run_fails(capsys, command, store, *args, "--out", out, out=out)
    assert "checkpoint-9" in message and words in message
    if damage != "cut short":
        assert "changed after ingest" in message


def test_a_full_disk_while_writing_leaves_nothing(store, tmp_path, capsys, monkeypatch):
    from relex.io.stream_writer import StreamingSafetensorsWriter

    original, calls = StreamingSafetensorsWriter.write, []

    def full_disk(self, name, values):
        calls.append(name)
        if len(calls) == 7:
            raise OSError(28, "No space left on device")
        original(self, name, values)

    monkeypatch.setattr(StreamingSafetensorsWriter, "write", full_disk)
    out = tmp_path / "o"
    message = run_fails(capsys, "extrapolate", store, "--targets", "30,40", "--out", out, out=out)
    assert str(out) in message and "No space left on device" in message
    monkeypatch.setattr(StreamingSafetensorsWriter, "write", original)  # with room again, the same job succeeds
    assert cli("extrapolate", store, "--targets", "30,40", "--out", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fit", "step-30", "step-40"]


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(planted, tmp_path, capsys, damage):
    base, run, _ = planted
    path = run / "checkpoint-20" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00" * 64)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert "checkpoint-20" in message


def test_pickled_bin_is_refused(planted, tmp_path, capsys):
    base, run, _ = planted
    folder = run / "checkpoint-2"
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert "pytorch_model.bin" in message and "checkpoint-2" in message


@pytest.mark.parametrize("steps,words", [("5,5,9", "twice"), ("9,5,12", "must increase"), ("5,x,9", "cannot read"), ("5,9", "3 checkpoint")])
def test_steps_given_by_hand(planted, tmp_path, capsys, steps, words):
    base, run, _ = planted
    folders = [run / f"checkpoint-{s}" for s in (2, 4, 6)]
    message = run_fails(capsys, "ingest", *folders, "--steps", steps, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert words in message


def test_no_step_numbers_for_plain_folders(planted, tmp_path, capsys):
    base, run, _ = planted
    plain = tmp_path / "plain"
    (run / "checkpoint-2").rename(plain)
    message = run_fails(capsys, "ingest", plain, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert "--steps" in message


def test_too_few_steps_and_too_much_rank(store, tmp_path, capsys):
    message = run_fails(capsys, "fit", store, "--out", tmp_path / "f", "--observe-until", "2", out=tmp_path / "f")
    assert "at least 2" in message
    message = run_fails(capsys, "fit", store, "--out", tmp_path / "f", "--rank", "9", out=tmp_path / "f")
    assert "rank 9" in message and "there are 7" in message
    message = run_fails(capsys, "extrapolate", store, "--targets", "50", "--out", tmp_path / "o", "--observe-until", "2", out=tmp_path / "o")
    assert "at least 2" in message


@pytest.mark.parametrize(
    "option,value,words",
    [("--method", "magic", "reconstruct, relex, relex-anchored, two-point"), ("--temporal", "cubic", "linear, poly, robust"), ("--targets", "50,abc", "cannot read targets"),
     ("--targets", "-5", "positive"), ("--dtype", "fp8", "valid:"), ("--max-shard-size", "lots", "cannot read size")],
)
def test_unknown_names_and_unparsable_values(store, tmp_path, capsys, option, value, words):
    args = {"--targets": "50", option: value}
    flat = [x for kv in args.items() for x in kv]
    message = run_fails(capsys, "extrapolate", store, *flat, "--out", tmp_path / "o", out=tmp_path / "o")
    assert words in message


def test_reconstruct_needs_an_observed_step(store, tmp_path, capsys):
    message = run_fails(capsys, "extrapolate", store, "--targets", "7", "--method", "reconstruct", "--out", tmp_path / "o", out=tmp_path / "o")
    assert "step 7 is not an observed step" in message


def test_existing_output_is_refused_unless_overwrite(store, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    message = run_fails(capsys, "extrapolate", store, "--targets", "50", "--out", out)
    assert "--overwrite" in message and (out / "keep.txt").exists()
    assert cli("extrapolate", store, "--targets", "50", "--out", out, "--overwrite") == 0
    assert (out / "step-50" / "model.safetensors").is_file()
    message = run_fails(capsys, "fit", store, "--out", out)
    assert "--overwrite" in message
    message = run_fails(capsys, "ingest", tmp_path / "run", "--base", tmp_path / "base", "--out", store)
    assert "--overwrite" in message


def test_interpolation_is_allowed_but_said(store, tmp_path, caplog):
    assert cli("extrapolate", store, "--targets", "10", "--out", tmp_path / "o") == 0
    assert "interpolation" in caplog.text and "target 10" in caplog.text


def test_store_step_that_does_not_exist(store, tmp_path):
    from relex.errors import RelexError
    from relex.extrapolate import materialize_step

    with pytest.raises(RelexError, match="step 999 is not in the store"):
        materialize_step(store, 999, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_not_a_store(tmp_path, capsys):
    message = run_fails(capsys, "fit", tmp_path, "--out", tmp_path / "f", out=tmp_path / "f")
    assert "not a relex trajectory store" in message
