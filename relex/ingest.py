"""`relex ingest`: make a trajectory store from an existing run's checkpoints.

Layouts recognised (step numbers come from the layout or from the user, never from a model name):
- Hugging Face Trainer: `RUN/checkpoint-N/` (optimizer, scheduler and RNG files are ignored);
- verl: `RUN/global_step_N/actor/huggingface/` or `RUN/global_step_N/huggingface/`, or the unmerged FSDP shards
  `RUN/global_step_N/actor/model_world_size_W_rank_R.pt` read as they are (relex.io.verl_shards);
- plain HF folders, with the step numbers given by `--steps`;
- revisions of a hub repository, `hf://ORG/REPO` with `--revisions`, read in the hub cache (relex.io.hub).

By default the store references the checkpoints in place, after validating every tensor's name, shape and
dtype against the base and every file's header and size, without reading the values: a NaN or Inf is caught
later by the pass that reads them (a step's Gram diagonal, or the weighted sum), which names the tensor and the
step. `--verify` scans every value for NaN/Inf here instead; `--copy` writes the deltas into the store (reading,
and checking, every value).
Tied tensors come from the model's architecture as its config.json declares it (`tie_word_embeddings`), never
from values that happen to be equal.

The store is written under a temporary name beside OUT and renamed into place when complete (relex.io.atomic),
holding OUT's lock throughout. A run of the same command after an interrupted one (killed, power lost) continues
the steps the first one wrote. `--repoint` points an existing store at a run that moved.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relex.errors import RelexError
from relex.io.atomic import atomic_output, check_output, write_lock
from relex.io.checkpoint import CheckpointReader, TensorInfo, checkpoint_infos, read_config, weight_files
from relex.io.dtypes import dtype_name, parse_dtype
from relex.io.hub import (
    hub_revisions,
    is_hub_path,
    parse_hub_path,
    revision_step,
    snapshot,
)
from relex.io.stream_writer import writes_direct
from relex.io.verl_shards import open_checkpoint, shard_files
from relex.store import MANIFEST_NAME, MAX_STEP, TrajectoryStore, all_finite, check_io_mode, is_store
from relex.util import comma_list, most_common_float_dtype, reused

LOG = logging.getLogger(__name__)

_TRAINER = re.compile(r"checkpoint-(\d+)")  # any digits here; non-ASCII ones are refused by step_number
_VERL = re.compile(r"global_step_(\d+)")
VERL_MODEL_DIRS = ("actor/huggingface", "huggingface")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    folder: Path
    layout: str  # "hf-trainer", "verl" or "plain"


def resolve_base(base: str) -> Path:
    """A local HF folder, or a hub id downloaded to the local cache (needs the network)."""
    if is_hub_path(base):  # hf://ORG/REPO@REVISION: one revision, through the hub cache (relex.io.hub)
        return snapshot(*parse_hub_path(base))
    path = Path(base)
    if path.exists():
        weight_files(path)
        read_config(path)  # a broken config.json fails here, not after the whole computation
        return path.resolve()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base):
        from huggingface_hub import (
            snapshot_download,  # a hub id: users with the network
        )

        return Path(snapshot_download(base, allow_patterns=["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja"]))
    raise RelexError(f"base {base!r}: no such folder (and not a hub id like org/name)")


def _verl_model_dir(folder: Path) -> Path:
    if shard_files(folder / "actor") and not any((folder / "actor" / "huggingface").glob("*.safetensors")):
        return folder / "actor"  # unmerged FSDP shards, read as they are (relex.io.verl_shards)
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
        return Checkpoint(step_number(match.group(1), folder), folder, "hf-trainer")
    if match := _VERL.fullmatch(folder.name):
        return Checkpoint(step_number(match.group(1), folder), _verl_model_dir(folder), "verl")
    return None


def step_number(digits: str, where) -> int:
    """The step a folder name or option gives: ASCII digits within int64, or a one-line refusal naming it."""
    if not digits.isascii() or not digits.isdigit():
        raise RelexError(f"{where}: step number {digits!r} is not written in the digits 0-9")
    if len(digits) > 19 or int(digits) > MAX_STEP:
        raise RelexError(f"{where}: step number {digits[:25]}{'…' if len(digits) > 25 else ''} is too large (at most {MAX_STEP})")
    return int(digits)


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


def hub_checkpoints(paths: list[str | Path], revisions: list[str] | None, steps: list[int] | None) -> list[Checkpoint]:
    """One checkpoint per revision of a hub repository, read in the hub cache (relex.io.hub); steps are checked
    (from the revision names, or `steps`) before anything is fetched."""
    repo_id, names = hub_revisions(paths, revisions)
    if steps is not None and len(steps) != len(names):
        raise RelexError(f"--steps gives {len(steps)} step numbers for {len(names)} revisions")
    numbers = steps or [step_number(revision_step(name), f"revision {name}") for name in names]
    order = sorted(range(len(names)), key=numbers.__getitem__)
    check_steps([numbers[i] for i in order])
    return [Checkpoint(numbers[i], snapshot(repo_id, names[i]), "hub") for i in order]


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
    parts = comma_list(text)
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise RelexError(f"cannot read --steps {text!r}; give step numbers like 10,20,40")
    return [step_number(part, "--steps") for part in parts]


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
    # a tied weight stored under both of its names (unmerged verl shards): the name the base has is the one read
    kept = {name for names in reader.shared() if names & base.keys() for name in names}
    extra = sorted(set(infos) - set(base) - kept)
    if extra:
        raise RelexError(f"{where}: tensor {extra[0]} is not in the base checkpoint")
    return infos


def declared_ties(base_dir: Path, infos: dict[str, TensorInfo], readers: list = ()) -> dict[str, str]:
    """alias -> canonical for the tensors the model's architecture ties (config.json), both stored in the checkpoint.

    The model is built from its config on the meta device (no memory, no weights): parameters it shares under
    several names are the ties. A checkpoint that stores only one of the names needs no tie. Without a config
    transformers can build, nothing is tied: each stored tensor then has its own trajectory, which is exact.
    A tie needs equal values in every checkpoint, so when no two stored tensors are equal in each of `readers`
    (`equal_tensors`) there is none to find, and the model (transformers' import alone takes seconds) is not built.
    """
    config = read_config(base_dir)
    if not config or not config.get("tie_word_embeddings", True):
        return {}
    equal = equal_tensors(readers, infos) if readers else None
    if equal is not None and not equal:
        return {}
    try:
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base_dir))
    except Exception as error:  # an architecture this transformers does not know: ties cannot be read from it
        LOG.warning("%s: cannot build the model from config.json (%s); no tensors are treated as tied", base_dir, str(error)[:200])
        return {}
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    tied = {}
    for names in groups.values():
        stored = [n for n in names if n in infos and infos[n].is_float]
        for alias in stored[1:]:
            if infos[alias] != infos[stored[0]]:
                continue
            if equal is not None and not any({alias, stored[0]} <= same for same in equal):
                LOG.warning("%s and %s are tied in the config but differ in the base or the last checkpoint; recording both", alias, stored[0])
                continue
            tied[alias] = stored[0]
    return tied


def equal_tensors(readers: list, infos: dict[str, TensorInfo]) -> list[set[str]]:
    """Sets of two or more float tensors (same shape and dtype) whose values are equal in each of `readers`.

    Tensors are told apart by their first row's bytes, then by whole values only where those agree, so a trained
    model's tensors cost one row each to rule out.
    """
    groups: dict[TensorInfo, list[str]] = {}
    for name, info in sorted(infos.items()):
        if info.is_float:
            groups.setdefault(info, []).append(name)
    classes = [names for names in groups.values() if len(names) > 1]
    for reader in readers:
        split = []
        for names in classes:
            by_row: dict[bytes, list[str]] = {}
            for name in names:
                by_row.setdefault(_bytes(reader.read(name, rows=(0, 1))), []).append(name)
            for same_row in by_row.values():
                while len(same_row) > 1:
                    first = reader.read(same_row[0])
                    equal = [n for n in same_row[1:] if torch.equal(reader.read(n), first)]
                    if equal:
                        split.append([same_row[0], *equal])
                    same_row = [n for n in same_row[1:] if n not in equal]
        classes = split
    return [set(names) for names in classes]


def _bytes(values: torch.Tensor) -> bytes:
    return values.reshape(-1).view(torch.uint8).numpy().tobytes()


class ValueScan:
    """`--verify`: every value of a checkpoint read once, so that NaN/Inf and unreadable data fail at ingest rather
    than in a later pass.

    Each tensor is read into one buffer, reused from tensor to tensor and from checkpoint to checkpoint (new memory
    costs a page fault per 4 KiB), and summed in float32: a NaN or Inf makes the sum non-finite. Only a sum that is
    not finite, which finite values can also give by overflowing, is looked at value by value. On the 11.3 GB
    SmolLM2 run that took `relex ingest --verify` from 12.6 s to 2.7 s (docs/performance.md): a new tensor per
    read and an `isfinite` mask per tensor had faulted in two new copies of every value.
    """

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def __call__(self, reader: CheckpointReader, checkpoint: Checkpoint, names: list[str]) -> None:
        for name in names:
            info = reader.info(name)
            nbytes = info.numel * info.dtype.itemsize
            self.buffer = reused(self.buffer, nbytes, torch.uint8)
            values = self.buffer[:nbytes].view(info.dtype).view(info.shape)
            reader.read_into(name, values)
            if values.is_floating_point() and not all_finite(values):
                raise RelexError(f"{checkpoint.folder} (step {checkpoint.step}): tensor {name} has NaN or Inf values")


def drop_broken_ties(reader: CheckpointReader, checkpoint: Checkpoint, tied: dict[str, str]) -> None:
    """Ties of the config whose two tensors differ in this checkpoint are dropped (only tied tensors are read)."""
    for alias, canonical in list(tied.items()):
        if not torch.equal(reader.read(alias), reader.read(canonical)):
            LOG.warning("%s (step %d): %s and %s are tied in the config but differ; recording both", checkpoint.folder, checkpoint.step, alias, canonical)
            del tied[alias]


def checked_readers(checkpoints: list, base_dir: Path, base_reader: CheckpointReader, base_infos: dict, verify: bool) -> tuple[list, dict[str, str]]:
    """Each checkpoint opened and checked against the base (names, shapes, dtypes, headers; with `verify` every
    value scanned for NaN/Inf), and the ties the model's config declares that every checkpoint keeps."""
    readers = []
    for checkpoint in checkpoints:
        reader = open_checkpoint(checkpoint.folder)
        readers.append((checkpoint, reader, validate_checkpoint(base_infos, checkpoint, reader)))
    last = readers[-1][1] if readers else None
    tied = declared_ties(base_dir, base_infos, [base_reader, last] if last is not None else [base_reader])
    scan = ValueScan()
    for checkpoint, reader, _ in tqdm(readers, desc="ingest: checking values", unit="step", leave=False, disable=None if verify else True):
        if verify:
            scan(reader, checkpoint, sorted(base_infos))
        if reader is not last:  # a tie declared_ties kept was found equal in the last checkpoint already
            drop_broken_ties(reader, checkpoint, tied)
    return readers, tied


def ingest(
    paths: list[str | Path],
    base: str,
    out: str | Path,
    *,
    steps: list[int] | None = None,
    copy: bool = False,
    delta_dtype: str | None = None,
    overwrite: bool = False,
    repoint: bool = False,
    revisions: list[str] | None = None,
    verify: bool = False,
    io: str = "auto",
) -> TrajectoryStore:
    """Make the store `out` from the checkpoints under `paths` (or, with `repoint`, point `out` at them).

    Values are read only with `verify` (every value scanned for NaN/Inf), `copy`, or for tensors the config ties.
    `io`: how `copy` writes the deltas (relex.store.IO_MODES): past the page cache (O_DIRECT, where the file system
    allows) unless `cached`.
    """
    check_io_mode(io)
    out = Path(out)
    if repoint:
        return repoint_store(paths, base, out, steps)
    if revisions or any(is_hub_path(p) for p in paths):
        checkpoints = hub_checkpoints(paths, revisions, steps)
    else:
        checkpoints = discover_checkpoints(paths, steps)
    base_dir = resolve_base(base)
    inputs = [*paths, *(c.folder for c in checkpoints), base_dir]
    check_output(out, overwrite=overwrite, inputs=inputs)
    stored_dtype = parse_dtype(delta_dtype) if delta_dtype else None
    if stored_dtype is not None and not copy:
        raise RelexError("--delta-dtype applies to copied deltas; add --copy")
    with write_lock(out), _store_lock_if_store(out), contextlib.ExitStack() as closing:  # every reader closed at the end
        base_reader = closing.enter_context(CheckpointReader(base_dir))
        base_infos = base_reader.infos()
        readers, tied = checked_readers(checkpoints, base_dir, base_reader, base_infos, verify)
        for _, reader, _ in readers:
            closing.enter_context(reader)
        created_by = {
            "command": "relex ingest",
            "layout": sorted({c.layout for c in checkpoints}),
            "mode": "copy" if copy else "reference",
            "delta_dtype": dtype_name(stored_dtype) if stored_dtype is not None else None,
            "sources": {str(c.step): str(c.folder.resolve()) for c in checkpoints},
        }
        resumable = _resumable(created_by, base_dir, base_infos, tied)
        with atomic_output(out, overwrite=overwrite, inputs=inputs, adopt=resumable) as tmp:
            if is_store(tmp):
                store = TrajectoryStore.open(tmp)
            else:
                store = TrajectoryStore.create(
                    tmp, base_dir=base_dir, tensors=base_infos, tied=tied, created_by=created_by,
                    pending=[c.step for c in checkpoints],
                )
            with store.lock():
                _record(store, base_reader, readers, copy, stored_dtype, io)
    return TrajectoryStore.open(out)


def _store_lock_if_store(out: Path):
    """The lock of a store about to be replaced, so that nobody is appending to it meanwhile."""
    return write_lock(out / MANIFEST_NAME) if is_store(out) else contextlib.nullcontext()


def _record(store: TrajectoryStore, base_reader: CheckpointReader, readers: list, copy: bool, stored_dtype, io: str) -> None:
    todo = [(c, r, i) for c, r, i in readers if c.step not in store.steps]
    deltas = _Deltas(base_reader)
    with _one_torch_thread() if copy else contextlib.nullcontext():
        for checkpoint, reader, infos in tqdm(todo, desc="ingest: recording", unit="step", leave=False, disable=None):
            source_dtype = most_common_float_dtype(info.dtype for info in infos.values())
            if copy:
                delta_of = functools.partial(deltas, reader)
                entry = store.append_deltas(checkpoint.step, delta_of, stored_dtype, source_dtype, direct=writes_direct(io))
            else:
                entry = store.append_checkpoint(checkpoint.step, checkpoint.folder, source_dtype)
            LOG.debug("step %d: %s", entry.step, entry.kind)


@contextlib.contextmanager
def _one_torch_thread():
    """torch's arithmetic on one thread while `--copy` writes deltas: a subtraction and a sum per tensor, between
    which a second OpenMP thread only spins, waiting for the next one while this thread reads and writes. On the
    SmolLM2 run that spinning was 20 of the 27 CPU-s of `relex ingest --copy`, on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_SAME_RUN_KEYS = ("command", "layout", "mode", "delta_dtype", "sources")


def _resumable(created_by: dict, base_dir: Path, infos: dict[str, TensorInfo], tied: dict[str, str]):
    """Whether the temporary store an interrupted ingest left is this same ingest, so it can be continued."""
    def same(path: Path) -> bool:
        try:
            store = TrajectoryStore.open(path)
        except RelexError:
            return False
        made = store.manifest.get("created_by", {})
        return (
            all(made.get(key) == created_by[key] for key in _SAME_RUN_KEYS)
            and store.manifest["base"].get("absolute") == str(base_dir)
            and store.tensors == infos
            and store.tied == tied
            and set(store.steps) <= {int(s) for s in created_by["sources"]}
        )

    return same


def repoint_store(paths: list[str | Path], base: str, out: Path, steps: list[int] | None = None) -> TrajectoryStore:
    """Point the referenced steps of the store `out` (and its base) at the same checkpoints in a new place."""
    store = TrajectoryStore.open(out)
    checkpoints = {c.step: c for c in discover_checkpoints(paths, steps)}
    referenced = [e for e in store.entries if e.kind == "checkpoint"]
    missing = [e.step for e in referenced if e.step not in checkpoints]
    if missing:
        raise RelexError(f"{out}: references step{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, not found under {', '.join(map(str, paths))}")
    base_dir = resolve_base(base)
    expected = store.tensors
    base_infos = checkpoint_infos(base_dir)
    if base_infos != expected:
        differing = sorted(set(base_infos) ^ set(expected)) or [n for n in expected if base_infos[n] != expected[n]]
        raise RelexError(f"base {base_dir}: tensor {differing[0]} is not as in the store {out}; this is another model")
    for entry in referenced:
        checkpoint = checkpoints[entry.step]
        validate_checkpoint(expected, checkpoint, open_checkpoint(checkpoint.folder))
    with store.lock():
        store.repoint({e.step: checkpoints[e.step].folder for e in referenced}, base_dir)
    LOG.debug("%s: %d referenced steps and the base re-pointed", out, len(referenced))
    return TrajectoryStore.open(out)


class _Deltas:
    """θ_s − θ₀ of a tensor as float32 (`deltas(reader, name)`), for `--copy`: TrajectoryStore.append_deltas writes
    each before it asks for the next, so they are formed in two buffers reused from tensor to tensor and from step
    to step. New memory costs a page fault per 4 KiB, and a new tensor per read, per conversion and for the
    difference made three of them."""

    def __init__(self, base: CheckpointReader):
        self.base = base
        self.buffers = [torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.float32)]

    def _float32(self, source, name: str, k: int) -> torch.Tensor:
        info = source.info(name)
        self.buffers[k] = reused(self.buffers[k], info.numel, torch.float32)
        out = self.buffers[k][: info.numel].view(info.shape)
        if info.dtype == torch.float32:
            source.read_into(name, out)
        else:
            out.copy_(source.read(name))
        return out

    def __call__(self, reader: CheckpointReader, name: str) -> torch.Tensor:
        return self._float32(reader, name, 0).sub_(self._float32(self.base, name, 1))
