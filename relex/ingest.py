"""`relex ingest`: make a trajectory store from an existing run's checkpoints.

Layouts recognised (step numbers come from the layout or from the user, never from a model name):
- Hugging Face Trainer: `RUN/checkpoint-N/` (optimizer, scheduler and RNG files are ignored);
- verl: `RUN/global_step_N/actor/huggingface/` or `RUN/global_step_N/huggingface/`;
- plain HF folders, with the step numbers given by `--steps`.

By default the store references the checkpoints in place, after validating every tensor's name, shape and
dtype against the base and scanning the values for NaN/Inf; `--copy` writes the deltas into the store instead.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader, TensorInfo, weight_files
from relex.io.dtypes import parse_dtype
from relex.store import TrajectoryStore

LOG = logging.getLogger(__name__)

_TRAINER = re.compile(r"checkpoint-(\d+)")
_VERL = re.compile(r"global_step_(\d+)")
VERL_MODEL_DIRS = ("actor/huggingface", "huggingface")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    folder: Path
    layout: str  # "hf-trainer", "verl" or "plain"


def resolve_base(base: str) -> Path:
    """A local HF folder, or a hub id downloaded to the local cache (needs the network)."""
    path = Path(base)
    if path.exists():
        weight_files(path)
        return path.resolve()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base):
        from huggingface_hub import snapshot_download  # a hub id: users with the network

        return Path(snapshot_download(base, allow_patterns=["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja"]))
    raise RelexError(f"base {base!r}: no such folder (and not a hub id like org/name)")


def _verl_model_dir(folder: Path) -> Path:
    for sub in VERL_MODEL_DIRS:
        candidate = folder / sub
        if candidate.is_dir():
            if not any(candidate.glob("*.safetensors")):
                raise RelexError(
                    f"{candidate}: no safetensors weights; merge verl's FSDP shards first "
                    "(python -m verl.model_merger merge --backend fsdp --local_dir ... --target_dir ...)"
                )
            return candidate
    raise RelexError(f"{folder}: a verl step folder without {' or '.join(VERL_MODEL_DIRS)}/")


def _classify(folder: Path) -> Checkpoint | None:
    if match := _TRAINER.fullmatch(folder.name):
        return Checkpoint(int(match.group(1)), folder, "hf-trainer")
    if match := _VERL.fullmatch(folder.name):
        return Checkpoint(int(match.group(1)), _verl_model_dir(folder), "verl")
    return None


def discover_checkpoints(paths: list[str | Path], steps: list[int] | None = None) -> list[Checkpoint]:
    """The run's checkpoints in step order, from run folders, step folders, or plain folders with `steps`."""
    paths = [Path(p) for p in paths]
    for path in paths:
        if not path.is_dir():
            raise RelexError(f"{path}: no such folder")
    if steps is not None:
        if len(steps) != len(paths):
            raise RelexError(f"--steps gives {len(steps)} step numbers for {len(paths)} checkpoint folders")
        check_steps(steps)
        return [Checkpoint(s, p, "plain") for s, p in zip(steps, paths)]
    found: list[Checkpoint] = []
    for path in paths:
        direct = _classify(path)
        if direct is not None:
            found.append(direct)
            continue
        children = [c for c in (_classify(child) for child in sorted(path.iterdir()) if child.is_dir()) if c]
        if not children:
            raise RelexError(
                f"{path}: no checkpoint-N/ or global_step_N/ folders; for plain HF folders give their step numbers with --steps"
            )
        found.extend(children)
    found.sort(key=lambda c: c.step)
    check_steps([c.step for c in found])
    return found


def check_steps(steps: list[int]) -> None:
    for previous, step in zip(steps, steps[1:]):
        if step == previous:
            raise RelexError(f"step {step} is given twice")
        if step < previous:
            raise RelexError(f"steps must increase: {step} comes after {previous}")
    if steps and steps[0] <= 0:
        raise RelexError(f"step {steps[0]}: steps must be positive (the base is step 0)")


