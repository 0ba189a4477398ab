"""One pass over a store's trajectories, planned once and driven here, for everything computed from the values.

Per tensor, relex computes two things from the stored values (docs/method.md): the Gram G = M Mᵀ (fit, backtest
errors, plot projections, and the fit extrapolate makes on the way) and weighted sums W · M for a set of targets
and methods (extrapolate). Everything else is T × T algebra. So a pass is

    plan = plan_pass(reader, names, grams=names, sums=names, budget=PassBudget(), device=device)
    run_pass(reader, plan, [consumer, ...], GRAM)      # relex.fit.gram.GRAM: the Gram's arithmetic

`plan_pass` decides every read up front: blocks of T × rows values (`chunk_elements`); a trajectory that needs
both its Gram and weighted sums and fits in `hold_elements` is read once, whole, for both, a larger one twice;
the read-ahead buffers (`buffer_count` of `buffer_elements` floats, pinned host memory when the device is a
GPU) stay within `buffer_bytes` all together, and the first blocks of a trajectory held only in part are kept in
one more buffer, reused from tensor to tensor (where that pays: `plan_pass`). `run_pass` hands the plan to the
store's reader (pure I/O: it reads ahead into those buffers) and tells each consumer, tensor by tensor in plan
order, the Gram (`Consumer.gram`) and then, for the weights it asks for (`Consumer.weights`, which may depend on
that Gram), W · M block by block (`Consumer.sums`). Several consumers' weights are stacked into one product, so
one read serves them all. A consumer that writes checkpoints (`Consumer.adds_base`) is given θ₀ + W · M instead,
with each row's Σ (W · M)² and Σ (θ₀ + W · M): θ₀ is added where the product is formed, so that its values are not
read again. Given `ProductBuffers`, the products go into memory reused from block to block, for consumers that say
when they are done with them.

On the CPU a block's Gram is formed by whichever thread would otherwise wait (a reader or the caller); on a GPU
blocks are copied from the pinned buffers on a side stream into one of two device buffers, so the copy of one
block runs while the kernels of the one before do (`_Staging`). Either way it is the same code, the same blocks.

On the CPU, where a tensor's values are float32 or bf16 in safetensors files read through the page cache (a copied
store, or checkpoints referenced in place), there are no blocks: the kernels read the values themselves, a
piece of every step's row at a time, each piece into the core's cache and its products formed there, on threads
of their own (`_KernelReads`, relex.fit.gram_kernel). A block the size of a trajectory is memory the reader writes
and each product reads back, which is what held a pass to 5-7 times a plain read of the store; a piece never
leaves the cache. The consumers are told the same things in the same order, the sums in row blocks. θ₀'s piece
is read beside the steps' and added there too, where a consumer adds θ₀.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import logging
import math
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Collection, Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from relex.errors import RelexError
from relex.fit.gram import GRAM, non_finite_message, reads_files, torch_sums
from relex.store import STREAM_BUFFERS, STREAM_BYTES, Block, TrajectoryReader
from relex.util import reused

LOG = logging.getLogger(__name__)

DEFAULT_CHUNK_ELEMENTS = 2**22  # values per (T × rows) block read at once: 16 MiB of float32, about the CPU's L3
KERNEL_BLOCK_MIN = 2**16  # values of a block whose W · M the kernels form, below which a tensor is not split more (kernel_block)
DEFAULT_HOLD_ELEMENTS = 2**27  # 512 MiB of float32: a trajectory up to this size is read once, not twice
MIN_BUFFERS = 2  # one the caller computes on while a reader fills the other
# from the page cache, blocks are kept for a second use only when the buffer they are kept in is reused this many
# times over (in values kept, all trajectories together): its first use is new memory (plan_pass)
KEEP_REUSE = 4
DEVICE_SHARE = 0.5  # of a GPU's free memory, the part a pass plans to use unless told (PassBudget.device_bytes)
# float32 copies of a block a GPU holds at once: the two staging buffers, and W · M with its operands at most
DEVICE_COPIES_PER_BLOCK = 3


@dataclass(frozen=True)
class PassBudget:
    """How much a pass may hold: values per block, values held for a second use, read-ahead buffers, and on a GPU
    the device memory its blocks may take (None: DEVICE_SHARE of what is free when the pass is planned).

    `keep_partly`: whether a trajectory too large to hold whole keeps its first blocks for its sums (None: the
    planner decides, `plan_pass`).
    """

    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    hold_elements: int = DEFAULT_HOLD_ELEMENTS
    buffer_bytes: int = STREAM_BYTES
    device_bytes: int | None = None
    keep_partly: bool | None = None


@dataclass(frozen=True)
class TensorReads:
    """The reads of one tensor: its row blocks, whether they serve its Gram, its weighted sums or both, and how many
    of them (the first `held_blocks`) the Gram's read keeps for the sums, which read only the others again."""

    name: str
    rows: tuple[tuple[int, int] | None, ...]
    gram: bool
    sums: bool
    held_blocks: int = 0
    # read by the CPU kernels themselves, straight from its files a piece at a time, for each use (`_KernelReads`):
    # no block of it goes through the stream or its buffers
    in_kernel: bool = False

    @property
    def held(self) -> bool:
        """One read serves both uses: the whole trajectory is kept (one block, whole: no copy)."""
        return self.held_blocks == len(self.rows)

    @property
    def partly_held(self) -> bool:
        """Its first `held_blocks` blocks are kept from the Gram's read (a copy, in the pass's hold buffer), the
        others read again for the sums."""
        return 0 < self.held_blocks < len(self.rows)

    def blocks(self, gram_in_reader: bool) -> list[Block]:
        """The stream blocks: a read for the Gram, then a second one for the sums of the blocks not held."""
        if self.in_kernel:
            return []
        reads = []
        if self.gram:
            reads += [Block(self.name, rows, work=gram_in_reader) for rows in self.rows]
        if self.sums:
            reads += [Block(self.name, rows) for rows in self.rows[self.held_blocks:]]
        return reads


