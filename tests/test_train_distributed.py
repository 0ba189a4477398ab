"""relex train under `accelerate launch` with 2 CPU processes (DDP over gloo), and the refusal of DeepSpeed.

A 2-process run cannot equal a 1-process run value for value, even with the same global batch: TRL seeds each
process's sampling with its own seed (`set_seed(seed, device_specific=True)`, so that ranks do not draw the same
completions), and a batch of 8 completions draws other random numbers than the first 8 of a batch of 16. The
completions differ, so the rewards, advantages and updates differ. The tests therefore check what must hold: the
same steps, tensors and shapes as a 1-process run, finite non-zero deltas, one writer (each log line and step
once), and a store that is the trajectory the ranks trained (the final checkpoint is θ₀ + the last delta).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from relex.cli import main
from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader
from relex.record import DeltaRecorder, deepspeed_in_use
from relex.store import TrajectoryStore
from relex.train import load_config, run_training

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
TRACEBACK = f'File "{ROOT / "relex"}'  # a traceback line in relex's own code
STEPS = 2


def free_port() -> int:
    with socket.socket() as probe:  # accelerate's default port (29500) would collide with concurrent runs
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(*args, cwd: Path, monitor: float = 0.1) -> subprocess.CompletedProcess:
    """`accelerate launch` with 2 processes on the CPU (torchrun's launcher, relex selects gloo and use_cpu)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "--monitor_interval", str(monitor), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def config_file(folder: Path, per_device: int) -> Path:
    """configs/tiny.yaml for STEPS steps with `per_device` completions per process and step."""
    data = yaml.safe_load(TINY.read_text())
    data["grpo"].update(per_device_train_batch_size=per_device, max_steps=STEPS)
    path = folder / f"tiny-{per_device}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def relex_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("relex train: error:")]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    done = launch("-m", "relex", "train", "--config", config_file(folder, 8), "--out", folder / "run", "--no-progress",
                  cwd=folder)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder / "run", done


def test_two_processes_write_one_run(two_process_run):
    run, done = two_process_run
    assert done.stdout.count("run written to") == 1
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((run / "summary.json").read_text())["recorded_steps"] == [1, 2]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "log.jsonl", "model", "summary.json",
                                                     "trajectory"]
    assert not list(run.parent.glob(".run*"))  # no lock or temporary folder left beside the run
    checkpoint = run / "checkpoints" / f"checkpoint-{STEPS}"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}  # each rank's, for resuming


def test_two_processes_record_the_trajectory_they_train(two_process_run, tmp_path):
    run, _ = two_process_run
    store = TrajectoryStore.open(run / "trajectory")
    assert store.steps == [1, 2]
    single = run_training(load_config(config_file(tmp_path, 16), out=tmp_path / "one"), show_progress=False)
    alone = TrajectoryStore.open(single / "trajectory")
    assert alone.steps == store.steps
    assert {n: i.shape for n, i in store.tensors.items()} == {n: i.shape for n, i in alone.tensors.items()}
    assert store.trajectory_names == alone.trajectory_names
    deltas = CheckpointReader.from_file(store.path / store.entry(STEPS).path)
    theta0 = CheckpointReader(store.base_dir)
    final = load_file(str(run / "checkpoints" / f"checkpoint-{STEPS}" / "model.safetensors"))
    moved = 0.0
    for name in store.trajectory_names:
        delta = deltas.read(name)
        assert torch.isfinite(delta).all(), name
        moved += float(delta.norm())
        torch.testing.assert_close(theta0.read(name) + delta, final[name], rtol=0, atol=1e-6)
    assert moved > 0


FAILING = '''
import os, sys
from relex.errors import RelexError

if os.environ["RANK"] == sys.argv[1]:
    if sys.argv[2] == "disk":  # rank 0's disk fills up while it records step 1
        import relex.io.stream_writer

        def write(self, name, values):
            raise OSError(28, "No space left on device")

        relex.io.stream_writer.StreamingSafetensorsWriter.write = write
    else:  # this rank's reward function fails on its second call (step 2), while the other rank trains on
        import relex.train.grpo

        functions, calls = relex.train.grpo.reward_functions, []

        def reward_functions(config, verifier):
            def broken(completions, **columns):
                calls.append(1)
                if len(calls) == 2:
                    raise RelexError("the verifier broke")
                return first(completions, **columns)

            found = functions(config, verifier)
            first = found[0]
            return [broken, *found[1:]]

        relex.train.grpo.reward_functions = reward_functions
from relex.cli import main
sys.exit(main(sys.argv[3:]))
'''


