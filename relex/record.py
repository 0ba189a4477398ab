"""`DeltaRecorder`: record θ_step − θ₀ into a trajectory store while a Hugging Face or TRL trainer runs.

    from relex import DeltaRecorder
    trainer.add_callback(DeltaRecorder("run/trajectory", every=2))
    trainer.train()

On train begin the recorder unwraps the model, captures θ₀ (a float32 CPU copy of every float tensor of the
state dict, tied tensors once) and creates the store, or opens it when the run resumes. Every `every` optimizer
steps, and at the last step, it appends θ_step − θ₀ under the trainer's real step number, computed from the
weights the optimizer updates (the float32 masters under mixed precision); optimizer state is never recorded.

The store's base is a checkpoint folder that holds θ₀ exactly (in the folder's dtype): the `base` folder when
given, else the model's own `name_or_path` when it is a local safetensors folder whose values match, else θ₀
written into the store as `STORE/base/`. A store made from another base (other tensor names or shapes, or other
values) is refused before anything is written, naming the first tensor that differs.

Resuming (`trainer.train(resume_from_checkpoint=...)`): the trainer loads the checkpoint before train begin, so
the model no longer holds θ₀; θ₀ is then read from the store's base, and the checkpoint's weights are checked
against the store's delta at that step when it was recorded. A store that already holds steps after the step
training resumes from is refused (those steps would be recorded twice, from a rerun that may differ); drop them
first with `TrajectoryStore.truncate` (`relex train --resume` does).

Under DDP (`accelerate launch`, torchrun) every rank holds a recorder, and rank 0 alone captures θ₀ and writes
the store. At train begin and at each recorded step the ranks exchange one status (relex.ranks.together), so a
failure on rank 0 (a full disk, a store of another model) ends every rank with the same line instead of leaving the
others waiting in the next step's collective; they would wait for rank 0 there anyway, so this costs no time.
Under FSDP2 every rank takes part in each record (relex.record_sharded). DeepSpeed is refused at train begin on
every rank, in one line: its ZeRO stages keep the float32 weights inside the DeepSpeed optimizer, which relex does
not read, and it has not been run here.

`recorder.timings` holds the seconds each record took and `recorder.overhead()` compares them with the
training steps, so the cost of recording can be reported.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from relex.errors import RelexError
from relex.io.atomic import pid_alive
from relex.io.checkpoint import CheckpointReader, TensorInfo, checkpoint_infos
from relex.io.dtypes import dtype_name, parse_dtype
from relex.io.hf_folder import HFFolderWriter, make_inference_ready
from relex.ranks import Ranks, together
from relex.record_sharded import ShardedRecording, is_sharded
from relex.recording import RecordTiming, local_model_folder, reference, storage_key, ties_within
from relex.store import TrajectoryStore, is_store
from relex.util import is_positive_int, most_common_float_dtype

LOG = logging.getLogger(__name__)

BASE_NAME = "base"  # θ₀ saved inside the store, referenced relatively
RESUME_TOLERANCE = 1e-3  # ‖θ_ckpt − (θ₀ + Δ)‖ / ‖Δ‖ allowed when checking a resumed checkpoint against the store


class DeltaRecorder(TrainerCallback):
    """A `TrainerCallback` that appends θ_step − θ₀ to the store at `store_dir` every `every` optimizer steps.

    Args:
        store_dir: the trajectory store to create (or, on a resumed run, to continue; relex.store).
        every: record every `every`-th optimizer step (a positive integer).
        base: a checkpoint folder holding the model's initial weights (default: the model's own folder when it
            matches, else θ₀ is saved into the store).
        delta_dtype: stored precision of the deltas (`float32` default; `bfloat16` halves the store and records
            its rounding error in the manifest).
        background: write each record in a thread while training goes on (one process only): training waits for
            a float32 CPU copy of the weights and for the previous record's write, not for the subtraction and
            the file. A step whose checkpoint the trainer saves is still recorded before the save, so a resumed
            run finds it; a failed write ends training at the next record, or at train end, in one line.

    The store is opened at train begin; `store` holds it afterwards (a `TrajectoryStore`).

    Example:
        from relex import DeltaRecorder
        trainer = GRPOTrainer(model=..., reward_funcs=..., args=...,
                              callbacks=[DeltaRecorder("runs/my-run/trajectory", every=2)])
        trainer.train()  # runs/my-run/trajectory holds the deltas of steps 2, 4, …
    """

    def __init__(
        self,
        store_dir: str | Path,
        every: int = 1,
        base: str | Path | None = None,
        delta_dtype: str | torch.dtype | None = None,
        background: bool = False,
    ):
        if not is_positive_int(every):
            raise RelexError(f"DeltaRecorder: every must be a positive number of optimizer steps, got {every!r}")
        self.store_dir = Path(store_dir)
        self.every = every
        self.base = Path(base) if base is not None else None
        self.delta_dtype = parse_dtype(delta_dtype) if isinstance(delta_dtype, str) else delta_dtype
        self.store: TrajectoryStore | None = None
        self.timings: list[RecordTiming] = []
        self.step_seconds: list[float] = []  # wall time of each optimizer step, recording excluded
        self.setup_seconds = 0.0
        self._live: dict[str, torch.Tensor] = {}
        self._theta0: dict[str, torch.Tensor] = {}
        self._source_dtype: torch.dtype | None = None
        self._last_step_end: float | None = None
        self._sharded: ShardedRecording | None = None  # FSDP2: this rank's part of the recording (relex.record_sharded)
        self._replicas: Ranks | None = None  # DDP: the ranks that exchange a status at each record
        self._replica_steps: list[int] = []  # DDP: the store's steps, known alike on every rank
        self.background = background
        self._writer: threading.Thread | None = None  # the record being written (background)
        self._write_error: BaseException | None = None

    # ---- trainer events ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        refuse_deepspeed(args, model)  # on every rank, so no rank trains on waiting for another
        if model is not None and is_sharded(unwrap_model(model)):  # FSDP2: every rank gathers, rank 0 writes
            self._sharded = ShardedRecording(self, unwrap_model(model), state.global_step)
            self._last_step_end = time.perf_counter()
            return
        if model is not None:  # every rank refuses ZeRO-3's parameters, so no rank trains on waiting for another
            float_state(unwrap_model(model))
        self._replicas = replica_ranks()
        if self._replicas is not None:  # DDP: rank 0 records, the others learn whether it could
            with together(self._replicas, f"starting to record into {self.store_dir}"):
                if self._replicas.is_first:
                    self._begin(model, state.global_step, processing_class)
            self._replica_steps = self._replicas.broadcast(list(self.store.steps) if self.store is not None else None)
            return
        if state.is_world_process_zero:
            self._begin(model, state.global_step, processing_class)

    def _begin(self, model, global_step: int, processing_class) -> None:
        if model is None:
            raise RelexError("DeltaRecorder: the trainer passed no model to the callback")
        started = time.perf_counter()
        self.attach(unwrap_model(model), global_step, processing_class)
        self.setup_seconds = time.perf_counter() - started
        self._last_step_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.store is None and self._sharded is None and self._replicas is None:
            return
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.step_seconds.append(now - self._last_step_end)
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            # a step the trainer saves now, or the last, is written before the save and the end of training
            at_once = control.should_save or state.global_step == state.max_steps
            self.record(state.global_step, wait=at_once)
        self._last_step_end = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.flush()
        # training stopped early (a callback, or the data ran out): the last step is still recorded
        if self._sharded is not None:  # every rank decides alike, from the steps they all gathered
            if state.global_step > 0 and state.global_step not in self._sharded.steps:
                self._sharded.record(state.global_step)
            return
        steps = self._replica_steps if self._replicas is not None else self.store.steps if self.store is not None else None
        if steps is not None and state.global_step > 0 and state.global_step not in steps:
            self.record(state.global_step)

    # ---- setup ---------------------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, global_step: int = 0, processing_class=None) -> TrajectoryStore:
        """Capture θ₀ and create or open the store for a model about to train from `global_step`."""
        live = float_state(model)
        self._source_dtype = most_common_float_dtype(t.dtype for t in live.values()) or torch.float32
        if self._source_dtype != torch.float32:
            LOG.warning(
                "the model trains in %s without float32 master weights: updates smaller than about |w|/256 are "
                "rounded away before they can be recorded", dtype_name(self._source_dtype),
            )
        remove_dead_base_leftovers(self.store_dir)
        if is_store(self.store_dir):
            self.store = self._open(live, global_step)
        elif global_step == 0:
            self.store = self._create(model, live, processing_class)
        else:
            self.store = self._create_mid_run(model, live, global_step)
        self._live = {name: live[name] for name in self.store.trajectory_names}
        LOG.info(
            "recording θ − θ₀ of %d tensors every %d steps into %s (base %s)",
            len(self._live), self.every, self.store.path, self.store.base_dir,
        )
        return self.store

    def _create(self, model, live: dict[str, torch.Tensor], processing_class) -> TrajectoryStore:
        theta0 = capture(live)
        base_dir = self._matching_base_folder(model, live, theta0)
        saved = None
        if base_dir is None:
            saved = save_base(model, live, base_tmp_dir(self.store_dir), processing_class)
            base_dir = saved
        infos = checkpoint_infos(base_dir)
        store = TrajectoryStore.create(
            self.store_dir,
            base_dir=BASE_NAME if saved else reference(base_dir, self.store_dir),
            tensors=infos,
            tied=ties_within(live, infos),
            created_by=self._provenance(model),
        )
        if saved is not None:
            os.replace(saved, store.path / BASE_NAME)
        self._theta0 = {name: theta0[name] for name in store.trajectory_names}
        return store

    def _create_mid_run(self, model, live: dict[str, torch.Tensor], global_step: int) -> TrajectoryStore:
        """A store started while resuming: θ₀ can only come from a base folder, since the model has moved."""
        folder = self.base or local_model_folder(model)
        if folder is None:
            raise RelexError(
                f"{self.store_dir}: no store to continue, and training resumes at step {global_step}, so the model "
                "no longer holds θ₀; pass DeltaRecorder(base=FOLDER) with the initial weights, or record from step 0"
            )
        infos = checkpoint_infos(folder)
        check_layout(live, infos, f"base {folder}")
        store = TrajectoryStore.create(
            self.store_dir, base_dir=reference(folder, self.store_dir), tensors=infos, tied=ties_within(live, infos),
            created_by={**self._provenance(model), "started_at_step": global_step},
        )
        self._theta0 = read_theta0(store)
        return store

    def _open(self, live: dict[str, torch.Tensor], global_step: int) -> TrajectoryStore:
        store = TrajectoryStore.open(self.store_dir)
        check_layout(live, store.tensors, f"store {store.path} (base {store.base_dir})")
        if global_step == 0:
            with CheckpointReader(store.base_dir) as reader:
                check_values(live, reader, f"store {store.path}")
        later = [s for s in store.steps if s > global_step]
        if later:
            raise RelexError(
                f"{store.path}: already holds step{'s' if len(later) > 1 else ''} {', '.join(map(str, later))}, after "
                f"step {global_step} where this training starts; they would be recorded twice. Resume from the "
                f"checkpoint of step {store.steps[-1]}, drop them first with TrajectoryStore.open(path).truncate("
                f"{global_step}) (relex train --resume does), or record into a new store"
            )
        if global_step == 0:
            self._theta0 = capture({name: live[name] for name in store.trajectory_names})
        else:
            self._theta0 = read_theta0(store)
            if global_step in store.steps:
                check_resumed(live, self._theta0, store, global_step)
        LOG.info("continuing %s at step %d (recorded: %d steps)", store.path, global_step, len(store.steps))
        return store

    def _matching_base_folder(self, model, live, theta0) -> Path | None:
        """The base folder to reference: `base` (must match), else the model's own folder if it matches."""
        if self.base is not None:
            with CheckpointReader(self.base) as reader:
                check_layout(live, reader.infos(), f"base {self.base}")
                check_values(theta0, reader, f"base {self.base}")
            return self.base.resolve()
        folder = local_model_folder(model)
        if folder is None:
            return None
        try:
            with CheckpointReader(folder) as reader:
                check_layout(live, reader.infos(), f"model folder {folder}")
                check_values(theta0, reader, f"model folder {folder}")
        except RelexError as error:
            LOG.warning("not referencing the model's folder as the base (%s); saving θ₀ into the store", error)
            return None
        return folder

    def _provenance(self, model) -> dict:
        return {
            "command": "relex.DeltaRecorder",
            "record_every": self.every,
            "model": getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__,
            "source_dtype": dtype_name(self._source_dtype) if self._source_dtype else None,
        }

    # ---- recording -----------------------------------------------------------------------------------------------
    def record(self, step: int, wait: bool = True):
        """Append θ − θ₀ at `step`; a step already in the store is refused. With `background` and not `wait`, the
        write goes on in a thread after this returns (`flush` waits for it)."""
        if self._sharded is not None:  # every rank takes part; rank 0 writes
            return self._sharded.record(step)
        if self._replicas is not None:  # DDP: rank 0 writes; every rank learns whether it could
            entry = None
            with together(self._replicas, f"recording step {step}"):
                if self._replicas.is_first:
                    entry = self._append(step)
            self._replica_steps.append(step)
            return entry
        self.flush()
        if self.background and not wait:
            return self._append_behind(step)
        return self._append(step)

    def flush(self) -> None:
        """Wait for the record being written in the background; its failure is raised here, in one line."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._write_error = self._write_error, None
        if isinstance(error, RelexError):
            raise error
        if error is not None:
            raise RelexError(f"{self.store_dir}: recording in the background failed: {error}") from error

    def _append_behind(self, step: int) -> None:
        if self.store is None:
            raise RelexError("DeltaRecorder: nothing to record yet (the trainer has not begun training)")
        started = time.perf_counter()
        weights = {name: tensor.detach().to("cpu", torch.float32, copy=True) for name, tensor in self._live.items()}
        waited = time.perf_counter() - started  # what training waits for; the write goes on beside it
        itemsize = torch.empty((), dtype=self.delta_dtype or torch.float32).element_size()
        self.timings.append(RecordTiming(step, waited, itemsize * sum(w.numel() for w in weights.values())))

        def write() -> None:
            try:
                written = time.perf_counter()
                self.store.append_deltas(step, lambda name: weights[name] - self._theta0[name], self.delta_dtype,
                                         self._source_dtype)
                LOG.debug("recorded step %d in the background in %.3f s", step, time.perf_counter() - written)
            except BaseException as error:  # raised in the training thread by the next flush
                self._write_error = error

        self._writer = threading.Thread(target=write, name="relex-recorder", daemon=True)
        self._writer.start()

    def _append(self, step: int):
        if self.store is None:
            raise RelexError("DeltaRecorder: nothing to record yet (the trainer has not begun training)")
        started = time.perf_counter()
        entry = self.store.append_deltas(step, self._delta, self.delta_dtype, self._source_dtype)
        seconds = time.perf_counter() - started
        nbytes = (self.store.path / entry.path).stat().st_size
        self.timings.append(RecordTiming(step, seconds, nbytes))
        LOG.debug("recorded step %d in %.3f s (%.1f MB)", step, seconds, nbytes / 1e6)
        return entry

    def _delta(self, name: str) -> torch.Tensor:
        return self._live[name].detach().to("cpu", torch.float32) - self._theta0[name]

    def overhead(self) -> dict[str, float]:
        """Recording time against training time: total and mean seconds, and their ratio (with `background`, the
        time training waited for each record)."""
        record = sum(t.seconds for t in self.timings)
        train = sum(self.step_seconds)
        return {
            "records": len(self.timings),
            "record_seconds": record,
            "record_seconds_mean": record / len(self.timings) if self.timings else 0.0,
            "setup_seconds": self.setup_seconds,
            "steps": len(self.step_seconds),
            "step_seconds_mean": train / len(self.step_seconds) if self.step_seconds else 0.0,
            "overhead": record / train if train > 0 else 0.0,
        }


# ---- the model's tensors ------------------------------------------------------------------------------------------
def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP, DeepSpeed or torch.compile wrappers."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def replica_ranks() -> Ranks | None:
    """This process's place among the ranks of a data-parallel run (torch.distributed with more than one
    process); None in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return Ranks(dist.get_rank(), dist.get_world_size())


