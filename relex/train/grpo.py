"""`run_training`: a GRPO run with TRL's `GRPOTrainer`, recording θ_step − θ₀ as it goes.

    from relex.train import load_config, run_training
    run = run_training(load_config("configs/tiny.yaml", out="runs/tiny"))

Everything is validated before the model trains: config keys, the model path, the task, the verifier and TRL's
own checks of `GRPOConfig`. The run folder then holds

    RUN/config.yaml      the resolved config (defaults filled in)
    RUN/log.jsonl        one line per optimizer step (relex.train.progress)
    RUN/trajectory/      the trajectory store, as `relex fit` reads it
    RUN/summary.json     seconds per step, peak memory, recording overhead, store size
    RUN/model/           the tiny model, when the config asks for one
    RUN/checkpoints/     full HF checkpoints, when record.resumable is set

Resuming (`resume=True`, `relex train --resume`) continues the same run: the trainer restores weights,
optimizer, scheduler and RNG state from the last checkpoint in RUN/checkpoints, and the recorder continues the
store from that step. This is the only exact way: restarting from θ₀ + Δ_last would lose Adam's moments and the
learning-rate schedule, so the continued trajectory would not be the run's. Checkpoints are therefore opt-in
(`record.resumable`) and saved at every recorded step, right after the record, so that a resumed run starts where
the store stops. Sparser checkpoints would leave recorded steps after the last checkpoint, which the rerun would
record again from weights that may differ; the store has no way to drop steps, so the recorder refuses that case
(a crash between recording a step and saving its checkpoint) instead of overwriting. With a larger
`grpo.max_steps` on resume, the learning-rate schedule is stretched to the new total from the resumed step on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from relex import __version__
from relex.errors import RelexError
from relex.store import is_store
from relex.train.config import TrainConfig

LOG = logging.getLogger(__name__)

CONFIG_NAME = "config.yaml"
LOG_NAME = "log.jsonl"
STORE_NAME = "trajectory"
SUMMARY_NAME = "summary.json"
CHECKPOINTS_NAME = "checkpoints"
TINY_MODEL_NAME = "model"


@dataclass
class Prepared:
    """A validated run, ready to train."""

    config: TrainConfig
    run_dir: Path
    model_path: str
    task: object
    reward_funcs: list
    args: object  # trl.GRPOConfig
    resume_from: str | None


def run_training(config: TrainConfig, *, resume: bool = False, show_progress: bool = True) -> Path:
    """Train, record and log one run; returns the run folder."""
    prepared = prepare(config, resume=resume)
    if show_progress:  # one bar for the run instead of transformers' bars for every checkpoint save
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    trainer, recorder = build_trainer(prepared, show_progress=show_progress)
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=prepared.resume_from)
    write_summary(prepared.run_dir, recorder, time.perf_counter() - started)
    return prepared.run_dir


# ---- validation -----------------------------------------------------------------------------------------------
def prepare(config: TrainConfig, *, resume: bool = False) -> Prepared:
    """Every check that can fail before training: run folder, model, task, verifier, GRPOConfig."""
    run_dir = Path(config.out) if config.out else Path("runs") / f"train-{time.strftime('%Y%m%d-%H%M%S')}"
    check_run_folder(run_dir, config, resume)
    model_path = resolve_model_path(config, run_dir, create=False)
    from relex.tasks import load_task

    task = load_task(config.task)
    task.rows("train")  # a task without a train split fails here, naming its splits
    reward_funcs = reward_functions(config, task.verifier)
    args = grpo_args(config, run_dir)
    resume_from = checkpoint_to_resume(run_dir, config) if resume else None
    model_path = resolve_model_path(config, run_dir, create=True) if model_path is None else model_path
    return Prepared(config, run_dir, model_path, task, reward_funcs, args, resume_from)


def check_run_folder(run_dir: Path, config: TrainConfig, resume: bool) -> None:
    if not resume:
        if is_store(run_dir / STORE_NAME):
            raise RelexError(
                f"{run_dir}: already holds a run (trajectory store {run_dir / STORE_NAME}); pass --resume to continue "
                "it, or choose another --out"
            )
        if run_dir.exists() and any(run_dir.iterdir()):
            raise RelexError(f"{run_dir}: exists and is not empty; choose another --out")
        return
    saved = run_dir / CONFIG_NAME
    if not saved.is_file():
        raise RelexError(f"{run_dir}: no {CONFIG_NAME}, so no run to resume; drop --resume to start one")
    differences = config_differences(load_saved_config(saved), config)
    if differences:
        raise RelexError(
            f"{run_dir}: --resume with a config that differs from the run's {CONFIG_NAME} in {', '.join(differences)}; "
            "only grpo.max_steps may change when resuming"
        )


def load_saved_config(path: Path) -> TrainConfig:
    from relex.evaluate.config import read_yaml_mapping

    return TrainConfig.from_dict(read_yaml_mapping(path))


def config_differences(saved: TrainConfig, given: TrainConfig) -> list[str]:
    """Dotted keys whose values differ, ignoring `out` and `grpo.max_steps`."""
    def flat(data: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in data.items():
            if isinstance(value, dict) and key in ("model", "reward", "grpo", "record", "task") and not prefix:
                out.update(flat(value, f"{key}."))
            else:
                out[prefix + key] = value
        return out

    a, b = flat(saved.to_dict()), flat(given.to_dict())
    ignored = {"out", "grpo.max_steps"}
    return sorted(k for k in set(a) | set(b) if k not in ignored and a.get(k) != b.get(k))


def resolve_model_path(config: TrainConfig, run_dir: Path, *, create: bool) -> str | None:
    """The folder or hub id to train; a tiny model is written into RUN/model (None until `create`)."""
    from relex.models import make_tiny_llama, resolve_model

    if config.model.tiny is None:
        path = resolve_model(config.model.name)
        if not Path(path).is_dir():  # a hub id: train from (and record against) the local snapshot
            from relex.ingest import resolve_base

            path = str(resolve_base(path))
        return path
    tiny = dict(config.model.tiny)
    if tiny.get("tokenizer_from") is not None:
        tiny["tokenizer_from"] = resolve_model(str(tiny["tokenizer_from"]))
    folder = run_dir / TINY_MODEL_NAME
    if (folder / "config.json").is_file():
        return str(folder.resolve())
    if not create:
        return None
    return str(make_tiny_llama(folder, **tiny).resolve())


def reward_functions(config: TrainConfig, task_verifier: str) -> list:
    from relex.verifiers import format_reward, get_verifier

    verifier = get_verifier(config.verifier_name(task_verifier))
    weight = config.reward.format_weight
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
        raise RelexError(f"reward.format_weight: expected a number ≥ 0, got {weight!r}")
    return [verifier, format_reward] if weight else [verifier]


def grpo_args(config: TrainConfig, run_dir: Path):
    """TRL's GRPOConfig: relex's defaults, the config's `grpo` mapping, then what relex derives itself."""
    from trl import GRPOConfig

    record = config.record
    options = config.grpo_options()
    options.update(
        output_dir=str(run_dir / CHECKPOINTS_NAME),
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="steps" if record.resumable else "no",
        save_steps=record.every,
        save_only_model=False,
        save_total_limit=record.keep_checkpoints,
    )
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    if "activation_checkpointing" in fields and "activation_checkpointing" not in options:
        # transformers ≥ 5.2 renamed it; the old name still works but warns
        options["activation_checkpointing"] = options.pop("gradient_checkpointing", None)
    if config.reward.format_weight:
        options["reward_weights"] = [1.0, float(config.reward.format_weight)]
    try:
        return GRPOConfig(**options)
    except (ValueError, TypeError) as error:  # TRL's and transformers' own cross-field checks
        raise RelexError(f"grpo: {error}") from None


