"""What both recorders share (relex.record's DeltaRecorder and relex.record_sharded's FSDP2 recording): a record's
timing, the storage key that finds tied tensors, and how a store names its base folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from relex.io.checkpoint import TensorInfo


@dataclass(frozen=True)
class RecordTiming:
    step: int
    seconds: float  # wall time of computing and writing the step's deltas
    nbytes: int  # size of the step's delta file


def storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def ties_within(live: dict[str, torch.Tensor], infos: dict[str, TensorInfo]) -> dict[str, str]:
    """alias -> canonical among the base's tensors that share storage in the model (the first name is canonical)."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, tensor in live.items():
        if name not in infos or tensor.numel() == 0:
            continue
        key = storage_key(tensor)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def local_model_folder(model) -> Path | None:
    """The model's `name_or_path` when it is a local folder holding safetensors weights."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None
    folder = Path(name).expanduser()
    if folder.is_dir() and any(folder.glob("*.safetensors")):
        return folder.resolve()
    return None


def reference(folder: Path, store_dir: Path) -> str:
    """How the manifest names a base folder: relative when it sits in the run beside the store, else absolute."""
    folder, run = Path(folder).resolve(), store_dir.resolve().parent
    if folder.is_relative_to(run):
        return os.path.relpath(folder, store_dir.resolve())
    return str(folder)