SUPPORTED = "one process, DDP and FSDP/FSDP2 (accelerate launch --multi_gpu or --use_fsdp, or torchrun)"


def deepspeed_in_use(args=None, model=None) -> str | None:
    """What shows that training runs under DeepSpeed (None when nothing does): the model or one of its wrappers is
    a DeepSpeed engine, a parameter is partitioned by ZeRO-3, the training arguments name a DeepSpeed config, or
    accelerate was launched or set up for DeepSpeed."""
    wrapper = model
    while isinstance(wrapper, torch.nn.Module):
        if type(wrapper).__module__.split(".")[0] == "deepspeed":
            return f"the model is wrapped in {type(wrapper).__name__}"
        wrapper = getattr(wrapper, "module", None)
    if isinstance(model, torch.nn.Module):
        for name, parameter in model.named_parameters():
            if hasattr(parameter, "ds_id"):
                return f"parameter {name} is partitioned by DeepSpeed ZeRO-3"
    if getattr(args, "deepspeed", None):
        return f"the training arguments name a DeepSpeed config ({args.deepspeed!r})"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        return "ACCELERATE_USE_DEEPSPEED is set, as accelerate launch --use_deepspeed does"
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if AcceleratorState._shared_state.get("distributed_type") == DistributedType.DEEPSPEED:
        return "accelerate is set up for DeepSpeed"
    return None


