"""The trajectory store: a base checkpoint plus the deltas θ_s − θ₀ of one run at its real step numbers.

A store is a folder:

    STORE/manifest.json                      base reference, steps, tensor names/shapes/dtypes, ties, provenance
    STORE/deltas/step-00000040.safetensors   one file per recorded step (when deltas are materialised)
    STORE/base/                              the base checkpoint, when it was not a folder that outlives the run

A step is either a materialised delta file or a reference to a checkpoint folder left in place (`relex ingest`
without `--copy`); both read the same. Referenced folders (and the base) are stored relative to the store, with
the absolute path beside it, so a run that moves together with its store still reads; `relex ingest --repoint`
points a store at a run that moved without it.

Writers hold the store's lock (`STORE/.manifest.json.lock`, relex.io.atomic) while they append, so a second writer
is refused naming the first one's PID. Steps are appended one at a time: the data file is written under a
temporary name unique to the process and renamed, then the manifest is re-read and replaced whole, so a step
exists once the manifest lists it and readers always see a consistent store. A store being filled by `relex
ingest` lists the steps still to come under `pending`; passes over the store (`reader`) refuse it until they are
written. `truncate` drops the steps after a given one (a resumed training run records them again).
Reading a tensor across steps is lazy and goes by row blocks, read ahead in a background thread
(`TrajectoryReader.stream`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from relex import __version__
from relex.errors import RelexError
from relex.io.atomic import clean_leftovers_inside, write_json_atomic, write_lock
from relex.io.checkpoint import CheckpointReader, TensorInfo
from relex.io.dtypes import SAFETENSORS_TO_TORCH, dtype_name, from_name
from relex.io.safetensors_file import SafetensorsFile
from relex.io.stream_writer import StreamingSafetensorsWriter
from relex.io.verl_shards import open_checkpoint
from relex.util import is_int, is_positive_int, most_common_float_dtype, reused

LOG = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
IO_MODES = ("auto", "direct", "cached")
STREAM_BUFFERS = 4  # buffers a stream cycles through: one the caller holds, the others the reader thread fills
STREAM_BYTES = 2**30  # ... as many as fit in this much memory, but at least 2
# reader threads of a stream: one leaves the other cores to compute on small machines; on larger ones a second
# keeps more reads in flight (fast NVMe and network file systems need a deeper queue)
STREAM_READERS = 1 if (os.cpu_count() or 1) <= 4 else 2
# ... but direct reads (O_DIRECT) get no read-ahead from the kernel and wait for the device, so with one reader a
# single read is in flight: they always get two. The referenced SmolLM2 pass with `--io direct` from storage took
# 15.81-16.92 s with two against 18.53-26.38 s with one (three alternating runs each), and 13.54-18.97 s with three
# or four; through the page cache from storage a second reader made no difference (8.86-10.38 s against 9.30-13.77)
DIRECT_READERS = 2
STORE_FORMAT = "relex-trajectory/1"
SUBTRACT_ROW_BYTES = 2**16  # rows of a referenced checkpoint from this size on have θ₀ subtracted one by one


@dataclass(frozen=True)
class StepEntry:
    step: int
    kind: str  # "delta": a file of deltas in the store; "checkpoint": a checkpoint folder read in place
    path: str  # relative to the store (older stores: absolute for checkpoints)
    dtype: str  # dtype of the stored values (the delta dtype, or the checkpoint's weights)
    quantization_error: float | None = None  # ‖q(Δ) − Δ‖ / ‖Δ‖ when deltas were stored in a lower precision
    source_dtype: str | None = None  # dtype of the weights the deltas came from
    absolute: str | None = None  # a checkpoint's absolute path when recorded: read when the relative one is gone


def is_store(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def store_reference(folder: str | Path, store_dir: str | Path) -> str:
    """How a manifest names a folder outside it: its path relative to the store."""
    return os.path.relpath(Path(folder).resolve(), Path(store_dir).resolve())


class TrajectoryStore:
    """A run's base checkpoint and its deltas θ_s − θ₀ at the recorded steps (the folder is described above).

    Open one with `TrajectoryStore.open(path)`; `DeltaRecorder` and `relex ingest` make them
    (`TrajectoryStore.create(...)` then `append_deltas` / `append_checkpoint`).

    Args:
        path: the store's folder.
        manifest: its parsed manifest.json (`open` reads and checks it).

    Example:
        store = TrajectoryStore.open("runs/demo/trajectory")
        store.steps                 # [2, 4, …, 30]: the real optimizer steps recorded
        store.trajectory_names      # the tensors with a trajectory (tied aliases once)
        deltas = store.reader([2, 4]).read("model.layers.0.mlp.up_proj.weight")   # float32, (2, numel)
    """

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest

    # ---- creation and opening -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | Path,
        *,
        base_dir: str | Path,
        tensors: dict[str, TensorInfo],
        tied: dict[str, str] | None = None,
        created_by: dict | None = None,
        pending: Sequence[int] = (),
    ) -> "TrajectoryStore":
        """A new empty store referencing `base_dir` (absolute, or relative to the store: `base`).

        `pending`: the steps a writer is about to add (`relex ingest`); passes refuse the store until they are in.
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise RelexError(f"{path}: exists and is a file, not a folder")
        if path.exists() and any(p.name != f".{MANIFEST_NAME}.lock" for p in path.iterdir()):
            raise RelexError(f"{path}: exists and is not empty")
        path.mkdir(parents=True, exist_ok=True)
        base = Path(base_dir)
        base_ref = {"path": str(base)} if not base.is_absolute() else {"path": store_reference(base, path), "absolute": str(base.resolve())}
        manifest = {
            "format": STORE_FORMAT,
            "base": base_ref,
            "tensors": {name: {"shape": list(info.shape), "dtype": dtype_name(info.dtype)} for name, info in sorted(tensors.items())},
            "tied": dict(sorted((tied or {}).items())),
            "created_by": {"relex_version": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(created_by or {})},
            "steps": [],
        }
        if pending:
            manifest["pending"] = sorted(pending)
        store = cls(path, manifest)
        with store.lock():
            store._save()
        return store

    @classmethod
    def open(cls, path: str | Path) -> "TrajectoryStore":
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise RelexError(f"{path}: a file, not a relex trajectory store (a folder with {MANIFEST_NAME})")
        return cls(path, read_manifest(path))

    def _save(self) -> None:
        write_json_atomic(self.path / MANIFEST_NAME, self.manifest)

    def lock(self):
        """The store's write lock (re-entrant in this process; another process gets a one-line refusal)."""
        return write_lock(self.path / MANIFEST_NAME)

    @contextlib.contextmanager
    def _writing(self):
        """Hold the lock and work on the manifest as it is on disk now (another writer may have added to it)."""
        with self.lock():
            self.manifest = read_manifest(self.path)
            yield

    # ---- what the store holds ---------------------------------------------------------------------------------
    @property
    def base_dir(self) -> Path:
        base = self.manifest["base"]
        return self._folder(base["path"], base.get("absolute"))

    def checkpoint_dir(self, entry: StepEntry) -> Path:
        """The folder a referenced step reads (relative to the store, else where it was when ingested)."""
        return self._folder(entry.path, entry.absolute)

    def _folder(self, path: str, absolute: str | None) -> Path:
        given = Path(path) if Path(path).is_absolute() else self.path / path
        if given.is_dir() or absolute is None:
            return given
        if Path(absolute).is_dir():
            return Path(absolute)
        return given  # gone: readers say so (`missing_reference`)

    def missing_reference(self, folder: Path, what: str) -> RelexError:
        return RelexError(
            f"{self.path}: {what} is gone ({os.path.normpath(folder)}: not a folder; moved, or deleted e.g. by save_total_limit); "
            f"re-point the store with `relex ingest NEW_RUN --base BASE --out {self.path} --repoint`, "
            "or ingest with --copy so that the store holds its own deltas"
        )

    @property
    def pending(self) -> list[int]:
        """Steps a writer announced and has not written yet (an interrupted `relex ingest`)."""
        return list(self.manifest.get("pending", []))

    def check_complete(self) -> None:
        if self.pending:
            raise RelexError(
                f"{self.path}: incomplete store: its writer stopped before step{'s' if len(self.pending) > 1 else ''} "
                f"{_span(self.pending)} (recorded: {_span(self.steps)}); run the same relex ingest command again to finish it"
            )

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(tuple(t["shape"]), from_name(t["dtype"])) for n, t in self.manifest["tensors"].items()}

    @property
    def tied(self) -> dict[str, str]:
        """alias -> canonical name, for tensors that share storage (e.g. lm_head.weight -> embed_tokens.weight)."""
        return dict(self.manifest["tied"])

    @property
    def trajectory_names(self) -> list[str]:
        """Float tensors with a trajectory of their own: every float tensor except tied aliases."""
        tied = self.tied
        return [n for n, info in self.tensors.items() if info.is_float and n not in tied]

    @property
    def entries(self) -> list[StepEntry]:
        return [StepEntry(**entry) for entry in self.manifest["steps"]]

    @property
    def steps(self) -> list[int]:
        return [entry["step"] for entry in self.manifest["steps"]]

    def entry(self, step: int) -> StepEntry:
        for entry in self.entries:
            if entry.step == step:
                return entry
        raise RelexError(f"{self.path}: step {step} is not in the store; recorded steps: {_span(self.steps)}")

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def data_bytes(self) -> int:
        """Bytes a pass over every step reads: the delta files and the weight files of referenced checkpoints."""
        files = set()
        for entry in self.entries:
            if entry.kind == "checkpoint":
                folder = self.checkpoint_dir(entry)
                if not folder.is_dir():
                    raise self.missing_reference(folder, f"the checkpoint of step {entry.step}")
                files.update(open_checkpoint(folder).files.values())
            else:
                files.add(self.path / entry.path)
        return sum(f.stat().st_size for f in files if f.is_file())

    def reads_direct(self, io: str) -> bool:
        """Whether passes over this store should bypass the page cache (O_DIRECT), for `io` auto, direct or cached.

        auto: direct when the data is larger than the memory available, where the page cache cannot keep it for
        the next pass anyway and copying through it only costs CPU; cached otherwise, so a fit followed by an
        extrapolation reads the second time from RAM.
        """
        check_io_mode(io)
        if io == "auto":
            available = memory_available()
            return available is not None and self.data_bytes() > available
        return io == "direct"

    # ---- appending ----------------------------------------------------------------------------------------------
    def _check_new_step(self, step: int) -> None:
        if not is_positive_int(step) or step > MAX_STEP:
            raise RelexError(f"{self.path}: step {step!r} must be a positive integer (the base is step 0)")
        if step in self.steps:
            raise RelexError(f"{self.path}: step {step} is already recorded; refusing to record it twice")
        if self.steps and step < self.steps[-1]:
            raise RelexError(f"{self.path}: step {step} comes before the last recorded step {self.steps[-1]}")

    def append_deltas(
        self,
        step: int,
        delta_of: Callable[[str], torch.Tensor],
        dtype: torch.dtype | None = None,
        source_dtype: torch.dtype | None = None,
        direct: bool = False,
    ) -> StepEntry:
        """Record step `step` from `delta_of(name)` (θ_step − θ₀ for each trajectory tensor), one tensor at a time:
        each is written before the next is asked for, so `delta_of` may reuse its memory.

        `dtype` is the stored precision (default float32); when it is lower, the relative quantization error
        ‖q(Δ) − Δ‖/‖Δ‖ is measured and kept in the manifest. `direct`: the file is written past the page cache
        where the file system allows (relex.io.stream_writer).
        """
        with self._writing():
            self._check_new_step(step)
            relative, quantization = self._write_deltas(step, delta_of, dtype or torch.float32, direct)
            source = dtype_name(source_dtype) if source_dtype is not None else None
            entry = StepEntry(step, "delta", str(relative), dtype_name(dtype or torch.float32), quantization, source)
            self._add(entry)
        return entry

    def _write_deltas(self, step: int, delta_of: Callable[[str], torch.Tensor], dtype: torch.dtype, direct: bool) -> tuple[Path, float | None]:
        """Write deltas/step-N.safetensors (under a temporary name, then renamed); returns it and the quantization error."""
        infos = self.tensors
        layout = [(n, TensorInfo(infos[n].shape, dtype)) for n in self.trajectory_names]
        relative = Path("deltas") / f"step-{step:08d}.safetensors"
        final = self.path / relative
        final.parent.mkdir(exist_ok=True)
        clean_leftovers_inside(final.parent)  # temporary files of writers that were killed
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            writer = StreamingSafetensorsWriter(tmp, layout, {"format": "pt", "step": str(step)}, direct=direct)
        except OSError as error:
            raise RelexError(f"{self.path}: cannot write step {step} ({error.strerror or error})") from None
        error_sq = norm_sq = 0.0
        try:
            for name, info in layout:
                delta = delta_of(name).detach().to("cpu", torch.float32)
                if tuple(delta.shape) != info.shape:
                    raise RelexError(f"tensor {name}: shape {tuple(delta.shape)} at step {step}, {info.shape} at base")
                if not all_finite(delta):
                    raise RelexError(f"tensor {name}: NaN or Inf in the delta at step {step}")
                stored = delta.to(dtype)
                if dtype != torch.float32:
                    error_sq += float((stored.float() - delta).double().pow(2).sum())
                    norm_sq += float(delta.double().pow(2).sum())
                writer.write(name, stored)
            writer.close()
            os.replace(writer.path, final)
        except BaseException as error:
            writer.abort()
            if isinstance(error, OSError):  # a full disk: one line, and the store as it was
                raise RelexError(f"{self.path}: step {step} not recorded: {error.strerror or error}") from error
            raise
        quantization = (error_sq / norm_sq) ** 0.5 if norm_sq > 0 else (0.0 if dtype != torch.float32 else None)
        return relative, quantization

    def append_checkpoint(self, step: int, folder: str | Path, dtype: torch.dtype) -> StepEntry:
        """Record step `step` as a reference to a checkpoint folder read in place (validated by the caller)."""
        with self._writing():
            self._check_new_step(step)
            entry = StepEntry(
                step, "checkpoint", store_reference(folder, self.path), dtype_name(dtype),
                source_dtype=dtype_name(dtype), absolute=str(Path(folder).resolve()),
            )
            self._add(entry)
        return entry

    def _add(self, entry: StepEntry) -> None:
        self.manifest["steps"].append({k: v for k, v in asdict(entry).items() if v is not None or k in _ENTRY_REQUIRED})
        if entry.step in self.pending:
            self.manifest["pending"] = [s for s in self.pending if s != entry.step]
            if not self.manifest["pending"]:
                del self.manifest["pending"]
        self._save()
        LOG.debug("%s: recorded step %d", self.path, entry.step)

    def truncate(self, after: int) -> list[int]:
        """Drop the recorded steps after step `after` (and their delta files); returns the steps dropped."""
        with self._writing():
            dropped = [entry for entry in self.entries if entry.step > after]
            if not dropped:
                return []
            self.manifest["steps"] = [e for e in self.manifest["steps"] if e["step"] <= after]
            self._save()
            for entry in dropped:  # after the manifest: a crash here leaves only unlisted files
                if entry.kind == "delta":
                    (self.path / entry.path).unlink(missing_ok=True)
        LOG.warning("%s: dropped recorded step%s %s, after step %d", self.path, "s" if len(dropped) > 1 else "", _span([e.step for e in dropped]), after)
        return [e.step for e in dropped]

    def repoint(self, folders: dict[int, Path], base: Path | None = None) -> None:
        """Point referenced steps (step -> folder) and optionally the base at new places (checked by the caller)."""
        with self._writing():
            for raw in self.manifest["steps"]:
                if raw["step"] in folders:
                    raw["path"] = store_reference(folders[raw["step"]], self.path)
                    raw["absolute"] = str(Path(folders[raw["step"]]).resolve())
            if base is not None:
                self.manifest["base"] = {"path": store_reference(base, self.path), "absolute": str(Path(base).resolve())}
            self._save()

    def reader(self, steps: Sequence[int] | None = None, direct: bool = False) -> "TrajectoryReader":
        """A reader of `steps` (default all); `direct` reads with O_DIRECT, bypassing the page cache."""
        self.check_complete()
        return TrajectoryReader(self, list(self.steps if steps is None else steps), direct)


