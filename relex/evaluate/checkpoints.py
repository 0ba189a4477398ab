"""What `relex eval` accepts as a checkpoint, checked before any generation starts.

    runs/extrapolated-500          a Hugging Face model folder (config.json and safetensors weights)
    runs/grpo/trajectory@40        step 40 of a trajectory store: θ₀ + Δ₄₀ is written to a temporary folder,
                                   evaluated, then deleted
    smollm2-135m-instruct          a model alias of `relex.models.resolve_model`, or a Hugging Face hub id
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from relex.errors import RelexError

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRef:
    label: str  # as the user wrote it; names the checkpoint in tables and files
    model: str | None = None  # a model folder or hub id
    store: Path | None = None  # a trajectory store, with `step`
    step: int | None = None


def parse_checkpoint(text: str) -> CheckpointRef:
    """The checkpoint `text` names; fails now, naming the folder, when it is not something `evaluate` can load."""
    folder, at, step = text.rpartition("@")
    if at and step.isdigit() and not Path(text).exists():
        return _store_step(text, Path(folder), int(step))
    from relex.io.checkpoint import weight_files
    from relex.models import resolve_model

    model = resolve_model(text)  # refuses a folder without config.json, or a missing path
    if Path(model).is_dir():
        weight_files(Path(model))  # refuses a folder without (safetensors) weights, naming it
        if not has_tokenizer(Path(model)):
            raise RelexError(
                f"checkpoint {text}: the folder holds no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the tokenizer "
                "files of the model it was made from into it"
            )
    return CheckpointRef(label=text, model=model)


def _store_step(text: str, store: Path, step: int) -> CheckpointRef:
    from relex.store import TrajectoryStore

    if not store.is_dir():
        raise RelexError(f"checkpoint {text}: no trajectory store folder {store}")
    opened = TrajectoryStore.open(store)
    opened.entry(step)  # checked now; names the recorded steps when `step` is not one
    base = os.path.normpath(opened.base_dir)
    if not has_tokenizer(Path(base)):  # a store step is written with its base's tokenizer files
        raise RelexError(
            f"checkpoint {text}: the store recorded no tokenizer (its base {base} has none of "
            f"{', '.join(TOKENIZER_FILES)}); copy the model's tokenizer files into {base}, or record with one: "
            "DeltaRecorder saves the tokenizer of a Trainer made with processing_class=tokenizer"
        )
    return CheckpointRef(label=text, store=store, step=step)


# a fast tokenizer's file, or the vocabulary a slow one is built from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


@contextmanager
def model_folder(ref: CheckpointRef) -> Iterator[str]:
    """A loadable model folder (or hub id) for `ref`; a store step lives in a temporary folder for the duration."""
    if ref.store is None:
        yield ref.model
        return
    from relex.extrapolate import materialize_step

    scratch = Path(tempfile.mkdtemp(prefix="relex-eval-"))
    try:
        LOG.info("materialising step %d of %s", ref.step, ref.store)
        yield str(materialize_step(ref.store, ref.step, scratch / f"step-{ref.step}"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