def train_failing(tmp_path, rank: str, what: str):
    """`relex train` on 2 ranks with FAILING's fault `what` ("disk" or "reward") on `rank`: the finished launch
    (which must have failed) and the relex error lines it printed."""
    (tmp_path / "failing.py").write_text(FAILING)
    done = launch("failing.py", rank, what, "train", "--config", config_file(tmp_path, 8), "--out", tmp_path / "run",
                  "--no-progress", cwd=tmp_path, monitor=3)
    assert done.returncode != 0
    return done, relex_lines(done.stderr)


def test_a_failure_while_rank_0_records_ends_every_rank_with_the_same_line(tmp_path):
    done, lines = train_failing(tmp_path, "0", "disk")
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr[-4000:]
    assert "rank 0 of 2: recording step 1:" in lines[0] and "No space left on device" in lines[0]
    assert TRACEBACK not in done.stderr  # no traceback through relex's code on either rank
    assert TrajectoryStore.open(tmp_path / "run" / "trajectory").steps == []


def test_a_rank_that_fails_alone_ends_the_others_in_one_line(tmp_path):
    done, lines = train_failing(tmp_path, "1", "reward")
    assert lines and len(lines) <= 2, done.stderr[-4000:]
    assert "relex train: error: the verifier broke" in lines
    others = [line for line in lines if "the verifier broke" not in line]  # rank 0, unless the launcher killed it first
    assert all("rank 0 of 2: lost contact with another rank" in line or "rank 0 of 2: stopped by signal" in line
               for line in others), others
    assert TRACEBACK not in done.stderr
    assert TrajectoryStore.open(tmp_path / "run" / "trajectory").steps == [1]


# ---- DeepSpeed: refused in one line ---------------------------------------------------------------------------------
class DeepSpeedEngine(torch.nn.Module):
    """A stand-in for deepspeed.runtime.engine.DeepSpeedEngine (deepspeed is not installed here)."""

    __module__ = "deepspeed.runtime.engine"

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def begin(recorder: DeltaRecorder, model, args=None) -> None:
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, max_steps=3)
    recorder.on_train_begin(args, state, None, model=model)


def zero3_model() -> torch.nn.Module:
    model = tiny_model()
    next(model.parameters()).ds_id = 0  # what ZeRO-3 sets on each partitioned parameter
    return model


@pytest.mark.parametrize("model, args, found", [
    (DeepSpeedEngine(tiny_model()), None, "the model is wrapped in DeepSpeedEngine"),
    (zero3_model(), None, "parameter model.embed_tokens.weight is partitioned by DeepSpeed ZeRO-3"),
    (tiny_model(), SimpleNamespace(deepspeed="ds_zero2.json"), "the training arguments name a DeepSpeed config"),
])
def test_deepspeed_is_refused_at_train_begin_naming_what_is_supported(tmp_path, model, args, found):
    recorder = DeltaRecorder(tmp_path / "trajectory")
    with pytest.raises(RelexError) as refused:
        begin(recorder, model, args)
    message = str(refused.value)
    assert "\n" not in message and found in message
    assert "supports one process, DDP and FSDP/FSDP2" in message and "relex ingest" in message
    assert not (tmp_path / "trajectory").exists()


def test_accelerate_set_up_for_deepspeed_is_found(monkeypatch):
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    assert deepspeed_in_use(None, tiny_model()) is None
    monkeypatch.setattr(AcceleratorState, "_shared_state", {"distributed_type": DistributedType.DEEPSPEED})
    assert deepspeed_in_use(None, tiny_model()) == "accelerate is set up for DeepSpeed"


def test_relex_train_under_accelerate_deepspeed_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --use_deepspeed` sets
    assert main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relex train: error: this run trains with DeepSpeed (ACCELERATE_USE_DEEPSPEED is set")
    assert "DDP and FSDP/FSDP2" in lines[0]
    assert not (tmp_path / "run").exists()
