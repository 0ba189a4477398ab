"""DeltaRecorder under FSDP2: parameters sharded across ranks, deltas gathered one tensor at a time to the writer.

Under FSDP2 (`fully_shard`) each parameter is a DTensor whose rows are spread over the ranks. Recording then needs
every rank: each keeps θ₀ of its own shards (a float32 CPU copy of its local parts, never a whole tensor), and at
a recorded step all ranks walk the store's tensors in the same order, each computing θ − θ₀ on its local part and
all-gathering that one tensor (`DTensor.full_tensor`); rank 0 writes it. So no rank holds more than one whole
tensor at a time, and since the arithmetic is the unsharded recorder's, element by element, the store is the one a
single process records from the same weights.

The store's base must be a folder holding θ₀: `DeltaRecorder(base=FOLDER)` or the local folder the model was
loaded from. Its values are checked against the gathered θ₀ tensor by tensor, as in a single process. Not
supported yet, each refused on every rank in one line: a sharded model without such a folder, resuming a sharded
recording, meshes of more than one dimension.

A failure on rank 0 while writing (a full disk, a NaN) still completes the walk, so that no rank waits in a gather
for ever; then the ranks exchange statuses and all raise the same error (relex.ranks.together).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader
from relex.ranks import Ranks, together
from relex.recording import RecordTiming, local_model_folder, reference, storage_key, ties_within
from relex.store import TrajectoryStore, is_store
from relex.util import most_common_float_dtype

LOG = logging.getLogger(__name__)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2, or FSDP with DTensor parameters)."""
    return any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in model.parameters())


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def gather(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose part on this rank is `local` (placed like `tensor`), on the CPU; every rank takes part."""
    if not hasattr(tensor, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    device = tensor.to_local().device
    spread = DTensor.from_local(local.to(device), tensor.device_mesh, tensor.placements, run_check=False,
                                shape=tensor.shape, stride=tensor.stride())
    return spread.full_tensor().cpu()


class ShardedRecording:
    """The sharded half of a DeltaRecorder: every rank holds one, rank 0's owns the store."""

    def __init__(self, recorder, model: torch.nn.Module, global_step: int):
        import torch.distributed as dist

        self.recorder, self.ranks = recorder, Ranks(dist.get_rank(), dist.get_world_size())
        self.live = {n: t for n, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}
        self.steps: list[int] = []
        with together(self.ranks, "starting to record a sharded model"):
            for name, tensor in self.live.items():
                if len(getattr(tensor, "placements", ())) > 1:
                    raise RelexError(f"tensor {name} is placed on a {len(tensor.placements)}-dimensional mesh; "
                                     "DeltaRecorder gathers FSDP shards of one-dimensional meshes only")
            if global_step != 0 or is_store(recorder.store_dir):
                raise RelexError(f"{recorder.store_dir}: resuming a sharded recording is not supported yet; "
                                 "record into a new store from step 0")
            base = recorder.base or local_model_folder(model)
            if base is None:
                raise RelexError("the model is sharded (FSDP2) and was not loaded from a local folder; pass "
                                 "DeltaRecorder(base=FOLDER) with its initial weights (what from_pretrained read)")
            self.theta0 = self._capture()
            self.base = Path(base)
            recorder._source_dtype = most_common_float_dtype(local_part(t).dtype for t in self.live.values()) or torch.float32
        self._check_base(model)

    def _capture(self) -> dict[str, torch.Tensor]:
        """θ₀ of this rank's parts (float32, CPU); names that share a parameter share one copy."""
        copies, theta0 = {}, {}
        for name, tensor in self.live.items():
            local = local_part(tensor)
            key = storage_key(local)
            if key not in copies:
                copies[key] = local.detach().to("cpu", torch.float32, copy=True)
            theta0[name] = copies[key]
        return theta0

    def _check_base(self, model) -> None:
        """The base folder holds θ₀ (checked tensor by tensor, gathered); then rank 0 creates the store."""
        infos, reader = None, None
        with together(self.ranks, f"checking the base {self.base}"):
            if self.ranks.is_first:
                reader = CheckpointReader(self.base)
                infos = reader.infos()
                for name, info in infos.items():
                    if info.is_float and name not in self.live:
                        raise RelexError(f"base {self.base}: tensor {name} is not a float tensor of the model being trained")
                    if info.is_float and tuple(self.live[name].shape) != info.shape:
                        raise RelexError(f"base {self.base}: tensor {name} has shape {info.shape}, {tuple(self.live[name].shape)} in the model")
        names = self.ranks.broadcast([n for n, i in infos.items() if i.is_float] if infos else [])
        failure = None
        for name in names:  # every rank gathers each tensor; rank 0 compares it with the folder
            theta0 = gather(self.live[name], self.theta0[name])
            if self.ranks.is_first and failure is None:
                stored = reader.read(name)
                if not torch.equal(theta0.to(stored.dtype), stored):
                    failure = RelexError(f"base {self.base}: tensor {name} differs from the model's initial weights; "
                                         "pass DeltaRecorder(base=FOLDER) with the weights training starts from")
        if reader is not None:
            reader.close()
        store = None
        with together(self.ranks, f"creating the store {self.recorder.store_dir}"):
            if failure is not None:
                raise failure
            if self.ranks.is_first:
                local = {n: local_part(t) for n, t in self.live.items()}
                store = TrajectoryStore.create(
                    self.recorder.store_dir, base_dir=reference(self.base.resolve(), self.recorder.store_dir),
                    tensors=infos, tied=ties_within(local, infos),
                    created_by={**self.recorder._provenance(model), "sharded_ranks": self.ranks.world},
                )
        self.recorder.store = store
        self.names = self.ranks.broadcast(store.trajectory_names if store is not None else None)
        LOG.info("recording θ − θ₀ of %d sharded tensors every %d steps (rank %d of %d gathers; rank 0 writes)",
                 len(self.names), self.recorder.every, self.ranks.rank, self.ranks.world)

    def record(self, step: int) -> None:
        """All ranks: gather θ − θ₀ of each tensor in the store's order; rank 0 appends them as step `step`."""
        started, walked = time.perf_counter(), 0

        def delta_of(name: str) -> torch.Tensor:
            nonlocal walked
            if name != self.names[walked]:
                raise RelexError(f"DeltaRecorder: tensor {name} asked for out of order (expected {self.names[walked]})")
            walked += 1
            return self._delta(name)

        failure = None
        if self.ranks.is_first:
            try:
                entry = self.recorder.store.append_deltas(step, delta_of, self.recorder.delta_dtype, self.recorder._source_dtype)
            except Exception as error:  # the other ranks are still gathering: finish the walk with them first
                failure = error
        for name in self.names[walked:]:
            self._delta(name)
        with together(self.ranks, f"recording step {step}"):
            if failure is not None:
                raise failure
        self.steps.append(step)
        if self.ranks.is_first:
            nbytes = (self.recorder.store.path / entry.path).stat().st_size
            self.recorder.timings.append(RecordTiming(step, time.perf_counter() - started, nbytes))

    def _delta(self, name: str) -> torch.Tensor:
        tensor = self.live[name]
        local = local_part(tensor).detach().to("cpu", torch.float32) - self.theta0[name]
        return gather(tensor, local)
