"""What `relex eval` accepts as a checkpoint, checked before any generation starts.

    runs/extrapolated-500          a Hugging Face model folder (config.json and safetensors weights)
    runs/grpo/trajectory@40        step 40 of a trajectory store: θ₀ + Δ₄₀ is written to a temporary folder,
                                   evaluated, then deleted
    smollm2-135m-instruct          a model alias of `relex.models.resolve_model`, or a Hugging Face hub id
"""

from __future__ import annotations

import logging
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
    return CheckpointRef(label=text, model=model)


def _store_step(text: str, store: Path, step: int) -> CheckpointRef:
    from relex.store import TrajectoryStore

    if not store.is_dir():
        raise RelexError(f"checkpoint {text}: no trajectory store folder {store}")
    TrajectoryStore.open(store).entry(step)  # checked now; names the recorded steps when `step` is not one
    return CheckpointRef(label=text, store=store, step=step)


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
