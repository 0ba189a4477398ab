"""What `relex eval` accepts as a checkpoint, checked before any generation starts.

    runs/extrapolated-500          a Hugging Face model folder (config.json and safetensors weights)
    runs/grpo/trajectory@40        step 40 of a trajectory store: θ₀ + Δ₄₀ is written to a temporary folder,
                                   evaluated, then deleted
    smollm2-135m-instruct          a model alias of `relex.models.resolve_model`, or a Hugging Face hub id
    logits(A,B,ALPHA)              two checkpoints decoded together, l_A + α (l_B − l_A) (relex.evaluate.logits)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from relex.errors import RelexError
from relex.extrapolate import materialize_step
from relex.io.checkpoint import weight_files
from relex.models import EMBEDDED_ALIASES, EMBEDDED_MODEL, cache_dir, resolve_model
from relex.store import TrajectoryStore

LOG = logging.getLogger(__name__)
PATTERN = re.compile(r"^logits\((?P<a>[^,]+),(?P<b>[^,]+),(?P<alpha>[^,()]+)\)$")


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
    scratch = Path(tempfile.mkdtemp(prefix="relex-eval-"))
    try:
        LOG.info("materialising step %d of %s", ref.step, ref.store)
        yield str(materialize_step(ref.store, ref.step, scratch / f"step-{ref.step}"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def checkpoint_inputs(texts) -> list[Path]:
    """The local folders the checkpoints `texts` read (model folders, stores and their bases, the embedded model's
    cache folder), found without loading anything: `--overwrite` must never replace one of them."""
    found: list[Path] = []
    for text in texts:
        text = str(text)
        if text.startswith("logits("):
            try:
                spec = parse_logits_spec(text)
            except RelexError:
                continue  # refused with its own message when parsed
            found += checkpoint_inputs([spec.a, spec.b])
            continue
        if text in EMBEDDED_ALIASES:
            found.append(cache_dir() / "models" / EMBEDDED_MODEL)
            continue
        path = Path(text).expanduser()
        folder, at, step = text.rpartition("@")
        if not path.exists() and at and step.isdigit():
            path = Path(folder).expanduser()
            try:
                found.append(Path(TrajectoryStore.open(path).base_dir))
            except (RelexError, OSError, ValueError):
                pass  # not a store: refused with its own message when parsed
        if path.exists():
            found.append(path)
    return found


@dataclass(frozen=True)
class LogitsSpec:
    label: str
    a: str
    b: str
    alpha: float


def is_logits_spec(text: str) -> bool:
    return text.startswith("logits(")


def parse_logits_spec(text: str) -> LogitsSpec:
    match = PATTERN.match(text.replace(" ", ""))
    if not match:
        raise RelexError(f"{text!r}: logits extrapolation is written logits(A,B,ALPHA), e.g. logits(run@4,run@8,2)")
    try:
        alpha = float(match["alpha"])
    except ValueError:
        raise RelexError(f"{text!r}: ALPHA {match['alpha']!r} is not a number") from None
    if not alpha > 0:
        raise RelexError(f"{text!r}: ALPHA must be positive (1 is B itself, 2 twice as far from A)")
    return LogitsSpec(text, match["a"], match["b"], alpha)