@dataclass(frozen=True)
class PassPlan:
    """Every read of a pass, in order, the buffers they go into, and the one the first blocks of a trajectory that is
    only partly held are kept in (`hold_elements` values: the largest such part; reused from tensor to tensor)."""

    tensors: tuple[TensorReads, ...]
    steps: int
    device: torch.device
    buffer_elements: int
    buffer_count: int
    hold_elements: int = 0

    @property
    def pinned(self) -> bool:
        """Host buffers are page-locked when blocks go to a GPU (asynchronous copies need it)."""
        return self.device.type == "cuda"

    @property
    def buffer_bytes(self) -> int:
        return 4 * self.buffer_elements * self.buffer_count

    def blocks(self) -> list[Block]:
        gram_in_reader = self.device.type == "cpu"  # on a GPU the caller's thread launches the kernels
        return [block for tensor in self.tensors for block in tensor.blocks(gram_in_reader)]

    def allocate(self) -> list[torch.Tensor]:
        return [self._host(self.buffer_elements) for _ in range(self.buffer_count)]

    def allocate_hold(self) -> torch.Tensor | None:
        return self._host(self.hold_elements) if self.hold_elements else None

    def _host(self, elements: int) -> torch.Tensor:
        return torch.empty(elements, dtype=torch.float32, pin_memory=self.pinned and torch.cuda.is_available())


