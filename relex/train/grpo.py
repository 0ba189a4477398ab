"""`run_training`: a GRPO run with TRL's `GRPOTrainer`, recording θ_step − θ₀ as it goes.

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
the store stops. A crash between recording a step and saving its checkpoint (or during the save) leaves recorded
steps after the last complete checkpoint: `--resume` drops them from the store and from log.jsonl, saying so,
and trains and records them again. A checkpoint the trainer did not finish saving (no readable
trainer_state.json, or weights that do not parse) is removed, never resumed from. `--resume` of a run that
reached its `grpo.max_steps` does nothing and says so; with a larger `grpo.max_steps` on resume, the
learning-rate schedule is stretched to the new total from the resumed step on. The run folder is locked while a
command trains in it, so a second `relex train` on it ends in one line naming the first one's PID.

Several processes (`accelerate launch --multi_gpu --num_processes N -m relex train ...`, or torchrun) train one
run with DDP: each process takes `grpo.per_device_train_batch_size` completions per step, so the global batch is N
times that. Rank 0 alone locks and checks the run folder, writes the tiny model, the config, log.jsonl, the
trajectory store and summary.json (the trainer writes each rank's RNG state into its checkpoints); the other ranks
load what rank 0 prepared. A failure while preparing, or while rank 0 records, ends every rank with the same line
(relex.ranks.together); a rank that fails elsewhere ends with its own line, and the others with one saying they
lost contact with it or were stopped by the launcher. Without CUDA the ranks train on the CPU with gloo. DeepSpeed
is refused before training (relex.record.refuse_deepspeed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import yaml

from relex import __version__
from relex.errors import RelexError
from relex.ingest import resolve_base
from relex.io.atomic import write_lock, write_text_atomic
from relex.io.checkpoint import checkpoint_infos
from relex.models import make_tiny_llama, resolve_model
from relex.ranks import RankFailed, Ranks, launched, process_group, together
from relex.record import DeltaRecorder, refuse_deepspeed
from relex.settings import read_yaml_mapping
from relex.store import TrajectoryStore, is_store
from relex.tasks import load_task
from relex.train.config import TrainConfig
from relex.train.progress import StepLogger, peak_rss_mb
from relex.util import read_log
from relex.verifiers import format_reward, get_verifier

LOG = logging.getLogger(__name__)

CONFIG_NAME = "config.yaml"
LOG_NAME = "log.jsonl"
STORE_NAME = "trajectory"
SUMMARY_NAME = "summary.json"
CHECKPOINTS_NAME = "checkpoints"
PREFIX = "checkpoint"  # the trainer's checkpoint-N folders
TRAINER_STATE = "trainer_state.json"  # the file the trainer writes last into a checkpoint
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
    """Train, record and log one run; returns the run folder. The run folder is locked throughout.

    Under `accelerate launch` or torchrun every rank calls this; rank 0 writes the run folder (see above)."""
    with joined_ranks() as ranks, ExitStack() as held:
        prepared = prepare_on_ranks(config, resume, ranks, held)
        done = finished_step(prepared)
        if done is not None:
            if is_main_process():
                LOG.warning(
                    "%s: already trained to step %d (grpo.max_steps %d); nothing to do. Raise grpo.max_steps to train further",
                    prepared.run_dir, done, prepared.args.max_steps,
                )
            return prepared.run_dir
        if show_progress:  # one bar for the run instead of transformers' bars for every checkpoint save
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        trainer, recorder = build_trainer(prepared, show_progress=show_progress)
        started = time.perf_counter()
        try:
            with closing_progress(trainer), peers_lost_in_one_line(ranks):
                trainer.train(resume_from_checkpoint=prepared.resume_from)
        except OSError as error:  # a full disk while saving a checkpoint: one line, and the run stays resumable
            raise RelexError(f"{prepared.run_dir}: training stopped: {error}; free the space and run relex train --resume") from error
        if is_main_process():
            write_summary(prepared.run_dir, recorder, time.perf_counter() - started)
    return prepared.run_dir


# ---- several processes ------------------------------------------------------------------------------------------
@contextmanager
def joined_ranks():
    """The ranks of a run started by `accelerate launch` or torchrun (relex.ranks.process_group); None in a single
    process. The process group is joined before anything else, so that every exchange below has it."""
    if not launched():
        yield None
        return
    with process_group() as ranks:
        yield ranks


def is_main_process() -> bool:
    """Whether this process writes the run folder: the only one, or rank 0 of several (after training, when the
    process group is closed, as the launcher's RANK says)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def prepare_on_ranks(config: TrainConfig, resume: bool, ranks: Ranks | None, held: ExitStack) -> Prepared:
    """`prepare` with the run folder locked (in `held`). Of several ranks, rank 0 locks, checks and writes the run
    folder first; then the others load what it prepared (the tiny model, the checkpoint to resume from), each
    phase ending with every rank raising the first failure."""
    if ranks is None:
        config = dataclasses.replace(config, out=str(run_folder(config)))  # one timestamped name, when none is given
        held.enter_context(write_lock(Path(config.out)))
        prepared = prepare(config, resume=resume)
        if resume and finished_step(prepared) is None:
            forget_after(prepared.run_dir, checkpoint_step(prepared.resume_from) if prepared.resume_from else 0)
        return prepared
    prepared = None
    with together(ranks, "preparing the run"):
        if ranks.is_first:
            prepared = prepare_on_ranks(config, resume, None, held)
    run_dir, model_path, resume_from = ranks.broadcast(
        (str(prepared.run_dir), prepared.model_path, prepared.resume_from) if ranks.is_first else None
    )
    with together(ranks, "loading the prepared run"):
        if not ranks.is_first:
            prepared = prepare_replica(dataclasses.replace(config, out=run_dir), model_path, resume_from)
    return prepared


def run_folder(config: TrainConfig) -> Path:
    return Path(config.out) if config.out else Path("runs") / f"train-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_replica(config: TrainConfig, model_path: str, resume_from: str | None) -> Prepared:
    """What a rank other than 0 needs to train: the task, rewards and GRPOConfig, with the model and checkpoint
    that rank 0 prepared."""
    task = load_task(config.task)
    args = grpo_args(config, Path(config.out))
    return Prepared(config, Path(config.out), model_path, task, reward_functions(config, task.verifier), args, resume_from)


@contextmanager
def peers_lost_in_one_line(ranks: Ranks | None):
    """A collective that fails because another rank is gone (it failed, and gloo's connection to it closed)
    becomes one line on this rank; the failed rank's own line says why."""
    try:
        yield
    except RuntimeError as error:
        if ranks is None or not lost_peer(error):
            raise
        raise RankFailed(
            f"rank {ranks.rank} of {ranks.world}: lost contact with another rank while training ({peer_cause(error)}); "
            "that rank's own line says why"
        ) from None


def peer_cause(error: RuntimeError) -> str:
    """The first sentence of a backend's error, without the source location gloo puts in front."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error).split()))
    return text.split(". ")[0][:200] or type(error).__name__


def lost_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because a peer closed its connection (gloo) or the backend gave up (NCCL)."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or "Connection closed by peer" in text or "Connection reset by peer" in text


# ---- validation -----------------------------------------------------------------------------------------------
def prepare(config: TrainConfig, *, resume: bool = False) -> Prepared:
    """Every check that can fail before training: run folder, model, task, verifier, GRPOConfig."""
    run_dir = run_folder(config)
    check_run_folder(run_dir, config, resume)
    model_path = resolve_model_path(config, run_dir, create=False)
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
    if config.model.tiny is None:
        path = resolve_model(config.model.name)
        if not Path(path).is_dir():  # a hub id: train from (and record against) the local snapshot
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
    # DeltaRecorder would refuse DeepSpeed at train begin: say so first (transformers wants deepspeed installed)
    refuse_deepspeed(SimpleNamespace(deepspeed=options.get("deepspeed")), who=None)
    try:
        args = GRPOConfig(**device_options(options))
    except (ValueError, TypeError) as error:  # TRL's and transformers' own cross-field checks
        raise RelexError(f"grpo: {error}") from None
    return args


def device_options(options: dict) -> dict:
    """Several processes without CUDA train on the CPU with gloo: transformers otherwise leaves each process to
    train alone (accelerate only sees a distributed CPU run when told `use_cpu`)."""
    if launched() and "use_cpu" not in options:
        import torch

        if not torch.cuda.is_available():
            if is_main_process() and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
                LOG.warning("accelerate applies FSDP on GPUs only: these CPU processes train with DDP (each holds the whole model)")
            return {**options, "use_cpu": True}
    return options


def checkpoint_to_resume(run_dir: Path, config: TrainConfig) -> str | None:
    """The last complete checkpoint of the run (None: start from step 0); partial ones are removed, saying so."""
    folder = run_dir / CHECKPOINTS_NAME
    last = last_complete_checkpoint(folder)
    if last is None:
        if not config.record.resumable:
            raise RelexError(f"{run_dir}: this run saved no checkpoints (record.resumable: false), so it cannot be resumed")
        LOG.info("%s: no checkpoint yet; starting from step 0", run_dir)
        return None
    return str(last)


def checkpoint_step(folder: str | Path) -> int:
    return int(Path(folder).name.removeprefix(f"{PREFIX}-"))


def last_complete_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-N with the largest N that the trainer finished saving.

    The trainer writes trainer_state.json last, so a checkpoint whose state file is missing or unreadable, or whose
    weights do not parse, was interrupted: it is removed (a resumed run saves it again) instead of picked up.
    """
    if not folder.is_dir():
        return None
    found = sorted(
        (checkpoint_step(c), c) for c in folder.iterdir() if c.is_dir() and re.fullmatch(rf"{PREFIX}-[0-9]{{1,18}}", c.name)
    )
    for step, checkpoint in reversed(found):
        why = checkpoint_problem(checkpoint, step)
        if why is None:
            return checkpoint
        LOG.warning("%s: removing this partial checkpoint (%s), left by an interrupted save", checkpoint, why)
        shutil.rmtree(checkpoint)
    return None


def checkpoint_problem(checkpoint: Path, step: int) -> str | None:
    """Why a checkpoint folder is not a complete save of step `step` (None when it is)."""
    try:
        state = json.loads((checkpoint / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return f"no readable {TRAINER_STATE}"
    if not isinstance(state, dict) or state.get("global_step") != step:
        return f"{TRAINER_STATE} is not for step {step}"
    try:
        checkpoint_infos(checkpoint)  # every shard's header checked against its size
    except RelexError as error:
        return str(error)
    return None


def finished_step(prepared: Prepared) -> int | None:
    """The step a resumed run already reached when that is its grpo.max_steps (nothing left to train), else None."""
    if prepared.resume_from is None:
        return None
    step = checkpoint_step(prepared.resume_from)
    return step if step >= prepared.args.max_steps > 0 else None


def forget_after(run_dir: Path, step: int) -> None:
    """Drop what the run recorded and logged after `step`, the checkpoint it resumes from: the resumed run
    trains those steps again, so they would otherwise be recorded twice, from weights that may differ."""
    store = run_dir / STORE_NAME
    if is_store(store):
        dropped = TrajectoryStore.open(store).truncate(step)
        if dropped:
            LOG.warning("%s: resuming from step %d, so recorded steps %s are dropped and recorded again", run_dir, step, ", ".join(map(str, dropped)))
    log = run_dir / LOG_NAME
    if log.is_file():
        kept = [line for line in log.read_text().splitlines() if _logged_step(line) is not None and _logged_step(line) <= step]
        write_text_atomic(log, "".join(line + "\n" for line in kept))


def _logged_step(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):  # a line cut short by a kill
        return None
    return step if isinstance(step, int) else None


# ---- the trainer ------------------------------------------------------------------------------------------------
def build_trainer(prepared: Prepared, *, show_progress: bool = True, recorder=None):
    """TRL's GRPOTrainer with the task's prompts, the rewards, the DeltaRecorder and the step logger.

    `recorder` replaces the run's DeltaRecorder (relex accelerate passes its JumpController, which records each
    segment into its own store); it runs after the step logger, so a step's log line is written before it acts."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    config, run_dir = prepared.config, prepared.run_dir
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir / CONFIG_NAME, config, prepared.model_path)
    if recorder is None:
        recorder = DeltaRecorder(run_dir / STORE_NAME, every=config.record.every, delta_dtype=config.record.delta_dtype,
                                 background=config.record.background)
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


@contextmanager
def closing_progress(trainer):
    """Close the step logger's progress bar however training ends (an error mid-run included)."""
    try:
        yield
    finally:
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, StepLogger):
                callback.close()


def write_config(path: Path, config: TrainConfig, model_path: str) -> None:
    header = f"# relex {__version__} train config, resolved; model loaded from {model_path}\n"
    path.write_text(header + yaml.safe_dump(config.to_dict(), sort_keys=False))


def write_summary(run_dir: Path, recorder, seconds: float) -> dict:
    """Seconds per step, peak memory, recording overhead and store size of the run, in RUN/summary.json."""

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