def checkpoint_to_resume(run_dir: Path, config: TrainConfig) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = run_dir / CHECKPOINTS_NAME
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        if not config.record.resumable:
            raise RelexError(f"{run_dir}: this run saved no checkpoints (record.resumable: false), so it cannot be resumed")
        store = run_dir / STORE_NAME
        if is_store(store):
            from relex.store import TrajectoryStore

            if TrajectoryStore.open(store).steps:
                raise RelexError(f"{run_dir}: the store holds recorded steps but {folder} holds no checkpoint to resume from")
        LOG.info("%s: no checkpoint yet; starting from step 0", run_dir)
    return last


# ---- the trainer ------------------------------------------------------------------------------------------------
def build_trainer(prepared: Prepared, *, show_progress: bool = True, recorder=None):
    """TRL's GRPOTrainer with the task's prompts, the rewards, the DeltaRecorder and the step logger.

    `recorder` replaces the run's DeltaRecorder (relex accelerate passes its JumpController, which records each
    segment into its own store); it runs after the step logger, so a step's log line is written before it acts."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    from relex.record import DeltaRecorder
    from relex.train.progress import StepLogger

    config, run_dir = prepared.config, prepared.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir / CONFIG_NAME, config, prepared.model_path)
    if recorder is None:
        recorder = DeltaRecorder(run_dir / STORE_NAME, every=config.record.every, delta_dtype=config.record.delta_dtype)
    logger = StepLogger(run_dir / LOG_NAME, recorder, show_progress=show_progress)
    if hasattr(recorder, "step_logger"):
        recorder.step_logger = logger
    trainer = GRPOTrainer(
        model=prepared.model_path,
        reward_funcs=prepared.reward_funcs,
        args=prepared.args,
        train_dataset=prepared.task.dataset("train"),
        callbacks=[logger, recorder],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; log.jsonl and the bar replace it
    return trainer, recorder


def write_config(path: Path, config: TrainConfig, model_path: str) -> None:
    header = f"# relex {__version__} train config, resolved; model loaded from {model_path}\n"
    path.write_text(header + yaml.safe_dump(config.to_dict(), sort_keys=False))


def write_summary(run_dir: Path, recorder, seconds: float) -> dict:
    """Seconds per step, peak memory, recording overhead and store size of the run, in RUN/summary.json."""
    from relex.store import TrajectoryStore
    from relex.train.progress import peak_rss_mb, read_log

    lines = read_log(run_dir / LOG_NAME)
    store = TrajectoryStore.open(run_dir / STORE_NAME)
    step_seconds = [line["step_seconds"] for line in lines]
    per_step = sum(step_seconds) / len(step_seconds) if step_seconds else None
    recording = recorder.overhead()
    summary = {
        "steps": len(lines),
        "recorded_steps": store.steps,
        "train_seconds": seconds,
        "seconds_per_step": per_step,
        "peak_rss_mb": peak_rss_mb(),
        "rewards": [line.get("reward") for line in lines],
        "recording": recording,
        "record_seconds_over_step_seconds": recording["record_seconds_mean"] / per_step if per_step else None,
        "store_bytes": store.size_bytes(),
        "delta_bytes": sum(f.stat().st_size for f in (store.path / "deltas").glob("*.safetensors")),
    }
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