def plan_pass(
    reader: TrajectoryReader, names: Sequence[str], *, grams: Collection[str] = (), sums: Collection[str] = (),
    budget: PassBudget = PassBudget(), device: torch.device | None = None, in_kernel: bool | None = None,
) -> PassPlan:
    """The reads of `names` (in this order) for the Gram of those in `grams` and weighted sums of those in `sums`.

    On the CPU, a tensor that every step (and θ₀, where subtracted) stores in float32, bf16 or fp16 in a safetensors
    file, or in verl's unmerged shards split along its rows, read through the page cache
    (`TrajectoryReader.tensor_files`) is read by the kernels themselves (`in_kernel`, default: wherever they run,
    relex.fit.gram.reads_files): a piece of every step's row at a time, into the core's cache, once for its Gram and
    once for its sums, so none of the blocks, buffers or holding below apply to it; its sums are formed and handed
    over in row blocks of at most `chunk_elements`, and at least one per kernel thread where the tensor is large
    enough (`kernel_block`). Measured on the SmolLM2 store (T = 20, 10.8 GB, page cache, alternating with the blocks
    below): `relex extrapolate` to two targets took 2.41-2.75 s against 3.39-3.71 s on copied float32 deltas,
    2.56-3.24 s against 3.48-4.78 s on float32 checkpoints referenced in place, 3.01-3.56 s against 5.10-7.64 s on
    bf16 ones (4 runs each; docs/performance.md, stop 35); and, on another machine, 5.61-6.63 s against 8.86-10.77 s
    on fp16 ones, and 4.13-4.95 s against 7.01-8.09 s on 6 steps of it as 2-rank FSDP2 shards (stop 38). The others
    (shards split along another dimension, `--io direct`, a GPU) are read in blocks by the store's reader, as
    follows.

    Blocks are at most `chunk_elements` values, and a trajectory read whole for both uses at most `hold_elements`,
    both capped so that MIN_BUFFERS buffers fit in `buffer_bytes` and, on a GPU, so that a block's copies there
    fit the device memory (`device_block_elements`); as many buffers are made as fit (up to
    STREAM_BUFFERS). A larger trajectory wanted twice keeps its first blocks, up to `hold_elements` values, from
    the Gram's read for the sums (a copy in memory instead of a second read, which for a referenced checkpoint
    also re-reads θ₀ and subtracts it), in one buffer of the plan's `hold_elements` values that every such
    trajectory reuses, and reads the others twice. Unless the budget says (`keep_partly`), it keeps them when the
    reads go past the page cache (`TrajectoryReader.direct`: a second read would be a disk read), or when the
    blocks kept add up to KEEP_REUSE times that buffer. From the page cache a second read is one more copy, as
    keeping is, while the buffer is new memory, which the kernel faults in page by page. Measured on the SmolLM2
    store (T = 20, medians of 4-5 alternating runs): with the embedding the one such trajectory, the pass took
    5.90 s reading it twice against 6.23 s keeping 512 MiB of it (6.67 s against 7.79 s on the referenced
    checkpoints); with the budget at 64 MiB, so that 91 trajectories keep 64 MiB each as from 1.5B up, 8.91 s
    and 7.94 s reading them twice against 7.91 s and 6.93 s keeping (two sets of four runs). A block is never
    less than one row at every step, so only a row larger than the budget itself can exceed it.
    """
    steps = max(1, len(reader.steps))
    largest_block = budget.buffer_bytes // (4 * MIN_BUFFERS)
    if device is not None and device.type == "cuda":
        largest_block = min(largest_block, device_block_elements(budget, device))
    chunk, hold = min(budget.chunk_elements, largest_block), min(budget.hold_elements, largest_block)
    if in_kernel is None:  # direct reads never go to the kernels: the kernels then load beside the first reads
        in_kernel = not reader.direct and reads_files(device or torch.device("cpu"))
    tensors = []
    for name in names:
        gram, summed = name in grams, name in sums
        if not (gram or summed):
            continue
        if in_kernel and reader.tensor_files(name) is not None:  # its sums are handed over in row blocks
            rows = tuple(reader.row_blocks(name, min(chunk, kernel_block(steps, reader.infos[name].numel)))) if summed else (None,)
            tensors.append(TensorReads(name, rows, gram, summed, in_kernel=True))
            continue
        if gram and summed and steps * reader.infos[name].numel <= hold:
            tensors.append(TensorReads(name, (None,), gram, summed, held_blocks=1))
            continue
        rows = tuple(reader.row_blocks(name, chunk))
        tensors.append(TensorReads(name, rows, gram, summed, _leading_blocks(reader, name, rows, hold) if gram and summed else 0))
    kept = [steps * sum(reader.block_numel(t.name, r) for r in t.rows[: t.held_blocks]) for t in tensors if t.partly_held]
    keep = budget.keep_partly
    if keep is None:
        keep = reader.direct or sum(kept) >= KEEP_REUSE * max(kept, default=0)
    if not keep:  # read twice instead
        tensors, kept = [dataclasses.replace(t, held_blocks=0) if t.partly_held else t for t in tensors], []
    largest = max((steps * reader.block_numel(t.name, r) for t in tensors if not t.in_kernel for r in t.rows), default=0)
    count = max(MIN_BUFFERS, min(STREAM_BUFFERS, budget.buffer_bytes // max(1, 4 * largest)))
    return PassPlan(tuple(tensors), steps, device or torch.device("cpu"), largest, count, max(kept, default=0))


def kernel_block(steps: int, numel: int) -> int:
    """The largest row block, in values (T × its columns), of a tensor whose W · M the kernels form: one block per
    kernel thread, so that each forms a share of it at once (a job is one block), unless that makes them smaller
    than KERNEL_BLOCK_MIN values."""
    return max(KERNEL_BLOCK_MIN, -(-steps * numel // kernel_threads()))


def device_block_elements(budget: PassBudget, device: torch.device) -> int:
    """The largest block, in values, whose copies on the GPU (DEVICE_COPIES_PER_BLOCK of them) fit the budget's
    device memory; a block is still never less than one row at every step."""
    free = budget.device_bytes
    if free is None:
        free = int(torch.cuda.mem_get_info(device)[0] * DEVICE_SHARE)
    if free <= 0:
        raise RelexError(f"no memory free on {device} for a pass; free some, or run with --device cpu")
    return max(1, free // (4 * DEVICE_COPIES_PER_BLOCK))


def _leading_blocks(reader: TrajectoryReader, name: str, rows, elements: int) -> int:
    """How many of the first row blocks of `name` hold at most `elements` values at every step together."""
    total, count = 0, 0
    for block in rows:
        total += len(reader.steps) * reader.block_numel(name, block)
        if total > elements:
            break
        count += 1
    return count


class Consumer:
    """What a pass computes for each tensor, told in plan order; a consumer overrides the methods it needs."""

    # whether this consumer's sums are θ₀ + W · M (a checkpoint's values, extrapolate's), θ₀ added by the pass: by the
    # kernels as they read, beside the steps' values, where they read the tensor (else by `TrajectoryPass._add_base`)
    adds_base: bool = False

    def gram(self, name: str, gram: np.ndarray) -> None:
        """The tensor's Gram (float64, T × T, checked finite), for a tensor planned with one."""

    def weights(self, name: str, gram: np.ndarray | None) -> np.ndarray | None:
        """Weights W (rows × T) for the sums of a tensor planned with them; None: none wanted from this consumer.
        Asked in plan order, but for a tensor the kernels read, as soon as its Gram is formed: before the sums of the
        tensor ahead of it are told (`TrajectoryPass.tensor`). So what a consumer does in order with the values (a
        writer's next tensor) belongs in `sums` and `done`, not here."""
        return None

    def sums(self, name: str, rows: tuple[int, int] | None, sums: torch.Tensor, checks: np.ndarray | None = None) -> None:
        """W · M for one row block (float32 on the host, one row per row of this consumer's W). For a consumer that
        `adds_base`, θ₀ + W · M, with `checks` (float64, a row per row of W): Σ (W · M)² (the predicted update's
        squared norm) and Σ (θ₀ + W · M), which is finite exactly when every value is."""

    def done(self, name: str) -> None:
        """The tensor is finished: every planned read of it was taken."""


class GramCollector(Consumer):
    """Collects every tensor's Gram (fit, a rank's share under torchrun)."""

    def __init__(self):
        self.grams: dict[str, np.ndarray] = {}

    def gram(self, name: str, gram: np.ndarray) -> None:
        self.grams[name] = gram


class ProductBuffers:
    """Memory for a pass's W · M products, reused from block to block instead of new for each.

    The products of an extrapolation add up to targets × the model's values (1.08 GB for two SmolLM2 targets), and
    Linux maps and zeroes every page of new memory at its first use: 84,000 page faults per pass on that store.
    The pass holds each product while it tells the consumers, and lets go after; a consumer that keeps the
    values longer (a writer thread) holds them too (`hold`, on the product or any view of it) and lets go when done
    (`release`). A buffer nobody holds is taken again for a later product of at most its size and at least half
    of it. Products under `smallest` values are left to the allocator, and at most `keep_bytes` of free buffers are
    kept. Thread-safe: a writer thread releases.
    """

    def __init__(self, smallest: int = 2**18, keep_bytes: int = 2**27):
        self.smallest, self.keep_bytes = smallest, keep_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, torch.Tensor]] = []  # (values, buffer), oldest first
        self._free_values = 0  # what `_free` holds in all
        self._held: dict[int, list] = {}  # storage address -> [buffer, holds]

    def take(self, numel: int) -> torch.Tensor:
        """A flat float32 tensor of `numel` values, held once by the caller (new memory when none is free)."""
        if numel < self.smallest:
            return torch.empty(numel, dtype=torch.float32)
        with self._lock:
            fits = [(size, i) for i, (size, _) in enumerate(self._free) if numel <= size <= 2 * numel]
            if fits:
                size, buffer = self._free.pop(min(fits)[1])
                self._free_values -= size
            else:
                buffer = torch.empty(numel, dtype=torch.float32)
            self._held[_address(buffer)] = [buffer, 1]
        return buffer[:numel]

    def hold(self, values: torch.Tensor) -> None:
        """One more hold on the product `values` belongs to (nothing for a tensor that is not one)."""
        with self._lock:
            entry = self._held.get(_address(values))
            if entry is not None:
                entry[1] += 1

    def release(self, values: torch.Tensor) -> None:
        """Let go of one hold; the last one frees the buffer for a later product."""
        with self._lock:
            key = _address(values)
            entry = self._held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1]:
                return
            del self._held[key]
            self._free.append((entry[0].numel(), entry[0]))
            self._free_values += entry[0].numel()
            while 4 * self._free_values > self.keep_bytes:
                self._free_values -= self._free.pop(0)[0]

    @property
    def held(self) -> int:
        """Products some holder has not let go of."""
        with self._lock:
            return len(self._held)


def _address(values: torch.Tensor) -> int:
    return values.untyped_storage().data_ptr()


def run_pass(reader: TrajectoryReader, plan: PassPlan, consumers: Sequence[Consumer], gram=None, desc: str | None = None,
             products: ProductBuffers | None = None) -> None:
    """Drive `plan` over `reader`, telling `consumers` what each tensor yields (a progress bar per tensor with `desc`).

    `gram`: the pass's arithmetic, with `prepare(device)`, `chunk_gram(matrix, device)`, `check(name, gram,
    steps)` and `chunk_sums(w, matrix, out)` (relex.fit.gram.GRAM); needed when the plan forms Gram matrices,
    and without it W · M is torch's matrix multiply. `products`: where the W · M products go; without it each is
    new memory, which a consumer may keep as long as it likes. With it, a consumer that keeps a product's values
    past its `sums` call must hold them (`ProductBuffers.hold`).
    """
    with TrajectoryPass(reader, plan, gram, products) as engine:
        for reads in tqdm(plan.tensors, desc=desc, unit="tensor", leave=False, disable=None if desc else True):
            engine.tensor(reads, consumers)
        engine.finish()


@dataclass
class _Queued:
    """A tensor the kernels read, whose W · M is queued (`TrajectoryPass._queue_kernel_tensor`): the consumers
    that asked for sums with their weights, and per row block (rows, product, first column, checks) and its job."""

    reads: TensorReads
    consumers: Sequence[Consumer]
    gram: np.ndarray | None
    wanted: list = dataclasses.field(default_factory=list)
    base: np.ndarray | None = None
    in_kernel_base: bool = False
    blocks: list = dataclasses.field(default_factory=list)
    formed: list = dataclasses.field(default_factory=list)


class TrajectoryPass:
    """A planned pass in progress: the reader's stream of blocks, and the tensor each of them belongs to."""

    def __init__(self, reader: TrajectoryReader, plan: PassPlan, gram=None, products: ProductBuffers | None = None):
        self.products = products
        self._base_block = torch.empty(0, dtype=torch.uint8)  # θ₀'s values of a block (`_add_base`), reused
        grams = any(t.gram for t in plan.tensors)
        if gram is None and grams:
            raise ValueError("plan_pass planned Gram matrices; run_pass needs the Gram arithmetic (relex.fit.gram.GRAM)")
        self.reader, self.plan, self.arithmetic, self.device = reader, plan, gram, plan.device
        in_kernel = [t for t in plan.tensors if t.in_kernel]
        if gram is None and in_kernel:
            raise ValueError("plan_pass planned reads by the CPU kernels; run_pass needs their arithmetic (relex.fit.gram.GRAM)")
        work = self._block_gram if any(t.gram and not t.in_kernel for t in plan.tensors) else None
        if gram is not None:  # load the CPU kernels while the first reads run
            threading.Thread(target=gram.prepare, args=(self.device,), name="relex-prepare", daemon=True).start()
        map_large_blocks()
        self.buffers = plan.allocate()
        # one buffer for the blocks kept from a partly held trajectory, reused by the next such trajectory: a copy
        # per tensor would be fresh memory each time, and on Linux the kernel maps and zeroes every page of it
        # (512 MiB: 0.32-0.36 s, against 0.07 s to copy into memory already in use, measured here)
        self.hold = plan.allocate_hold()
        partly = [t for t in plan.tensors if t.partly_held]
        self._last_partly = partly[-1] if partly else None  # after it, the hold buffer is given back
        self._blocks = reader.stream(plan.blocks(), work=work, buffers=self.buffers)
        self._staging = _Staging(self.device, plan.buffer_elements)
        self._kernel = _KernelReads(reader, in_kernel, gram, kernel_threads()) if in_kernel else None  # starts its threads
        self._queued: _Queued | None = None  # a tensor whose W · M is queued, not yet told (`tensor`)

    def _block_gram(self, block: Block, matrix: torch.Tensor) -> torch.Tensor:
        """A block's Gram, formed by whichever of the stream's threads would otherwise wait (on the CPU)."""
        return self.arithmetic.chunk_gram(matrix, self.device)

    def __enter__(self) -> "TrajectoryPass":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finish(self) -> None:
        """Tell the consumers what is still queued: the last tensor's sums (`tensor`)."""
        queued, self._queued = self._queued, None
        self._tell_queued(queued)

    def close(self) -> None:
        if self._queued is not None:  # an error came first: the queued tensor is not told
            self._let_go(self._queued)
            self._queued = None
        self._blocks.close()
        if self._kernel is not None:
            self._kernel.close()

    def tensor(self, reads: TensorReads, consumers: Sequence[Consumer]) -> None:
        """Take every planned read of one tensor, telling the consumers its Gram and sums.

        A tensor the kernels read is taken one tensor ahead: its Gram is told and its W · M queued, then the consumers
        are told the sums of the tensor before it (`_tell_queued`), and its own when the next tensor comes, or at
        `finish`. So the kernels form one tensor's products while the consumers take the last one's, instead of
        waiting for them (on the SmolLM2 run: 272 tensors, most of them a few milliseconds of kernel work). Consumers are
        told each tensor's Gram and asked for its weights in plan order, and its sums and `done` in plan order,
        but a tensor's Gram and weights may come before the sums of the one ahead of it (`Consumer.weights`)."""
        if reads.in_kernel:
            previous, self._queued = self._queued, self._queue_kernel_tensor(reads, consumers)
        else:
            previous, self._queued = self._queued, None
        self._tell_queued(previous)
        if reads.in_kernel:
            return
        gram, held = None, []
        if reads.gram:
            gram = self._gram(reads, held)
            for consumer in consumers:
                consumer.gram(reads.name, gram)
        if reads.sums:
            self._sums(reads, consumers, gram, held)
        if reads is self._last_partly:
            held.clear()
            self.hold = None  # no later tensor needs it: its memory is freed for the rest of the pass
        for consumer in consumers:
            consumer.done(reads.name)

    def _read(self, reads: TensorReads, start: int = 0) -> Iterator[tuple[tuple[int, int] | None, torch.Tensor, object]]:
        """The next planned blocks of the stream, a read of `reads.name` from its block `start` on: (rows, host
        matrix, its Gram or None)."""
        for rows in reads.rows[start:]:
            self._staging.release()  # the host buffer the last copy came from may be read into again
            block, matrix, part = next(self._blocks)
            if (block.name, block.rows) != (reads.name, rows):
                raise AssertionError(f"read plan out of step: {block.name} {block.rows} read for {reads.name} {rows}")
            yield rows, matrix, part

    def _gram(self, reads: TensorReads, held: list) -> np.ndarray:
        """The Gram of `reads.name`, the sum of its blocks' parts; the blocks planned to be held are kept in `held`
        (copied out of the stream's buffers into the pass's hold buffer, unless the one block is the whole
        trajectory)."""
        steps, kept = self.plan.steps, 0
        total = torch.zeros(steps, steps, dtype=torch.float64, device=self.device)
        for k, (rows, matrix, part) in enumerate(self._read(reads)):
            staged = None
            if part is None:  # on a GPU, or a block the stream left to this thread
                staged = self._staging.put(matrix)
                part = self.arithmetic.chunk_gram(staged, self.device)
            total += part
            if reads.held:
                held.append((rows, matrix, staged))
            elif k < reads.held_blocks:
                copy = self.hold[kept : kept + matrix.numel()].view(matrix.shape).copy_(matrix)
                kept += matrix.numel()
                held.append((rows, copy, None))
        gram = total.cpu().numpy()
        self.arithmetic.check(reads.name, gram, self.reader.steps)
        return gram

    def _queue_kernel_tensor(self, reads: TensorReads, consumers: Sequence[Consumer]) -> _Queued:
        """One tensor the kernels read themselves, up to its W · M: its Gram (formed ahead by `_KernelReads`) told to
        the consumers, their weights asked for, and W · M queued for all of them, one product per row block. Every
        block is queued at once, so the kernels form them while the consumers take the tensor before this one
        (`_tell_queued`)."""
        name, gram = reads.name, None
        if reads.gram:
            gram = self._kernel.gram(name)
            self.arithmetic.check(name, gram, self.reader.steps)
            for consumer in consumers:
                consumer.gram(name, gram)
        queued = _Queued(reads, consumers, gram)
        queued.wanted = self._wanted(reads, consumers, gram) if reads.sums else []
        if not queued.wanted:
            return queued
        w = np.ascontiguousarray(np.concatenate([w for _, w in queued.wanted]), dtype=np.float32)
        queued.base = _base_weights(queued.wanted)
        queued.in_kernel_base = queued.base is not None and self._kernel.reads_base(name)
        start = 0
        try:
            for rows in reads.rows:
                columns = self.reader.block_numel(name, rows)
                checks = None if queued.base is None else np.zeros((len(w), 2))
                queued.blocks.append((rows, self._out(len(w), columns), start, checks))
                start += columns
            queued.formed = self._kernel.sums(name, w, [(out.numpy(), at, checks) for _, out, at, checks in queued.blocks],
                                              queued.base if queued.in_kernel_base else None)
        except BaseException:
            self._let_go(queued)
            raise
        return queued

    def _tell_queued(self, queued: _Queued | None) -> None:
        """Tell the consumers the W · M of a queued tensor (`_queue_kernel_tensor`) block by block as the kernels
        form them, then that it is done."""
        if queued is None:
            return
        name = queued.reads.name
        try:
            for (rows, sums, _, checks), formed in zip(queued.blocks, queued.formed):
                formed.result()
                if queued.base is not None and not queued.in_kernel_base:
                    self._add_base(name, rows, sums, queued.base, checks)
                if queued.gram is None and not _finite_sums(sums, checks):
                    # a NaN or Inf in the values, or an overflow: their Gram's diagonal names the step (relex.fit.gram)
                    self.arithmetic.check(name, self._kernel.gram_now(name), self.reader.steps)
                self._tell(queued.reads, queued.wanted, rows, sums, checks)
        finally:
            self._let_go(queued)
        for consumer in queued.consumers:
            consumer.done(name)

    def _let_go(self, queued: _Queued) -> None:
        """Drop a queued tensor's jobs not begun, wait for the others, and give its products back."""
        self._kernel.settle(queued.formed)
        if self.products is not None:
            for _, sums, _, _ in queued.blocks:
                self.products.release(sums)
        queued.formed, queued.blocks = [], []

    def _wanted(self, reads: TensorReads, consumers: Sequence[Consumer], gram: np.ndarray | None) -> list:
        """(consumer, W) for each consumer that asks for weighted sums of this tensor."""
        wanted = [(consumer, consumer.weights(reads.name, gram)) for consumer in consumers]
        return [(consumer, w) for consumer, w in wanted if w is not None]

    @staticmethod
    def _tell(reads: TensorReads, wanted: list, rows, sums: torch.Tensor, checks: np.ndarray | None) -> None:
        """Each consumer its rows of one product (its W's rows, stacked in `_wanted`'s order), and their checks
        to a consumer that adds θ₀."""
        bounds = np.cumsum([0] + [len(w) for _, w in wanted])
        for (consumer, _), a, b in zip(wanted, bounds[:-1], bounds[1:]):
            if consumer.adds_base:
                consumer.sums(reads.name, rows, sums[a:b], checks[a:b])
            else:
                consumer.sums(reads.name, rows, sums[a:b])

    def _add_base(self, name: str, rows, sums: torch.Tensor, base: np.ndarray, checks: np.ndarray) -> None:
        """θ₀'s values (`rows` of tensor `name`) added to the rows of `sums` that `base` weighs, and every row's
        checks (`Consumer.sums`): what the kernels do as they read, for a tensor read in blocks or a θ₀ they cannot
        read. θ₀ goes into memory reused from block to block."""
        nbytes = sums.shape[1] * self.reader.base.info(name).dtype.itemsize
        self._base_block = reused(self._base_block, nbytes, torch.uint8)
        theta = self.reader.base.read(name, rows, self._base_block).reshape(-1)
        for r, row in enumerate(sums):
            checks[r, 0] = float(torch.dot(row, row))
            if base[r]:
                row.add_(theta, alpha=float(base[r]))
            checks[r, 1] = float(np.sum(row.numpy(), dtype=np.float64))  # cast in numpy's small buffers, not copied whole

    def _sums(self, reads: TensorReads, consumers: Sequence[Consumer], gram: np.ndarray | None, held: list) -> None:
        """W · M block by block for the weights the consumers ask for, all of them in one product per block."""
        wanted = self._wanted(reads, consumers, gram)
        again = ((rows, matrix, None) for rows, matrix, _ in self._read(reads, reads.held_blocks))
        blocks = itertools.chain(held, again)
        if not wanted:
            for _ in blocks:  # the planned reads are taken all the same
                pass
            return
        w = torch.as_tensor(np.concatenate([w for _, w in wanted]), dtype=torch.float32, device=self.device)
        base = _base_weights(wanted)
        for rows, matrix, staged in blocks:
            sums = self._product(w, staged if staged is not None else self._staging.put(matrix))
            try:
                checks = None if base is None else np.zeros((len(w), 2))
                if base is not None:
                    self._add_base(reads.name, rows, sums, base, checks)
                check_finite_inputs(reads.name, sums, matrix, self.reader.steps, checks)
                self._tell(reads, wanted, rows, sums, checks)
            finally:
                if self.products is not None:
                    self.products.release(sums)

    def _out(self, rows: int, columns: int) -> torch.Tensor:
        """Host memory for a product (rows × columns float32): new, or a buffer of `products`."""
        if self.products is None:
            return torch.empty(rows, columns, dtype=torch.float32)
        return self.products.take(rows * columns).view(rows, columns)

    def _product(self, w: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """W · M on the host: new memory, or a buffer of `products`; by the arithmetic's `chunk_sums` (on the CPU,
        relex.fit.gram_kernel's), else torch's matrix multiply."""
        out = None if self.products is None else self._out(len(w), matrix.shape[1])
        return (torch_sums if self.arithmetic is None else self.arithmetic.chunk_sums)(w, matrix, out)


# glibc's mmap threshold from the first pass of a process on (`map_large_blocks`): a block of 2**22 float32 values
LARGE_BLOCK_BYTES = 16 * 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter for it (glibc's malloc.h)


@functools.cache
def map_large_blocks() -> bool:
    """Have glibc serve every allocation of LARGE_BLOCK_BYTES or more from a memory map of its own, given back to
    the system when freed; whether it took (False on another C library). By default glibc raises that threshold
    to the size of each large block freed (up to 32 MiB) and then serves such blocks from its heap, where a pass's
    blocks and products, of sizes that change from tensor to tensor, leave holes it does not give back. On the
    SmolLM2 run with `--io direct`, peak RSS grew from 0.95 GiB to 1.28-1.59 GiB over the layers after the
    embedding that way, and stays at 0.95 GiB with the threshold fixed (measured 2026-12-02). Once per process;
    allocations under the threshold, most of a training step's, are left to glibc as before."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))


MAX_KERNEL_THREADS = 8  # threads of `_KernelReads`: each reads and computes on its own core, at most this many
GRAMS_AHEAD = 2  # the Grams of this many tensors after one are formed before its W · M (`_KernelReads`)


def kernel_threads() -> int:
    """Threads for the kernels that read the values themselves: as many as torch would compute on (the cores, or
    what OMP_NUM_THREADS says), at most MAX_KERNEL_THREADS."""
    return max(1, min(MAX_KERNEL_THREADS, torch.get_num_threads()))


class _KernelReads:
    """The tensors a pass's kernels read themselves (`TensorReads.in_kernel`), on threads of their own, each
    running a kernel (which releases the GIL) start to end on its core. Every Gram is queued at the start in plan
    order: a T × T result, so they run ahead of the caller at no cost in memory. A tensor's W · M, which needs
    the weights fitted from its Gram, is queued when the caller has them (`sums`), one job per row block. Jobs run
    in plan order, a tensor's W · M as if it came GRAMS_AHEAD tensors later: after the Grams of the tensors just
    ahead of it, which the caller asks for next (`TrajectoryPass.tensor` queues one tensor's W · M before it
    tells the last one's), and before the Grams of those further on, which can wait. A failed job's error is
    raised where the caller waits for it."""

    def __init__(self, reader: TrajectoryReader, tensors: Sequence[TensorReads], arithmetic, threads: int):
        self.arithmetic = arithmetic
        self.files = {t.name: reader.tensor_files(t.name) for t in tensors}
        self.jobs: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()  # ties of priority go first come, first served
        self.index = {t.name: i for i, t in enumerate(tensors)}  # plan order: a job's priority (`sums`)
        self.grams = {t.name: self._queue(self.index[t.name], arithmetic.file_gram, self.files[t.name]) for t in tensors if t.gram}
        self.threads = [threading.Thread(target=self._run, name="relex-kernel", daemon=True) for _ in range(threads)]
        # the kernels take their cores; the caller's own arithmetic (the consumers': θ₀ + W · M, norms) gets the rest,
        # or one: torch's idle threads spin a while after each product, on the cores the kernels need
        self.torch_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, self.torch_threads - threads))
        for thread in self.threads:
            thread.start()

    def _queue(self, priority: int, job, *args) -> Future:
        future: Future = Future()
        self.jobs.put((priority, next(self.order), job, args, future))
        return future

    def _run(self) -> None:
        while True:
            _, _, job, args, future = self.jobs.get()
            if job is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job(*args))
            except BaseException as error:  # raised where the caller waits for it
                future.set_exception(error)

    def gram(self, name: str) -> np.ndarray:
        """The Gram of tensor `name`, queued at the start; waits for it."""
        return self.grams.pop(name).result()

    def gram_now(self, name: str) -> np.ndarray:
        """The Gram of tensor `name`, formed on the caller's thread (a pass that planned none, finding a NaN)."""
        return self.arithmetic.file_gram(self.files[name])

    def reads_base(self, name: str) -> bool:
        """Whether the kernels can read θ₀'s values of tensor `name` (to add them to sums)."""
        return self.files[name].base_descriptor >= 0

    def sums(self, name: str, w: np.ndarray, blocks: Sequence[tuple[np.ndarray, int, np.ndarray | None]],
             base: np.ndarray | None = None) -> list[Future]:
        """Queue W · M of tensor `name` for each block (out, first column, checks): `out` (float32, rows of W ×
        columns) gets the block's columns, and with `base` (a weight of θ₀ per row of W) θ₀ · base added and
        `checks` formed (`Consumer.sums`). One job per block, in the order above; their futures, in order."""
        files = self.files[name]
        priority = self.index[name] + GRAMS_AHEAD
        return [self._queue(priority, self.arithmetic.file_sums, w, files, out, at, at + out.shape[1], base, checks)
                for out, at, checks in blocks]

    @staticmethod
    def settle(jobs: Sequence[Future]) -> None:
        """Drop the jobs not begun and wait for the others, so that no kernel still writes into memory about to be
        given back (after an error in one of them, already raised)."""
        for job in jobs:
            if not job.cancel():
                try:
                    job.result()
                except BaseException:  # noqa: BLE001 - the error that matters was raised; this job only had to end
                    pass

    def close(self) -> None:
        """Stop the threads once their running kernels return; queued jobs are dropped."""
        for _ in self.threads:
            self.jobs.put((-1, next(self.order), None, (), None))
        for thread in self.threads:
            thread.join()
        torch.set_num_threads(self.torch_threads)


class _Staging:
    """Host blocks onto the device. On a GPU: copied from the pinned buffers on a side stream into one of two
    device buffers, each reused once the kernels that read it are done, so one block's copy overlaps the kernels
    of the block before. On the CPU: the block itself."""

    def __init__(self, device: torch.device, elements: int):
        self.on_gpu = device.type == "cuda"
        if not self.on_gpu:
            return
        self.buffers = [torch.empty(elements, dtype=torch.float32, device=device) for _ in range(2)]
        self.copies = torch.cuda.Stream(device)
        self.used = [None, None]  # per device buffer: an event after the kernels that read it
        self.copied = None  # the event after the last copy
        self.turn = 0

    def put(self, matrix: torch.Tensor) -> torch.Tensor:
        if not self.on_gpu:
            return matrix
        i, self.turn = self.turn, 1 - self.turn
        compute = torch.cuda.current_stream(self.buffers[i].device)
        self.used[1 - i] = compute.record_event()  # the kernels that read the other buffer are queued by now
        target = self.buffers[i][: matrix.numel()].view(matrix.shape)
        with torch.cuda.stream(self.copies):
            if self.used[i] is not None:  # this buffer's last block: its kernels must be done before it is overwritten
                self.copies.wait_event(self.used[i])
            target.copy_(matrix, non_blocking=True)
            self.copied = self.copies.record_event()
        compute.wait_event(self.copied)
        return target

    def release(self) -> None:
        """Wait for the last copy (not the kernels), so that its host buffer can be refilled."""
        if self.on_gpu and self.copied is not None:
            self.copied.synchronize()
            self.copied = None


def _base_weights(wanted: list) -> np.ndarray | None:
    """θ₀'s weight in each row of a stacked product (1 in the rows of a consumer that adds θ₀, else 0), or None
    when no consumer does."""
    if not any(consumer.adds_base for consumer, _ in wanted):
        return None
    return np.concatenate([np.full(len(w), float(consumer.adds_base), dtype=np.float32) for consumer, w in wanted])


def _finite_sums(sums: torch.Tensor, checks: np.ndarray | None) -> bool:
    """Whether every value of a product is finite: from its checks where it has them (θ₀ added), else its sum."""
    if checks is not None:
        return bool(np.isfinite(checks).all())
    return math.isfinite(float(sums.sum()))


def check_finite_inputs(name: str, sums: torch.Tensor, matrix: torch.Tensor, steps, checks: np.ndarray | None = None) -> None:
    """Refuse weighted sums made non-finite by a NaN or Inf in the values read, naming the step that holds it.

    Passes without a Gram (a saved fit, two-point, observed...) see such values only here. A sum is the cheap
    test (a NaN or Inf in the sums comes from one in the values, or from an overflow), or the sums' `checks`
    where θ₀ was added; only then is `matrix` scanned, which names the step, or finds none (an overflow, left to
    the writer's check of its output).
    """
    if _finite_sums(sums, checks):
        return
    bad = ~torch.isfinite(matrix).all(dim=1).cpu()
    if bad.any():
        raise RelexError(non_finite_message(name, int(steps[int(bad.nonzero()[0, 0])])))


def tensor_gram(reader, name: str, device: torch.device, max_elements: int) -> np.ndarray:
    """G for tensor `name` over the reader's steps, reading one row block at a time."""
    return dict(tensor_grams(reader, [name], device, max_elements))[name]


def tensor_grams(reader, names: list[str], device: torch.device, max_elements: int = DEFAULT_CHUNK_ELEMENTS,
                 desc: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, G) for each of `names` in order, from one pass reading blocks of at most `max_elements` values."""
    collector = GramCollector()
    plan = plan_pass(reader, names, grams=names, budget=PassBudget(chunk_elements=max_elements), device=device)
    run_pass(reader, plan, [collector], GRAM, desc=desc)
    return iter(collector.grams.items())
