"""Hostile or corrupt files end in one line naming the file: safetensors headers (with a seeded fuzz loop), indexes,
manifests, step folder names, config.json; and outputs that overflow their dtype are refused."""

from __future__ import annotations

import copy
import json
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader
from relex.io.safetensors_file import SafetensorsFile
from relex.synthetic import write_planted_run
from tests.conftest import cli, make_base
from tests.test_bad_input import run_fails

TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.arange(6, dtype=torch.bfloat16).reshape(6),
    "c": torch.arange(4, dtype=torch.int64).reshape(2, 2),
}


def valid_file(path: Path) -> tuple[dict, bytes]:
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_with_header(path: Path, header, data: bytes) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def offsets(header, name):
    return header[name]["data_offsets"]


CASES = {
    "overlapping offsets": lambda h: h["b"].__setitem__("data_offsets", [offsets(h, "a")[0], offsets(h, "a")[0] + 12]),
    "negative offset": lambda h: h["a"].__setitem__("data_offsets", [-8, offsets(h, "a")[1] - 8]),
    "reversed offsets": lambda h: h["a"].__setitem__("data_offsets", offsets(h, "a")[::-1]),
    "wrong size": lambda h: h["a"].__setitem__("shape", [3, 5]),
    "string offsets": lambda h: h["a"].__setitem__("data_offsets", ["0", "48"]),
    "missing offsets": lambda h: h["a"].pop("data_offsets"),
    "bool shape": lambda h: h["a"].__setitem__("shape", [True, 12]),
    "negative shape": lambda h: h["a"].__setitem__("shape", [-3, -4]),
    "10^12 elements": lambda h: h["a"].__setitem__("shape", [10**6, 10**6]),
    "unknown dtype": lambda h: h["a"].__setitem__("dtype", "F128"),
    "entry is a list": lambda h: h.__setitem__("a", [1, 2]),
    "metadata is a list": lambda h: h.__setitem__("__metadata__", ["x"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_header_mutations_are_refused(tmp_path, case):
    header, data = valid_file(tmp_path / "ok.safetensors")
    CASES[case](header)
    path = write_with_header(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(RelexError, match="bad.safetensors"):
        SafetensorsFile(path)


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b"null", b"{", b'{"a": 1, "a": 2}', b"\xff\xfe"])
def test_header_that_is_not_an_object(tmp_path, header):
    _, data = valid_file(tmp_path / "ok.safetensors")
    with pytest.raises(RelexError, match="bad.safetensors"):
        SafetensorsFile(write_with_header(tmp_path / "bad.safetensors", header, data))


def test_bytes_after_the_last_tensor_are_refused(tmp_path):
    header, data = valid_file(tmp_path / "ok.safetensors")
    with pytest.raises(RelexError, match="describes"):
        SafetensorsFile(write_with_header(tmp_path / "bad.safetensors", header, data + b"\0" * 8))


def test_a_hostile_header_is_one_line_from_the_cli(planted, tmp_path, capsys):
    base, run, _ = planted
    path = run / "checkpoint-4" / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    first, second = [n for n in header if n != "__metadata__"][:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]  # one tensor reading another's bytes
    write_with_header(path, header, raw[8 + length :])
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert "checkpoint-4/model.safetensors" in message


def mutate(header: dict, rng: random.Random) -> dict | bytes:
    """One random change of a valid header: a field's value, type or presence, or the raw bytes."""
    header = copy.deepcopy(header)
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    field = rng.choice(["dtype", "shape", "data_offsets"])
    values = [
        -1, 0, 1, 2, 3, 4, 7, 8, 12, 24, 48, 2**31, 2**63, 10**12, -(2**63), 1.5, "8", None, True, [], {},
        "F32", "BF16", "I64", "F16", "U8", "BOOL", "F64", "X",
    ]
    kind = rng.randrange(9)
    if kind == 0:
        header[name].pop(field, None)
    elif kind == 1:
        header[name][field] = rng.choice(values)
    elif kind == 2 and field != "dtype":
        header[name][field] = [rng.choice(values) for _ in range(rng.randrange(4))]
    elif kind == 3:
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + rng.randint(-16, 16), end + rng.randint(-16, 16)]
    elif kind == 4:
        header[name]["shape"] = [max(0, d + rng.randint(-2, 2)) for d in header[name]["shape"]]
    elif kind == 5:
        other = rng.choice(names)
        header[name]["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], header[name]["data_offsets"]
    elif kind == 6:
        header[rng.choice(["__metadata__", name, "new"])] = rng.choice(values)
    elif kind == 7:
        raw = bytearray(json.dumps(header).encode())
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    else:
        header[name]["dtype"] = rng.choice(["F32", "BF16", "I64", "F16", "U8", "BOOL", "F64"])
    return header


def library_reads(path: Path) -> dict[str, torch.Tensor] | None:
    try:
        with safe_open(str(path), "pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception:  # whatever the safetensors library refuses
        return None


def test_fuzzed_headers_read_cleanly_or_fail_in_one_line(tmp_path):
    header, data = valid_file(tmp_path / "ok.safetensors")
    rng = random.Random(11)
    accepted = refused = 0
    for i in range(3000):
        path = write_with_header(tmp_path / f"fuzz-{i}.safetensors", mutate(header, rng), data)
        try:
            file = SafetensorsFile(path)
            ours = {name: file.read(name) for name in file.keys()}
            file.close()
        except RelexError:
            refused += 1
            path.unlink()
            continue
        accepted += 1
        theirs = library_reads(path)
        assert theirs is not None, f"mutation {i}: relex read a file the safetensors library refuses"
        assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours), f"mutation {i}"
        path.unlink()  # a new name each time: truncating one file over and over is slow on some file systems
    print(f"fuzz: {accepted} accepted, {refused} refused")
    assert refused > 2000 and accepted > 50  # the loop exercised both outcomes


# ---- indexes, manifests, folder names, config.json --------------------------------------------------------------------
def sharded(tmp_path) -> Path:
    base = make_base(tmp_path / "base")
    write_planted_run(base, tmp_path / "run", [5], shards=2)
    return tmp_path / "run" / "checkpoint-5"


@pytest.mark.parametrize("index", [[], "text", {"weight_map": []}, {"metadata": {}}])
def test_index_that_is_not_an_object(tmp_path, index):
    folder = sharded(tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RelexError, match="not a safetensors index"):
        CheckpointReader(folder)


@pytest.mark.parametrize("target", ["../../secret.safetensors", "/etc/passwd", "config.json", "sub/../../x.safetensors"])
def test_index_pointing_outside_its_folder(tmp_path, target):
    folder = sharded(tmp_path)
    (tmp_path / "secret.safetensors").write_text("SECRET-BYTES")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = target
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RelexError, match="inside the folder") as error:
        CheckpointReader(folder)
    assert "SECRET" not in str(error.value)


@pytest.fixture
def store(planted, tmp_path):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    return tmp_path / "store"


MANIFEST_CASES = {
    "unknown dtype": lambda m: m["tensors"][next(iter(m["tensors"]))].__setitem__("dtype", "float128"),
    "duplicate steps": lambda m: m["steps"].insert(1, dict(m["steps"][0])),
    "unsorted steps": lambda m: m["steps"].reverse(),
    "negative step": lambda m: m["steps"][0].__setitem__("step", -2),
    "string step": lambda m: m["steps"][0].__setitem__("step", "2"),
    "huge step": lambda m: m["steps"][-1].__setitem__("step", 10**30),
    "not an object": lambda m: m.clear() or m.__setitem__("format", ["x"]),
    "delta outside": lambda m: m["steps"][0].update(kind="delta", path="../../etc/passwd"),
    "unknown field": lambda m: m["steps"][0].__setitem__("extra", 1),
    "tie to nothing": lambda m: m["tied"].__setitem__("lm_head.weight", "no.such.tensor"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_invalid_manifest(store, tmp_path, capsys, case):
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    MANIFEST_CASES[case](manifest)
    path.write_text(json.dumps(manifest))
    message = run_fails(capsys, "fit", store, "--out", tmp_path / "fit", out=tmp_path / "fit")
    assert "manifest.json" in message


def test_manifest_that_is_a_list(store, tmp_path, capsys):
    (store / "manifest.json").write_text("[]")
    assert "not an object" in run_fails(capsys, "fit", store, "--out", tmp_path / "fit")


@pytest.mark.parametrize("name", ["checkpoint-١٢", "checkpoint-" + "9" * 30, "global_step_" + "1" * 20])
def test_step_folder_names(planted, tmp_path, capsys, name):
    base, run, _ = planted
    (run / "checkpoint-2").rename(run / name)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert name[:20] in message


@pytest.mark.parametrize("steps", ["١,2,3", "1," + "9" * 30])
def test_steps_option_digits(planted, tmp_path, capsys, steps):
    base, run, _ = planted
    folders = [run / "checkpoint-2", run / "checkpoint-4", run / "checkpoint-6"][: len(steps.split(","))]
    run_fails(capsys, "ingest", *folders, "--steps", steps, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")


@pytest.mark.parametrize("config", ["{not json", "[]", "null"])
def test_invalid_base_config(planted, tmp_path, capsys, config):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    (base / "config.json").write_text(config)
    message = run_fails(capsys, "ingest", run, "--base", base, "--out", tmp_path / "s", out=tmp_path / "s")
    assert "config.json" in message
    message = run_fails(capsys, "extrapolate", tmp_path / "store", "--targets", "40", "--out", tmp_path / "o", out=tmp_path / "o")
    assert "config.json" in message


def test_fp16_overflow_is_refused(store, tmp_path, capsys):
    message = run_fails(
        capsys, "extrapolate", store, "--targets", "300000000", "--dtype", "fp16", "--out", tmp_path / "o", out=tmp_path / "o"
    )
    assert "overflow float16" in message and "300000000" in message and "tensor " in message
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".o")] == []