def refuse_deepspeed(args=None, model=None, who: str | None = "DeltaRecorder") -> None:
    """Raise one line when training runs under DeepSpeed, naming what recording supports instead."""
    found = deepspeed_in_use(args, model)
    if found is not None:
        raise RelexError(
            f"{who + ': ' if who else ''}this run trains with DeepSpeed ({found}); recording supports {SUPPORTED}. Train with one of "
            "those, or save checkpoints under DeepSpeed and make a store of them with relex ingest"
        )


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live float tensors of the state dict by name (a tied tensor appears under each of its names)."""
    live = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue
        if type(tensor.data).__name__ == "DTensor" or hasattr(tensor, "ds_id"):
            raise RelexError(
                f"tensor {name} is sharded (FSDP or DeepSpeed ZeRO-3); DeltaRecorder needs whole parameters on "
                "the main process; record from a run without parameter sharding, or save checkpoints and "
                "use `relex ingest`"
            )
        live[name] = tensor
    return live


def capture(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of each tensor; names that share storage share one copy."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in live.items():
        key = storage_key(tensor)
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", torch.float32, copy=True)
        out[name] = copies[key]
    return out


# ---- checks against a base -------------------------------------------------------------------------------------
def check_layout(live: dict[str, torch.Tensor], infos: dict[str, TensorInfo], where: str) -> None:
    """Every float tensor of the base is in the model with the same shape, and every model tensor is in the base
    (or is a tied alias of one that is)."""
    for name, info in infos.items():
        if not info.is_float:
            continue
        if name not in live:
            raise RelexError(f"{where}: tensor {name} is not a float tensor of the model being trained")
        if tuple(live[name].shape) != info.shape:
            raise RelexError(f"{where}: tensor {name} has shape {info.shape}, {tuple(live[name].shape)} in the model")
    present = {storage_key(live[n]) for n in infos if n in live}
    for name, tensor in live.items():
        if name not in infos and storage_key(tensor) not in present:
            raise RelexError(f"{where}: the model's tensor {name} is not in the base")


def check_values(theta: dict[str, torch.Tensor], reader: CheckpointReader, where: str) -> None:
    """θ₀, rounded to the folder's dtype, equals the folder's values exactly."""
    for name, info in reader.infos().items():
        if not info.is_float or name not in theta:
            continue
        stored = reader.read(name)
        if not torch.equal(theta[name].detach().to("cpu", info.dtype), stored):
            diff = (theta[name].detach().to("cpu", torch.float32) - stored.float()).abs().max()
            raise RelexError(
                f"{where}: tensor {name} differs from the model's initial weights (max |difference| {float(diff):.3g}); "
                "this store or base belongs to another model; record into a new store"
            )


def read_theta0(store: TrajectoryStore) -> dict[str, torch.Tensor]:
    with CheckpointReader(store.base_dir) as reader:
        return {name: reader.read(name).float() for name in store.trajectory_names}


def check_resumed(live: dict[str, torch.Tensor], theta0: dict[str, torch.Tensor], store: TrajectoryStore, step: int) -> None:
    """The checkpoint training resumes from holds θ₀ + Δ_step of the store, up to the stored precision."""
    entry = store.entry(step)
    if entry.kind != "delta":
        return
    tolerance = RESUME_TOLERANCE + 2 * (entry.quantization_error or 0.0)
    with CheckpointReader.from_file(store.path / entry.path) as deltas:
        for name in store.trajectory_names:
            delta = deltas.read(name).float()
            error = (live[name].detach().to("cpu", torch.float32) - theta0[name] - delta).norm()
            if error > tolerance * delta.norm() + 1e-6 * theta0[name].norm():
                raise RelexError(
                    f"{store.path}: tensor {name} of the checkpoint at step {step} is not θ₀ + the delta recorded at "
                    f"step {step} (relative difference {float(error / max(delta.norm(), 1e-30)):.3g}); this checkpoint "
                    "belongs to another run"
                )


# ---- saving θ₀ ----------------------------------------------------------------------------------------------------
def base_tmp_dir(store_dir: Path, pid: int | None = None) -> Path:
    """Where θ₀ is saved before it moves into a new store: `.STORE.base-tmp-PID`, beside the store."""
    return store_dir.parent / f".{store_dir.name}.base-tmp-{os.getpid() if pid is None else pid}"


def remove_dead_base_leftovers(store_dir: Path) -> list[Path]:
    """Remove the `.STORE.base-tmp-PID` folders that processes no longer running left (a recorder killed while it
    saved θ₀); a live process's is its own business. Returns what was removed, and says so in one line."""
    removed = []
    if store_dir.parent.is_dir():
        for entry in store_dir.parent.glob(f".{store_dir.name}.base-tmp-*"):
            pid = entry.name.rpartition("-")[2]
            if pid.isdigit() and entry == base_tmp_dir(store_dir, int(pid)) and not pid_alive(int(pid)):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
    if removed:
        LOG.warning("%s: removed %s, left by interrupted recorders", store_dir, ", ".join(sorted(p.name for p in removed)))
    return removed


