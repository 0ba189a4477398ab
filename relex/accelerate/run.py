"""`run_accelerate`: a `relex train` run whose trainer carries the JumpController (relex.accelerate.loop)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from relex.accelerate.config import AccelerateConfig
from relex.accelerate.loop import JumpController, ValidationScorer
from relex.accelerate.validation import carved_from_train, split_confirmation, validation_split
from relex.errors import RelexError
from relex.io.atomic import write_lock
from relex.ranks import launched
from relex.train.config import TrainConfig
from relex.train.grpo import build_trainer, closing_progress, finished_step, prepare

LOG = logging.getLogger(__name__)


def accelerate_config(config: TrainConfig, **overrides) -> AccelerateConfig:
    """The config's `accelerate:` section with the flags that were given (not None) on top."""
    data = dict(config.accelerate or {})
    data.update({key: value for key, value in overrides.items() if value is not None})
    return AccelerateConfig.from_dict(data)


def run_accelerate(config: TrainConfig, accelerate: AccelerateConfig | None = None, *, resume: bool = False,
                   show_progress: bool = True, scorer=None, confirmer=None) -> Path:
    """GRPO segments alternating with guarded jumps (relex.accelerate.loop), under a lock on the run folder.

    Args:
        config: a train config (`relex.train.load_config`); its `grpo.max_steps` is the GRPO budget.
        accelerate: the loop's settings; default: the config's `accelerate:` section.
        resume: continue the run in `config.out` from its last checkpoint (needs `record.resumable: true`).
        show_progress: draw a progress bar (only on a terminal).
        scorer: replaces the validation scorer, `(model, tokenizer, states, restore) -> {name: [0/1 per problem]}`
            (tests inject one).
        confirmer: with an injected scorer, the scorer of the confirmation problems (None: no confirmation).

    Returns:
        The run folder: log.jsonl, jumps.jsonl, segments/, jumps/, final/, accelerate-summary.json.

    Example:
        >>> from relex.accelerate import run_accelerate
        >>> from relex.train import load_config
        >>> run = run_accelerate(load_config("configs/tiny.yaml", out="runs/tiny-accel"))  # doctest: +SKIP
        >>> (run / "jumps.jsonl").is_file()  # doctest: +SKIP
        True
    """
    if launched():  # a jump loads weights into one live model and its optimizer; ranks would each jump on their own
        raise RelexError(
            f"relex accelerate runs in one process, not {os.environ['WORLD_SIZE']} (started by accelerate launch or "
            "torchrun); run it directly, or train with several processes through relex train"
        )
    accelerate = accelerate or accelerate_config(config)
    config.accelerate = accelerate.to_dict()  # the run's config.yaml states what the loop used
    run_dir = Path(config.out) if config.out else Path("runs") / f"accelerate-{time.strftime('%Y%m%d-%H%M%S')}"
    config = dataclasses.replace(config, out=str(run_dir))
    with write_lock(run_dir):  # one writer per run folder
        prepared = prepare(config, resume=resume)
        done = finished_step(prepared)
        if done is not None:
            LOG.warning("%s: already trained to step %d (grpo.max_steps %d); nothing to do", run_dir, done, prepared.args.max_steps)
            return run_dir
        train(prepared, config, accelerate, scorer, confirmer, show_progress)
    return prepared.run_dir


def validation_scorers(prepared, config: TrainConfig, accelerate: AccelerateConfig):
    """The scorers of the validation problems that pick a candidate and of those that confirm it (None: none)."""
    grpo = prepared.args
    train_rows = prepared.task.rows("train")
    n, extra = accelerate.validation_size, accelerate.confirm_size
    task = validation_split(config.task, n + extra, train_rows)
    if carved_from_train(task):  # the validation problems leave the train split
        prepared.task._rows["train"] = train_rows[: -(n + extra)]
    pick, fresh = split_confirmation(task, n)
    max_new_tokens = accelerate.max_new_tokens or grpo.max_completion_length
    scorer = ValidationScorer(pick, n, accelerate.batch_size, max_new_tokens, seed=grpo.seed)
    confirmer = ValidationScorer(fresh, extra, accelerate.batch_size, max_new_tokens, seed=grpo.seed) if extra else None
    return scorer, confirmer


def train(prepared, config: TrainConfig, accelerate: AccelerateConfig, scorer, confirmer, show_progress: bool) -> None:
    grpo = prepared.args
    grpo.save_steps = accelerate.segment_steps  # checkpoints at segment ends, after each decision
    if scorer is None:
        scorer, confirmer = validation_scorers(prepared, config, accelerate)
    if show_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    controller = JumpController(
        prepared.run_dir, accelerate, scorer, confirmer, delta_dtype=config.record.delta_dtype,
        rollouts_per_step=grpo.per_device_train_batch_size * grpo.gradient_accumulation_steps * grpo.world_size,
    )
    trainer, _ = build_trainer(prepared, show_progress=show_progress, recorder=controller)
    try:
        with closing_progress(trainer):
            trainer.train(resume_from_checkpoint=prepared.resume_from)
    except OSError as error:  # a full disk while writing candidates or checkpoints: one line, the run stays resumable
        raise RelexError(f"{prepared.run_dir}: training stopped: {error}; free the space and run relex accelerate --resume") from error