# ---- the manifest's schema ----------------------------------------------------------------------------------------
_ENTRY_REQUIRED = ("step", "kind", "path", "dtype")
_ENTRY_FIELDS = {"step", "kind", "path", "dtype", "quantization_error", "source_dtype", "absolute"}
_DTYPES = {dtype_name(t) for t in SAFETENSORS_TO_TORCH.values()}
MAX_STEP = 2**63 - 1


def check_io_mode(io: str) -> None:
    """Refuse an I/O mode that is not one of IO_MODES, in one line listing them."""
    if io not in IO_MODES:
        raise RelexError(f"unknown I/O mode {io!r}; valid: {', '.join(IO_MODES)}")


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: their sum in float32 (at least) first, one read of them and nothing allocated,
    since a NaN or Inf makes it non-finite; value by value only when it is not, which finite values that overflow
    the sum can also make it. `torch.isfinite(values).all()` allocates a mask and reads the values three times."""
    total = float(values.sum(dtype=torch.promote_types(values.dtype, torch.float32)))
    return math.isfinite(total) or bool(torch.isfinite(values).all())


def read_manifest(path: Path) -> dict:
    """The manifest of the store at `path`, checked against its schema (one line naming what is wrong)."""
    manifest_path = Path(path) / MANIFEST_NAME
    if not manifest_path.is_file():
        raise RelexError(f"{path}: not a relex trajectory store (no {MANIFEST_NAME})")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RelexError(f"{manifest_path}: corrupt manifest ({error})") from None
    except OSError as error:
        raise RelexError(f"{manifest_path}: cannot read ({error.strerror or error})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise RelexError(f"{manifest_path}: invalid manifest: {problem}")
    return manifest


def _manifest_problem(m) -> str | None:
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, not an object"
    if m.get("format") != STORE_FORMAT:
        return f"format {m.get('format')!r}, expected {STORE_FORMAT}"
    base = m.get("base")
    if not isinstance(base, dict) or not isinstance(base.get("path"), str) or not isinstance(base.get("absolute", ""), str):
        return "base must be an object with a string path"
    tensors = m.get("tensors")
    if not isinstance(tensors, dict):
        return "tensors must be an object"
    for name, t in tensors.items():
        if not isinstance(t, dict) or not isinstance(t.get("shape"), list) or not all(is_int(d) and d >= 0 for d in t["shape"]):
            return f"tensor {name}: shape must be a list of non-negative integers"
        if t.get("dtype") not in _DTYPES:
            return f"tensor {name}: unknown dtype {t.get('dtype')!r}"
    tied = m.get("tied", {})
    if not isinstance(tied, dict) or any(not isinstance(v, str) for v in tied.values()):
        return "tied must map tensor names to tensor names"
    for alias, canonical in tied.items():
        if alias not in tensors or canonical not in tensors or canonical in tied or tensors[alias] != tensors[canonical]:
            return f"tie {alias} -> {canonical}: both must be tensors of one shape and dtype, the second not itself an alias"
    if not isinstance(m.get("created_by", {}), dict):
        return "created_by must be an object"
    return _steps_problem(m.get("steps"), m.get("pending", []))


def _steps_problem(steps, pending) -> str | None:
    if not isinstance(steps, list):
        return "steps must be a list"
    previous = 0
    for raw in steps:
        if not isinstance(raw, dict) or not set(_ENTRY_REQUIRED) <= set(raw) or not set(raw) <= _ENTRY_FIELDS:
            return f"step entry {str(raw)[:80]}: needs {', '.join(_ENTRY_REQUIRED)} and nothing unknown"
        step = raw["step"]
        if not is_int(step) or not 0 < step <= MAX_STEP:
            return f"step {step!r}: steps are positive integers"
        if step <= previous:
            return f"step {step} after step {previous}: steps must increase, each once"
        previous = step
        if raw["kind"] not in ("delta", "checkpoint"):
            return f"step {step}: kind {raw['kind']!r}, expected delta or checkpoint"
        if not isinstance(raw["path"], str) or not isinstance(raw.get("absolute") or "", str):
            return f"step {step}: path must be a string"
        if raw["kind"] == "delta" and (Path(raw["path"]).is_absolute() or ".." in Path(raw["path"]).parts):
            return f"step {step}: a delta file must lie inside the store, not at {raw['path']}"
        if raw["dtype"] not in _DTYPES or raw.get("source_dtype") not in (None, *_DTYPES):
            return f"step {step}: unknown dtype {raw['dtype']!r} or source dtype {raw.get('source_dtype')!r}"
        error = raw.get("quantization_error")
        if error is not None and (not isinstance(error, (int, float)) or isinstance(error, bool) or not math.isfinite(error) or error < 0):
            return f"step {step}: quantization_error {error!r} is not a number ≥ 0"
    if not isinstance(pending, list) or not all(is_int(s) and 0 < s <= MAX_STEP for s in pending):
        return "pending must be a list of positive step numbers"
    return None


def memory_available() -> int | None:
    """Bytes of memory available to new work (Linux's MemAvailable), or None where that is not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _span(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:4]))}, …, {', '.join(map(str, steps[-2:]))} ({len(steps)} steps)"


class Block(NamedTuple):
    """One read of a stream: rows a..b-1 of tensor `name` at every step (None: all of it)."""

    name: str
    rows: tuple[int, int] | None = None
    work: bool = False  # the caller's per-block work (`stream`'s `work`: a Gram, for relex.fit) runs on this block


# the dtypes the reading kernels take, and the code `TensorFiles.dtypes` gives each (bf16 and fp16 are widened to
# float32 as they are read)
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class TensorFiles(NamedTuple):
    """Where one tensor's values lie at every step, for reads a caller makes itself (relex.fit.gram_kernel's reading
    kernels), through the page cache: each step's row in one or more segments, runs of values in one file (one in a
    safetensors file, one per rank in verl's unmerged shards), each with its file and the byte offset of its first
    value, in float32, bf16 or fp16 (`KERNEL_DTYPES`); whether the step's values are θ_s (a checkpoint read in place:
    θ₀ is subtracted) and where θ₀'s values lie, for that and for sums that add θ₀ (descriptor -1 where the
    kernels cannot read θ₀: another dtype, or no safetensors file)."""

    name: str
    numel: int
    descriptors: np.ndarray  # int32, T × K: the open file of each step's segments (-1 pads a step with fewer)
    offsets: np.ndarray  # int64, T × K: the byte offset of each segment's first value in its file
    bounds: np.ndarray  # int64, T × (K + 1): segment k holds the row's values bounds[s, k] .. bounds[s, k + 1] - 1
    dtypes: np.ndarray  # uint8: each step's dtype, as KERNEL_DTYPES codes it
    subtract: np.ndarray  # uint8: 1 where the step holds θ_s
    base_descriptor: int
    base_offset: int
    base_dtype: int  # θ₀'s, as KERNEL_DTYPES codes it
    files: tuple  # each step's K segments' files (None where padded), then θ₀'s when read: to name a failed read's

    @classmethod
    def of_segments(cls, name: str, numel: int, steps: list[list[tuple[object, int, int]]], dtypes, subtract,
                    base: tuple[object, int, int] | None) -> "TensorFiles":
        """From each step's segments, (file, byte offset, values) in order, covering its `numel` values; `base`:
        θ₀'s (file, byte offset, dtype code), or None. A file is anything with a `descriptor` (and `short_read`)."""
        width = max(len(segments) for segments in steps)
        descriptors = np.full((len(steps), width), -1, dtype=np.int32)
        offsets = np.zeros((len(steps), width), dtype=np.int64)
        bounds = np.full((len(steps), width + 1), numel, dtype=np.int64)
        files: list = []
        for s, segments in enumerate(steps):
            bounds[s, 0], first = 0, 0
            for k, (file, offset, values) in enumerate(segments):
                descriptors[s, k], offsets[s, k], bounds[s, k + 1] = file.descriptor, offset, first + values
                first += values
            if first != numel:
                raise ValueError(f"tensor {name}: segments of {first} values for a tensor of {numel}")
            files += [file for file, _, _ in segments] + [None] * (width - len(segments))
        base_file, base_offset, base_dtype = base if base is not None else (None, 0, 0)
        return cls(name, numel, descriptors, offsets, bounds, np.asarray(dtypes, dtype=np.uint8), np.asarray(subtract, dtype=np.uint8),
                   -1 if base_file is None else base_file.descriptor, base_offset, base_dtype,
                   tuple(files) + (() if base_file is None else (base_file,)))

    def read_failed(self, status: int) -> RelexError:
        """The error for a read that came up short (`status`: 1 + the index of the file in `files`)."""
        return self.files[status - 1].short_read(self.name)


class TrajectoryReader:
    """Reads the trajectory matrix M (T × d, one row per step) of one tensor at a time, whole or in row blocks.

    Values go from the files straight into their destination (`read_into`), without an intermediate copy.
    `stream` reads a planned sequence of blocks in background threads into a few reused buffers, so reading
    (which on a cold page cache is mostly kernel time) runs on its own core while the caller computes. The
    reader does no arithmetic beyond θ_s − θ₀ for referenced checkpoints; what is computed from the blocks, and
    how the reads are planned, is relex.fit.passes's.
    """

    def __init__(self, store: TrajectoryStore, steps: list[int], direct: bool = False):
        self.store = store
        self.steps = steps
        self.direct = direct
        self.entries = [store.entry(s) for s in steps]
        self.infos = store.tensors
        if not store.base_dir.is_dir():
            raise store.missing_reference(store.base_dir, "the base checkpoint")
        self.base = CheckpointReader(store.base_dir)
        self._sources = [self._open(entry) for entry in self.entries]  # one reader per step, files kept open
        self._files: dict[str, list[SafetensorsFile] | None] = {}  # per tensor: `_float32_files`
        self._tensor_files: dict[str, TensorFiles | None] = {}  # per tensor: `tensor_files`
        self._referenced = [entry.kind == "checkpoint" for entry in self.entries]  # rows that hold θ_s, not Δ_s
        self._subtract = [i for i, referenced in enumerate(self._referenced) if referenced]
        self._local = threading.local()  # per reading thread: the buffer θ₀'s rows are read into (`_base_block`)

    def _open(self, entry: StepEntry) -> CheckpointReader:
        if entry.kind == "checkpoint":
            folder = self.store.checkpoint_dir(entry)
            if not folder.is_dir():
                raise self.store.missing_reference(folder, f"the checkpoint of step {entry.step}")
            reader = open_checkpoint(folder, self.direct)  # safetensors, or verl's unmerged shards
            # the dtype most of its weights had at ingest (what shapes are to `_float32_files`): a checkpoint saved
            # again in another precision since then holds other values than the ones ingested
            now = most_common_float_dtype(info.dtype for info in reader.infos().values())
            if entry.source_dtype is not None and now is not None and dtype_name(now) != entry.source_dtype:
                raise RelexError(
                    f"{folder}: step {entry.step}'s weights are {dtype_name(now)} now, {entry.source_dtype} when it was "
                    f"ingested: the checkpoint changed after ingest; ingest the run again"
                )
            return reader
        return CheckpointReader.from_file(self.store.path / entry.path, self.direct)

    @property
    def referenced(self) -> bool:
        """Whether any step is a checkpoint read in place (its values are θ_s, and θ₀ is subtracted per block)."""
        return any(entry.kind == "checkpoint" for entry in self.entries)

    # ---- which rows ------------------------------------------------------------------------------------------------
    def row_blocks(self, name: str, max_elements: int) -> list[tuple[int, int] | None]:
        """Row ranges such that T × rows × row-size ≤ max_elements (at least one row); None for a scalar."""
        shape = self.infos[name].shape
        if not shape:
            return [None]
        row = max(1, self.infos[name].numel // shape[0]) if shape[0] else 1
        per_block = max(1, max_elements // (max(1, len(self.steps)) * row))
        return [(a, min(a + per_block, shape[0])) for a in range(0, shape[0], per_block)]

    def block_numel(self, name: str, rows: tuple[int, int] | None) -> int:
        """Values per step in rows a..b-1 of tensor `name` (all of it for None)."""
        shape = self.infos[name].shape
        if rows is None or not shape:
            return self.infos[name].numel
        return (min(shape[0], rows[1]) - rows[0]) * (self.infos[name].numel // shape[0] if shape[0] else 0)

    # ---- reading ---------------------------------------------------------------------------------------------------
    def _base_block(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """θ₀'s values of `rows` as float32, flat: read into one buffer per thread, reused from block to block (used
        up within `read_into`), instead of new memory for each block."""
        nbytes = self.block_numel(name, rows) * self.infos[name].dtype.itemsize
        self._local.base = reused(getattr(self._local, "base", None), nbytes, torch.uint8)
        return self.base.read(name, rows, self._local.base).reshape(-1).float()

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """M restricted to `rows`: a new float32 tensor of shape (T, numel of those rows)."""
        out = torch.empty(len(self.entries), self.block_numel(name, rows), dtype=torch.float32)
        self.read_into(name, out, rows)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Fill `out` (float32, T × numel of `rows`, each row contiguous, e.g. a column slice of a larger matrix).

        Values are not checked here (a scan would cost more than the read): a NaN or Inf reaches the caller's
        arithmetic, which refuses it (the Gram's diagonal, relex.fit.gram; the weighted sum, relex.fit.passes).
        Where every step stores the tensor in float32 in a safetensors file, each row is one positioned read
        straight into `out` (`SafetensorsFile.fill`), with the files and their checks looked up once per tensor:
        a block of T rows costs T reads and little else (0.43 ms a block of 20 short rows through the per-row
        checks before, measured on the SmolLM2 store).
        """
        files = self._files[name] if name in self._files else self._float32_files(name)
        base = self._base_block(name, rows) if self._subtract else None
        # θ₀ is subtracted from a long row as soon as it is read, while the row is still in the CPU's cache; from
        # short ones all at once, in one call
        at_once = base is not None and 4 * base.numel() < SUBTRACT_ROW_BYTES
        if files is None:
            self._read_converted(name, out, rows, None if at_once else base)
        else:
            values = out.numpy()
            for i, file in enumerate(files):
                offset, nbytes, _ = file.span(name, rows)
                row = memoryview(values[i]).cast("B")
                if len(row) != nbytes:
                    raise ValueError(f"{file.path}: tensor {name}: {nbytes} bytes read into a row of {len(row)}")
                if nbytes:
                    file.fill(name, offset, row)
                if base is not None and not at_once and self._referenced[i]:
                    out[i].sub_(base)
        if at_once:
            if len(self._subtract) == len(self.entries):
                out.sub_(base)
            else:
                for i in self._subtract:
                    out[i].sub_(base)

    def _float32_files(self, name: str) -> list[SafetensorsFile] | None:
        """The file holding tensor `name` at each step, when each stores it in float32 in a safetensors file (else
        None: `_read_converted`)."""
        files = self._step_files(name)
        files = None if files is None or any(dtype != torch.float32 for _, dtype in files) else [file for file, _ in files]
        self._files[name] = files
        return files

    def _step_files(self, name: str) -> list[tuple[SafetensorsFile, torch.dtype]] | None:
        """The file holding tensor `name` at each step and its dtype there, when each step stores it in a safetensors
        file (else None: verl's shards); a referenced checkpoint's shape is checked here, once per tensor and reader."""
        files: list | None = []
        for entry, source in zip(self.entries, self._sources):
            info = self._checked_info(name, entry, source)
            if files is not None and isinstance(source, CheckpointReader):
                files.append((source.file_of(name), info.dtype))
            else:
                files = None
        return files

    def tensor_files(self, name: str) -> TensorFiles | None:
        """Where tensor `name`'s values lie at every step, and θ₀'s, for a caller that reads them itself; None when
        some step (or θ₀, for a referenced checkpoint) stores it in a dtype the kernels do not read (KERNEL_DTYPES) or
        outside a safetensors file, or reads go past the page cache (`direct`): those are read by `read_into`. Worked
        out once per tensor (a pass asks when it plans and when it reads)."""
        if name not in self._tensor_files:
            self._tensor_files[name] = self._locate(name)
        return self._tensor_files[name]

    def _locate(self, name: str) -> TensorFiles | None:
        if self.direct:
            return None
        steps, dtypes = [], []
        for entry, source in zip(self.entries, self._sources):
            dtype = self._checked_info(name, entry, source).dtype
            if dtype not in KERNEL_DTYPES:
                return None
            if isinstance(source, CheckpointReader):
                file = source.file_of(name)
                segments = None if file.direct else [(file, file.span(name)[0], self.infos[name].numel)]
            else:
                segments = source.segments(name)  # verl's shards: one per rank that holds part of it, or None
            if segments is None:
                return None
            steps.append(segments)
            dtypes.append(KERNEL_DTYPES[dtype])
        base, dtype = self.base.file_of(name), self.base.info(name).dtype
        if not base.direct and dtype in KERNEL_DTYPES:
            located_base = (base, base.span(name)[0], KERNEL_DTYPES[dtype])
        elif self._subtract:
            return None
        else:
            located_base = None
        return TensorFiles.of_segments(name, self.infos[name].numel, steps, dtypes, self._referenced, located_base)

    def _checked_info(self, name: str, entry: StepEntry, source) -> TensorInfo:
        """Tensor `name`'s shape and dtype at one step; a referenced checkpoint's shape is checked against the base's
        (at ingest too, but the folder may have changed since)."""
        info, expected = source.info(name), self.infos[name].shape
        if entry.kind == "checkpoint" and info.shape != expected:
            raise RelexError(
                f"tensor {name}: shape {info.shape} at step {entry.step}, {expected} at base "
                f"({self.store.checkpoint_dir(entry)} changed after ingest; ingest the run again)"
            )
        return info

    def _read_converted(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None, base: torch.Tensor | None) -> None:
        """θ_s (or Δ_s) of each step as float32 into `out`, from whatever the step stores (bf16, verl's shards);
        `base` (θ₀) is subtracted from each row of a referenced checkpoint as it is read."""
        for row, source, referenced in zip(out, self._sources, self._referenced):
            if source.info(name).dtype == torch.float32:
                source.read_into(name, row, rows)
            else:
                row.copy_(source.read(name, rows).reshape(-1))
            if base is not None and referenced:
                row.sub_(base)

    def stream(
        self, blocks: Sequence[Block], readers: int | None = None, *,
        work: Callable[[Block, torch.Tensor], object] | None = None, buffers: Sequence[torch.Tensor] | None = None,
    ) -> Iterator[tuple[Block, torch.Tensor, object]]:
        """(block, M restricted to its rows, `work(block, M)` or None) for each planned block, in order.

        Background threads (`readers`, default STREAM_READERS, at least DIRECT_READERS for direct reads) read ahead
        into `buffers` (flat float32 tensors, reused in turn; by default as many as fit in STREAM_BYTES, at least 2),
        so reading runs on its own core while the caller computes. `work` is the caller's arithmetic for a block
        that asks for it (`Block.work`): it runs in whichever thread would otherwise wait, a reader when the caller
        is behind, the caller when it is waiting for reads. What it computes is the caller's (relex.fit.passes: a
        block's Gram); the reader only reads.
        Each matrix is a view of a buffer and stays valid only until the next one is asked for. An error while
        reading (a changed checkpoint, a short file) is raised here, at the block it concerns.
        """
        blocks = list(blocks)
        if work is None and any(block.work for block in blocks):
            raise ValueError("TrajectoryReader.stream: blocks ask for per-block work but no `work` was given")
        if buffers is None:
            largest = max((len(self.entries) * self.block_numel(b.name, b.rows) for b in blocks), default=0)
            count = max(2, min(STREAM_BUFFERS, STREAM_BYTES // max(1, 4 * largest)))
            buffers = [torch.empty(largest, dtype=torch.float32) for _ in range(count)]
        default = max(STREAM_READERS, DIRECT_READERS) if self.direct else STREAM_READERS
        count = max(1, min(readers or default, len(blocks)))
        return _ReadAhead(self, blocks, work, buffers, count).items()


class _ReadAhead:
    """The threads of one `TrajectoryReader.stream`: they take the next block and a free buffer together, in block
    order (so the block the caller waits for always gets a buffer before later ones), read it, and leave it in
    `done` until the caller takes it; the caller hands the buffer back when it asks for the next block."""

    def __init__(self, reader: TrajectoryReader, blocks: list[Block], work, buffers: Sequence[torch.Tensor], threads: int):
        self.reader, self.blocks, self.work, self.threads = reader, blocks, work, threads
        self.free: queue.Queue = queue.Queue()
        for buffer in buffers:
            self.free.put(buffer)
        self.claim = threading.Lock()
        self.done: dict[int, tuple] = {}
        self.finished = threading.Condition()
        self.position = iter(range(len(blocks)))
        self.stop = threading.Event()

    def _next_job(self) -> tuple[int | None, torch.Tensor | None]:
        with self.claim:
            k = next(self.position, None)
            return k, (self.free.get() if k is not None else None)

    def _read(self, k: int, buffer: torch.Tensor) -> tuple:
        """(buffer, matrix, work result or None) for block k; (None, error, None) when reading it failed."""
        block, steps = self.blocks[k], len(self.reader.entries)
        try:
            matrix = buffer[: steps * self.reader.block_numel(block.name, block.rows)].view(steps, -1)
            self.reader.read_into(block.name, matrix, block.rows)
            with self.finished:
                caller_busy = bool(self.done)  # blocks it has not taken yet: this thread has time to spare
            return buffer, matrix, (self.work(block, matrix) if block.work and caller_busy else None)
        except BaseException as error:  # handed to the caller, raised where it reads
            return None, error, None

    def _run(self) -> None:
        torch.set_num_threads(1)  # per thread: this one's products stay on its own core
        while True:
            k, buffer = self._next_job()
            if k is None or buffer is None or self.stop.is_set():
                return
            item = self._read(k, buffer)
            with self.finished:
                self.done[k] = item
                self.finished.notify_all()
            if item[0] is None:
                return

    def items(self) -> Iterator[tuple[Block, torch.Tensor, object]]:
        workers = [threading.Thread(target=self._run, name="relex-reader", daemon=True) for _ in range(self.threads)]
        torch_threads = torch.get_num_threads()
        if torch_threads > 1:  # the readers take a core; compute gets the others
            torch.set_num_threads(torch_threads - 1)
        for worker in workers:
            worker.start()
        held = None
        try:
            for k, block in enumerate(self.blocks):
                if held is not None:
                    self.free.put(held)
                with self.finished:
                    self.finished.wait_for(lambda k=k: k in self.done)
                    held, matrix, result = self.done.pop(k)
                if held is None:
                    raise matrix
                if block.work and result is None:
                    result = self.work(block, matrix)
                yield block, matrix, result
        finally:
            self.stop.set()
            for _ in workers:
                self.free.put(None)  # wakes workers waiting for a buffer
            for worker in workers:
                worker.join()
            torch.set_num_threads(torch_threads)
