"""The trajectory store: a base checkpoint plus the deltas θ_s − θ₀ of one run at its real step numbers.

A store is a folder:

    STORE/manifest.json                      base reference, steps, tensor names/shapes/dtypes, ties, provenance
    STORE/deltas/step-00000040.safetensors   one file per recorded step (when deltas are materialised)
    STORE/base/                              the base checkpoint, when it was not a folder that outlives the run

A step is either a materialised delta file or a reference to a checkpoint folder left in place (`relex ingest`
without `--copy`); both read the same. Steps are appended one at a time: the data file is written under a
temporary name and renamed, then the manifest is replaced atomically, so a step exists once the manifest lists it.
Reading a tensor across steps is lazy and goes by row blocks, read ahead in a background thread
(`TrajectoryReader.stream`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from relex import __version__
from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader, TensorInfo
from relex.io.dtypes import dtype_name, from_name
from relex.io.stream_writer import StreamingSafetensorsWriter

LOG = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
IO_MODES = ("auto", "direct", "cached")
STREAM_BUFFERS = 4  # buffers a stream cycles through: one the caller holds, the others the reader thread fills
STREAM_BYTES = 2**30  # ... as many as fit in this much memory, but at least 2
# reader threads of a stream: one leaves the other cores to compute on small machines; on larger ones a second
# keeps more reads in flight (fast NVMe and network file systems need a deeper queue)
STREAM_READERS = 1 if (os.cpu_count() or 1) <= 4 else 2
STORE_FORMAT = "relex-trajectory/1"


@dataclass(frozen=True)
class StepEntry:
    step: int
    kind: str  # "delta": a file of deltas in the store; "checkpoint": a checkpoint folder read in place
    path: str  # relative to the store for deltas, absolute for checkpoints
    dtype: str  # dtype of the stored values (the delta dtype, or the checkpoint's weights)
    quantization_error: float | None = None  # ‖q(Δ) − Δ‖ / ‖Δ‖ when deltas were stored in a lower precision
    source_dtype: str | None = None  # dtype of the weights the deltas came from


def is_store(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)


class TrajectoryStore:
    """Open with `TrajectoryStore.open(path)`; make with `TrajectoryStore.create(...)`."""

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
    ) -> "TrajectoryStore":
        """A new empty store referencing `base_dir` (absolute, or relative to the store: `base`)."""
        path = Path(path)
        if path.exists() and any(path.iterdir()):
            raise RelexError(f"{path}: exists and is not empty")
        path.mkdir(parents=True, exist_ok=True)
        base = Path(base_dir)
        manifest = {
            "format": STORE_FORMAT,
            "base": {"path": str(base if not base.is_absolute() else base.resolve())},
            "tensors": {name: {"shape": list(info.shape), "dtype": dtype_name(info.dtype)} for name, info in sorted(tensors.items())},
            "tied": dict(sorted((tied or {}).items())),
            "created_by": {"relex_version": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(created_by or {})},
            "steps": [],
        }
        store = cls(path, manifest)
        store._save()
        return store

    @classmethod
    def open(cls, path: str | Path) -> "TrajectoryStore":
        path = Path(path)
        manifest_path = path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise RelexError(f"{path}: not a relex trajectory store (no {MANIFEST_NAME})")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as error:
            raise RelexError(f"{manifest_path}: corrupt manifest ({error})") from None
        if manifest.get("format") != STORE_FORMAT:
            raise RelexError(f"{manifest_path}: format {manifest.get('format')!r}, expected {STORE_FORMAT}")
        return cls(path, manifest)

    def _save(self) -> None:
        _write_json_atomic(self.path / MANIFEST_NAME, self.manifest)

    # ---- what the store holds ---------------------------------------------------------------------------------
    @property
    def base_dir(self) -> Path:
        base = Path(self.manifest["base"]["path"])
        return base if base.is_absolute() else self.path / base

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
                files.update(CheckpointReader(entry.path).files.values())
            else:
                files.add(self.path / entry.path)
        return sum(f.stat().st_size for f in files if f.is_file())

    def reads_direct(self, io: str) -> bool:
        """Whether passes over this store should bypass the page cache (O_DIRECT), for `io` auto, direct or cached.

        auto: direct when the data is larger than the memory available, where the page cache cannot keep it for
        the next pass anyway and copying through it only costs CPU; cached otherwise, so a fit followed by an
        extrapolation reads the second time from RAM.
        """
        if io not in IO_MODES:
            raise RelexError(f"unknown I/O mode {io!r}; valid: {', '.join(IO_MODES)}")
        if io == "auto":
            available = memory_available()
            return available is not None and self.data_bytes() > available
        return io == "direct"

    # ---- appending ----------------------------------------------------------------------------------------------
    def _check_new_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
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
    ) -> StepEntry:
        """Record step `step` from `delta_of(name)` (θ_step − θ₀ for each trajectory tensor), one tensor at a time.

        `dtype` is the stored precision (default float32); when it is lower, the relative quantization error
        ‖q(Δ) − Δ‖/‖Δ‖ is measured and kept in the manifest.
        """
        self._check_new_step(step)
        dtype = dtype or torch.float32
        infos = self.tensors
        layout = [(n, TensorInfo(infos[n].shape, dtype)) for n in self.trajectory_names]
        relative = Path("deltas") / f"step-{step:08d}.safetensors"
        final = self.path / relative
        final.parent.mkdir(exist_ok=True)
        writer = StreamingSafetensorsWriter(final.with_name(f".{final.name}.tmp"), layout, {"format": "pt", "step": str(step)})
        error_sq = norm_sq = 0.0
        try:
            for name, info in layout:
                delta = delta_of(name).detach().to("cpu", torch.float32)
                if tuple(delta.shape) != info.shape:
                    raise RelexError(f"tensor {name}: shape {tuple(delta.shape)} at step {step}, {info.shape} at base")
                if not torch.isfinite(delta).all():
                    raise RelexError(f"tensor {name}: NaN or Inf in the delta at step {step}")
                stored = delta.to(dtype)
                if dtype != torch.float32:
                    error_sq += float((stored.float() - delta).double().pow(2).sum())
                    norm_sq += float(delta.double().pow(2).sum())
                writer.write(name, stored)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        os.replace(writer.path, final)
        quantization = (error_sq / norm_sq) ** 0.5 if norm_sq > 0 else (0.0 if dtype != torch.float32 else None)
        source = dtype_name(source_dtype) if source_dtype is not None else None
        entry = StepEntry(step, "delta", str(relative), dtype_name(dtype), quantization, source)
        self._add(entry)
        return entry

    def append_checkpoint(self, step: int, folder: str | Path, dtype: torch.dtype) -> StepEntry:
        """Record step `step` as a reference to a checkpoint folder read in place (validated by the caller)."""
        self._check_new_step(step)
        entry = StepEntry(step, "checkpoint", str(Path(folder).resolve()), dtype_name(dtype), source_dtype=dtype_name(dtype))
        self._add(entry)
        return entry

    def _add(self, entry: StepEntry) -> None:
        self.manifest["steps"].append(asdict(entry))
        self._save()
        LOG.debug("%s: recorded step %d", self.path, entry.step)

    def reader(self, steps: Sequence[int] | None = None, direct: bool = False) -> "TrajectoryReader":
        """A reader of `steps` (default all); `direct` reads with O_DIRECT, bypassing the page cache."""
        return TrajectoryReader(self, list(self.steps if steps is None else steps), direct)


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
    gram: bool = False  # also form this block's Gram contribution M Mᵀ in the reader thread


class TrajectoryReader:
    """Reads the trajectory matrix M (T × d, one row per step) of one tensor at a time, whole or in row blocks.

    Values go from the files straight into their destination (`read_into`), without an intermediate copy.
    `stream` reads a planned sequence of blocks in background threads into a few reused buffers, so reading
    (which on a cold page cache is mostly kernel time) runs on its own core while the caller computes.
    """

    def __init__(self, store: TrajectoryStore, steps: list[int], direct: bool = False):
        self.store = store
        self.steps = steps
        self.direct = direct
        self.entries = [store.entry(s) for s in steps]
        self.infos = store.tensors
        self.base = CheckpointReader(store.base_dir)
        self._sources = [self._open(entry) for entry in self.entries]  # one reader per step, files kept open

    def _open(self, entry: StepEntry) -> CheckpointReader:
        if entry.kind == "checkpoint":
            return CheckpointReader(entry.path, self.direct)
        return CheckpointReader.from_file(self.store.path / entry.path, self.direct)

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
    def base_rows(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        return self.base.read(name, rows)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """M restricted to `rows`: a new float32 tensor of shape (T, numel of those rows)."""
        out = torch.empty(len(self.entries), self.block_numel(name, rows), dtype=torch.float32)
        self.read_into(name, out, rows)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Fill `out` (float32, T × numel of `rows`, each row contiguous, e.g. a column slice of a larger matrix)."""
        base_f32 = None
        expected = self.infos[name].shape
        for i, (entry, source) in enumerate(zip(self.entries, self._sources)):
            row = out[i]
            info = source.info(name)
            if entry.kind == "checkpoint" and info.shape != expected:  # checked at ingest; the folder may have changed
                raise RelexError(f"tensor {name}: shape {info.shape} at step {entry.step}, {expected} at base")
            if info.dtype == torch.float32:
                source.read_into(name, row, rows)
            else:
                row.copy_(source.read(name, rows).reshape(-1))
            if entry.kind == "checkpoint":
                if base_f32 is None:
                    base_f32 = self.base_rows(name, rows).reshape(-1).float()
                row.sub_(base_f32)
                if not torch.isfinite(row).all():
                    raise RelexError(f"tensor {name}: NaN or Inf at step {entry.step}")

    def stream(
        self, blocks: Sequence[Block], device: torch.device | None = None, readers: int | None = None
    ) -> Iterator[tuple[Block, torch.Tensor, torch.Tensor | None]]:
        """(block, M restricted to its rows, its Gram M Mᵀ or None) for each planned block, in order.

        Background threads (`readers`, default STREAM_READERS) read ahead, so reading runs on its own core while
        the caller computes on the others. The Gram of a block that asks for it (`Block.gram`) is formed on
        `device` by whichever side would otherwise wait: a reader when the caller is behind, the caller when it
        is waiting for reads.
        Each matrix is a view of a reused buffer and stays valid only until the next one is asked for. An error
        while reading (a changed checkpoint, a short file) is raised here, at the block it concerns.
        """
        from relex.fit.gram import chunk_gram, prepare

        device = device or torch.device("cpu")
        blocks = list(blocks)
        if any(block.gram for block in blocks):  # load the Gram kernel while the first reads run
            threading.Thread(target=prepare, args=(device,), name="relex-prepare", daemon=True).start()
        steps = len(self.entries)
        size = max((steps * self.block_numel(b.name, b.rows) for b in blocks), default=0)
        free: queue.Queue = queue.Queue()
        for _ in range(max(2, min(STREAM_BUFFERS, STREAM_BYTES // max(1, 4 * size)))):
            free.put(torch.empty(size, dtype=torch.float32))
        # workers take the next block and a free buffer together, in block order, so the block the caller waits
        # for always gets a buffer before later ones; finished blocks wait in `done` until the caller takes them
        claim = threading.Lock()
        done: dict[int, tuple] = {}
        finished = threading.Condition()
        position = iter(range(len(blocks)))
        stop = threading.Event()

        def work() -> None:
            torch.set_num_threads(1)  # per thread: this one's products stay on its own core
            while True:
                with claim:
                    k = next(position, None)
                    buffer = free.get() if k is not None else None
                if k is None or buffer is None or stop.is_set():
                    return
                block = blocks[k]
                try:
                    matrix = buffer[: steps * self.block_numel(block.name, block.rows)].view(steps, -1)
                    self.read_into(block.name, matrix, block.rows)
                    with finished:
                        caller_busy = bool(done)  # blocks it has not taken yet: this thread has time to spare
                    gram = chunk_gram(matrix, device) if block.gram and caller_busy else None
                    item = (buffer, matrix, gram)
                except BaseException as error:  # handed to the caller, raised where it reads
                    item = (None, error, None)
                with finished:
                    done[k] = item
                    finished.notify_all()
                if item[0] is None:
                    return

        count = max(1, min(readers or STREAM_READERS, len(blocks)))
        workers = [threading.Thread(target=work, name="relex-reader", daemon=True) for _ in range(count)]
        torch_threads = torch.get_num_threads()
        if torch_threads > 1:  # the readers take a core; compute gets the others
            torch.set_num_threads(torch_threads - 1)
        for worker in workers:
            worker.start()
        held = None
        try:
            for k, block in enumerate(blocks):
                if held is not None:
                    free.put(held)
                    held = None
                with finished:
                    finished.wait_for(lambda: k in done)
                    held, matrix, gram = done.pop(k)
                if held is None:
                    raise matrix
                if block.gram and gram is None:
                    gram = chunk_gram(matrix, device)
                yield block, matrix, gram
        finally:
            stop.set()
            for _ in workers:
                free.put(None)  # wakes workers waiting for a buffer
            for worker in workers:
                worker.join()
            torch.set_num_threads(torch_threads)