def save_base(model, live: dict[str, torch.Tensor], out_dir: Path, processing_class=None) -> Path:
    """Write the model's current state dict (every name, in its dtype) as an HF folder, with config and tokenizer."""
    state = {name: t for name, t in model.state_dict().items()}
    layout = [(name, TensorInfo(tuple(t.shape), t.dtype)) for name, t in state.items()]
    shutil.rmtree(out_dir, ignore_errors=True)
    writer = HFFolderWriter(out_dir, layout, base_dir=None)
    try:
        for name, _ in layout:
            writer.write(name, state[name].detach().to("cpu").contiguous())
        writer.finish(None, {"made_by": "relex.DeltaRecorder", "what": "the model's weights when training began (θ₀)"})
    except BaseException:
        writer.abort()
        raise
    for part in (getattr(model, "config", None), getattr(model, "generation_config", None), processing_class):
        if part is not None and hasattr(part, "save_pretrained"):
            part.save_pretrained(out_dir)
    # config.save_pretrained alone writes no `architectures` (the model's own save_pretrained adds it), and training
    # leaves `use_cache: false`; every folder relex writes, θ₀ included, is ready for inference
    make_inference_ready(out_dir, getattr(model, "dtype", None), architecture=type(model).__name__.removeprefix("FSDP"))
    return out_dir
