"""relex train: configs/tiny.yaml end to end, resuming, config validation, and (slow) the embedded SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from relex.cli import main
from relex.store import TrajectoryStore
from relex.train import load_config
from relex.train.config import TrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "tiny.yaml"


def log_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), "--no-progress"]) == 0
    return run


def test_tiny_run_records_every_step(tiny_run):
    store = TrajectoryStore.open(tiny_run / "trajectory")
    assert store.steps == [1, 2, 3]
    assert [e.source_dtype for e in store.entries] == ["float32"] * 3
    reader = store.reader()
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        assert (reader.read(name).abs().sum(dim=1) > 0).all(), name
    assert store.base_dir.resolve() == (tiny_run / "model").resolve()


def test_tiny_run_logs_a_reward_for_every_step(tiny_run):
    lines = log_lines(tiny_run)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert isinstance(line["reward"], float) and line["recorded"] and line["step_seconds"] > 0
        assert set(line["rewards"]) == {"reasoning_gym_reward", "format_reward"}
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["recorded_steps"] == [1, 2, 3] and summary["recording"]["records"] == 3


def test_tiny_run_config_is_resolved_and_loadable(tiny_run):
    config = TrainConfig.from_dict(yaml.safe_load((tiny_run / "config.yaml").read_text()))
    assert config.grpo["bf16"] is False and config.grpo["gradient_checkpointing"] is False
    assert config.grpo["max_steps"] == 3 and config.record.every == 1


def test_fit_accepts_the_store(tiny_run, tmp_path):
    assert main(["fit", str(tiny_run / "trajectory"), "--out", str(tmp_path / "fit"), "--device", "cpu"]) == 0
    assert (tmp_path / "fit").is_dir()


def test_an_existing_run_is_refused_without_resume(tiny_run, capsys):
    assert main(["train", "--config", str(TINY), "--out", str(tiny_run), "--no-progress"]) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_resume_continues_without_duplicate_or_gap(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), "--max-steps", "2", "--no-progress"]) == 0
    assert TrajectoryStore.open(run / "trajectory").steps == [1, 2]
    first = TrajectoryStore.open(run / "trajectory").reader([2]).read("model.norm.weight")
    assert main(["train", "--config", str(TINY), "--out", str(run), "--resume", "--no-progress"]) == 0
    store = TrajectoryStore.open(run / "trajectory")
    assert store.steps == [1, 2, 3]
    assert torch.equal(store.reader([2]).read("model.norm.weight"), first)  # earlier steps untouched
    assert [line["step"] for line in log_lines(run)] == [1, 2, 3]


def test_resume_refuses_a_changed_config(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), "--max-steps", "1", "--no-progress"]) == 0
    assert main(["train", "--config", str(TINY), "--out", str(run), "--resume", "--record-every", "2"]) == 2
    assert "record.every" in capsys.readouterr().err


def write_config(tmp_path: Path, change) -> Path:
    data = yaml.safe_load(TINY.read_text())
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda d: d.update(modle="x"), "'modle'"),
        (lambda d: d["grpo"].update(learning_rat=1e-3), "'learning_rat'"),
        (lambda d: d["grpo"].update(output_dir="x"), "'output_dir'"),
        (lambda d: d["record"].update(evry=2), "'evry'"),
        (lambda d: d["task"].update(name="chain_summ"), "chain_summ"),
        (lambda d: d["task"].update(source="nowhere"), "nowhere"),
        (lambda d: d.update(reward={"verifier": "mathh"}), "mathh"),
        (lambda d: d.update(model="./no/such/model"), "no/such/model"),
        (lambda d: d.update(model={"tiny": {"hidden": 8}}), "'hidden'"),
        (lambda d: d["record"].update(every=0), "record.every"),
    ],
)
def test_bad_config_fails_before_training(tmp_path, capsys, change, named):
    out = tmp_path / "out"
    assert main(["train", "--config", str(write_config(tmp_path, change)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not out.exists()  # nothing was trained or written


def test_flags_override_the_file():
    config = load_config(TINY, out="elsewhere", max_steps=7, record_every=2)
    assert config.out == "elsewhere" and config.grpo["max_steps"] == 7
    assert config.record.every == 2 and config.grpo_options()["bf16"] is False


def test_shipped_configs_load():
    for path in sorted(CONFIGS.glob("*.yaml")):
        load_config(path)


@pytest.mark.slow
def test_embedded_model_trains_two_steps(tmp_path):
    from relex.train import run_training

    config = load_config(CONFIGS / "smollm2-arithmetic.yaml", out=tmp_path / "run", max_steps=2)
    # the demo's recipe with fewer, shorter rollouts, so that two steps take about a minute on a CPU
    config.grpo.update(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_completion_length=16)
    run = run_training(config, show_progress=False)
    store = TrajectoryStore.open(run / "trajectory")
    assert store.steps == [2]
    assert not (run / "trajectory" / "base").exists()  # the cached embedded folder is the base
    assert [line["step"] for line in log_lines(run)] == [1, 2]
    assert store.reader().read("model.layers.0.self_attn.q_proj.weight").abs().sum() > 0