def parse_steps(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RelexError(f"cannot read --steps {text!r}; give step numbers like 10,20,40") from None


def validate_checkpoint(base: dict[str, TensorInfo], checkpoint: Checkpoint, reader: CheckpointReader) -> dict[str, TensorInfo]:
    infos = reader.infos()
    where = f"{checkpoint.folder} (step {checkpoint.step})"
    for name, info in base.items():
        if name not in infos:
            raise RelexError(f"{where}: tensor {name} is missing (present in the base)")
        if infos[name].shape != info.shape:
            raise RelexError(f"{where}: tensor {name} has shape {infos[name].shape}, {info.shape} at base")
        if infos[name].is_float != info.is_float:
            raise RelexError(f"{where}: tensor {name} is {infos[name].dtype}, {info.dtype} at base")
    extra = sorted(set(infos) - set(base))
    if extra:
        raise RelexError(f"{where}: tensor {extra[0]} is not in the base checkpoint")
    return infos


def tied_candidates(base: CheckpointReader, infos: dict[str, TensorInfo]) -> dict[str, str]:
    """alias -> canonical for float tensors that are bitwise equal at the base (confirmed at every step later)."""
    groups: dict[tuple, list[str]] = {}
    for name, info in infos.items():
        if info.is_float:
            groups.setdefault((info.shape, info.dtype), []).append(name)
    tied: dict[str, str] = {}
    for names in groups.values():
        for i, canonical in enumerate(names):
            if canonical in tied:
                continue
            value = base.read(canonical)
            for alias in names[i + 1 :]:
                if alias not in tied and torch.equal(value, base.read(alias)):
                    tied[alias] = canonical
    return tied


def scan_step(base: CheckpointReader, reader: CheckpointReader, checkpoint: Checkpoint, names: list[str], tied: dict[str, str]) -> None:
    """Read every value once: NaN/Inf and unreadable data fail here; ties that break are dropped."""
    for name in names:
        values = reader.read(name)
        if values.is_floating_point() and not torch.isfinite(values).all():
            raise RelexError(f"{checkpoint.folder} (step {checkpoint.step}): tensor {name} has NaN or Inf values")
    for alias, canonical in list(tied.items()):
        if not torch.equal(reader.read(alias), reader.read(canonical)):
            del tied[alias]


def ingest(
    paths: list[str | Path],
    base: str,
    out: str | Path,
    *,
    steps: list[int] | None = None,
    copy: bool = False,
    delta_dtype: str | None = None,
    overwrite: bool = False,
) -> TrajectoryStore:
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise RelexError(f"{out}: exists; pass --overwrite to replace it")
    checkpoints = discover_checkpoints(paths, steps)
    base_dir = resolve_base(base)
    base_reader = CheckpointReader(base_dir)
    base_infos = base_reader.infos()
    readers = []
    for checkpoint in checkpoints:
        reader = CheckpointReader(checkpoint.folder)
        readers.append((checkpoint, reader, validate_checkpoint(base_infos, checkpoint, reader)))
    stored_dtype = parse_dtype(delta_dtype) if delta_dtype else None
    if stored_dtype is not None and not copy:
        raise RelexError("--delta-dtype applies to copied deltas; add --copy")
    tied = tied_candidates(base_reader, base_infos)
    for checkpoint, reader, _ in tqdm(readers, desc="ingest: checking values", unit="step", leave=False):
        scan_step(base_reader, reader, checkpoint, sorted(base_infos), tied)
    if out.exists():
        shutil.rmtree(out)
    created_by = {
        "command": "relex ingest",
        "layout": sorted({c.layout for c in checkpoints}),
        "mode": "copy" if copy else "reference",
        "sources": {str(c.step): str(c.folder.resolve()) for c in checkpoints},
    }
    store = TrajectoryStore.create(out, base_dir=base_dir, tensors=base_infos, tied=tied, created_by=created_by)
    try:
        for checkpoint, reader, infos in tqdm(readers, desc="ingest: recording", unit="step", leave=False):
            source_dtype = _dominant_dtype(infos)
            if copy:
                entry = store.append_deltas(checkpoint.step, _delta_reader(base_reader, reader), stored_dtype, source_dtype)
            else:
                entry = store.append_checkpoint(checkpoint.step, checkpoint.folder, source_dtype)
            LOG.debug("step %d: %s", entry.step, entry.kind)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return store


def _delta_reader(base: CheckpointReader, reader: CheckpointReader):
    return lambda name: reader.read(name).float() - base.read(name).float()


def _dominant_dtype(infos: dict[str, TensorInfo]) -> torch.dtype:
    floats = [info.dtype for info in infos.values() if info.is_float]
    return max(set(floats), key=floats.count)
