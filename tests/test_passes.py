"""The pass engine (relex.fit.passes): its plan stays within the budget and reuses its buffers, a held trajectory is
read once for both uses, and what the consumers are told equals a float64 computation from the values read whole."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from relex.errors import RelexError
from relex.fit.gram import GRAM
from relex.fit.passes import KEEP_REUSE, Consumer, PassBudget, ProductBuffers, TrajectoryPass, plan_pass, run_pass
from relex.io.checkpoint import CheckpointReader
from relex.io.dtypes import parse_dtype
from relex.store import KERNEL_DTYPES, TrajectoryStore
from relex.synthetic import write_planted_run
from tests.conftest import STEPS, cli, make_base
from tests.test_bad_input import edit


class Recorder(Consumer):
    """Asks for fixed weights and keeps what it is told."""

    def __init__(self, weights: np.ndarray | None):
        self.w, self.grams, self.parts, self.order = weights, {}, {}, []

    def gram(self, name, gram):
        self.grams[name] = gram

    def weights(self, name, gram):
        self.order.append(name)
        return self.w

    def sums(self, name, rows, sums):
        self.parts.setdefault(name, []).append(sums.clone())

    def whole(self, name: str) -> torch.Tensor:
        return torch.cat(self.parts[name], dim=1)


def spy_reads(reader, monkeypatch) -> list[tuple[str, object, int]]:
    """(tensor, rows, storage address of the destination) for every block the reader fills."""
    seen, real = [], reader.read_into

    def read_into(name, out, rows=None):
        seen.append((name, rows, out.untyped_storage().data_ptr()))
        real(name, out, rows)

    monkeypatch.setattr(reader, "read_into", read_into)
    return seen


BUDGETS = [
    PassBudget(chunk_elements=len(STEPS) * 64, hold_elements=0, buffer_bytes=2**20),  # small blocks, nothing held
    PassBudget(chunk_elements=len(STEPS) * 200, hold_elements=len(STEPS) * 2048, buffer_bytes=2**20),  # small ones held
    PassBudget(chunk_elements=2**22, hold_elements=2**27, buffer_bytes=len(STEPS) * 4 * 3000),  # the budget caps both
]


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_plan_stays_within_its_budget_and_reuses_its_buffers(store, budget, monkeypatch):
    reader = store.reader()
    names = store.trajectory_names
    plan = plan_pass(reader, names, grams=names, sums=names, budget=budget, in_kernel=False)
    assert plan.buffer_bytes <= budget.buffer_bytes and plan.buffer_count >= 2
    blocks = plan.blocks()
    assert all(len(STEPS) * reader.block_numel(b.name, b.rows) <= plan.buffer_elements for b in blocks)
    assert all(4 * len(STEPS) * reader.block_numel(b.name, b.rows) <= budget.buffer_bytes // 2 for b in blocks)
    seen = spy_reads(reader, monkeypatch)
    with TrajectoryPass(reader, plan, GRAM) as engine:
        buffers = {b.untyped_storage().data_ptr() for b in engine.buffers}
        for reads in plan.tensors:
            engine.tensor(reads, [Recorder(np.ones((1, len(STEPS))))])
    assert [(name, rows) for name, rows, _ in seen] == [(b.name, b.rows) for b in blocks]  # each planned read, once
    assert {address for _, _, address in seen} <= buffers  # only the planned buffers are read into...
    assert len(seen) > 2 * len(buffers)  # ...each of them many times


def test_on_a_gpu_blocks_are_sized_by_its_memory(store, monkeypatch):
    """Planned for a GPU (no GPU needed to plan), blocks and held trajectories shrink to the device memory the budget
    allows; the memory free on the device is asked for only when the budget does not say, and a GPU without any
    free is refused in one line."""
    reader = store.reader()
    names = store.trajectory_names
    cuda = torch.device("cuda")
    roomy = plan_pass(reader, names, grams=names, sums=names, budget=PassBudget(device_bytes=2**40), device=cuda)
    cpu = plan_pass(reader, names, grams=names, sums=names, budget=PassBudget(), in_kernel=False)
    assert roomy.tensors == cpu.tensors and roomy.pinned and not cpu.pinned
    device_bytes = 4 * 3 * len(STEPS) * 500  # three copies of a block of 500 values at every step
    tight = plan_pass(reader, names, grams=names, sums=names, budget=PassBudget(device_bytes=device_bytes), device=cuda)
    assert 3 * 4 * tight.buffer_elements <= device_bytes
    assert any(len(t.rows) > 1 for t in tight.tensors) and len(tight.blocks()) > len(cpu.blocks())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * device_bytes, 2**40))
    asked = plan_pass(reader, names, grams=names, sums=names, device=cuda)  # DEVICE_SHARE of the free memory
    assert asked.tensors == tight.tensors
    with pytest.raises(RelexError, match="no memory free on cuda"):
        plan_pass(reader, names, grams=names, budget=PassBudget(device_bytes=0), device=cuda)


def test_what_is_held_is_read_once_and_only_the_rest_twice(store, monkeypatch):
    reader = store.reader()
    names = store.trajectory_names
    sizes = {n: len(STEPS) * store.tensors[n].numel for n in names}
    hold = sorted(sizes.values())[len(sizes) // 2]
    budget = PassBudget(chunk_elements=len(STEPS) * 256, hold_elements=hold, keep_partly=True)
    plan = plan_pass(reader, names, grams=names, sums=names, budget=budget, in_kernel=False)
    assert {t.name for t in plan.tensors if t.held} == {n for n in names if sizes[n] <= hold}
    partly = [t for t in plan.tensors if t.partly_held]
    assert partly  # larger trajectories keep their first blocks...
    for reads in partly:  # ...up to the budget
        kept = sum(len(STEPS) * reader.block_numel(reads.name, rows) for rows in reads.rows[: reads.held_blocks])
        assert kept <= hold < kept + len(STEPS) * reader.block_numel(reads.name, reads.rows[reads.held_blocks])
    # the kept blocks of every partly held trajectory go into one buffer, the size of the largest such part
    assert plan.hold_elements == max(len(STEPS) * sum(reader.block_numel(t.name, rows) for rows in t.rows[: t.held_blocks]) for t in partly)
    seen = spy_reads(reader, monkeypatch)
    recorder = Recorder(np.ones((1, len(STEPS))))
    taken: dict[str, list[torch.Tensor]] = {}  # per tensor: the blocks its sums took from memory, not a second read
    with TrajectoryPass(reader, plan, GRAM) as engine:
        real = engine._sums

        def sums(reads, consumers, gram, held):
            taken[reads.name] = [matrix for _, matrix, _ in held]
            real(reads, consumers, gram, held)

        monkeypatch.setattr(engine, "_sums", sums)
        hold = engine.hold
        assert hold.numel() == plan.hold_elements
        for reads in plan.tensors:
            engine.tensor(reads, [recorder])
        assert engine.hold is None  # given back after the last partly held tensor
    for reads in partly:  # one buffer serves them all, reused from tensor to tensor
        assert len(taken[reads.name]) == reads.held_blocks
        assert {m.untyped_storage().data_ptr() for m in taken[reads.name]} == {hold.untyped_storage().data_ptr()}
    for reads in plan.tensors:
        numel = store.tensors[reads.name].numel
        again = sum(reader.block_numel(reads.name, rows) for rows in reads.rows[reads.held_blocks:]) if not reads.held else 0
        assert sum(reader.block_numel(name, rows) for name, rows, _ in seen if name == reads.name) == numel + again
        torch.testing.assert_close(recorder.whole(reads.name), reader.read(reads.name).sum(0, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("direct", [False, True])
def test_first_blocks_are_kept_past_the_page_cache_or_when_their_buffer_is_reused_enough(store, direct):
    names = store.trajectory_names
    sizes = {n: len(STEPS) * store.tensors[n].numel for n in names}
    hold = sorted(sizes.values())[len(sizes) // 2]
    larger = [n for n in names if sizes[n] > hold]
    assert len(larger) >= KEEP_REUSE
    budget = PassBudget(chunk_elements=len(STEPS) * 256, hold_elements=hold)
    reader = store.reader(direct=direct)

    def partly(plan):
        return {t.name for t in plan.tensors if t.partly_held}

    # every larger trajectory: the one buffer is reused often enough, or the second read would be a disk read
    many = plan_pass(reader, names, grams=names, sums=names, budget=budget, in_kernel=False)
    assert partly(many) == set(larger) and many.hold_elements > 0
    assert {t.name for t in many.tensors if t.held} == {n for n in names if sizes[n] <= hold}  # whole: either way
    # one larger trajectory: from the page cache, its buffer would be new memory for one use, so it is read twice
    one = [n for n in names if sizes[n] <= hold] + larger[:1]
    few = plan_pass(reader, one, grams=one, sums=one, budget=budget, in_kernel=False)
    assert partly(few) == (set(larger[:1]) if direct else set())
    assert (few.hold_elements > 0) == direct and (few.allocate_hold() is not None) == direct
    assert {t.name for t in few.tensors if t.held} == {n for n in names if sizes[n] <= hold}
    # the budget decides when it says so
    for keep in (False, True):
        told = plan_pass(reader, names, grams=names, sums=names, budget=dataclasses.replace(budget, keep_partly=keep), in_kernel=False)
        assert partly(told) == (set(larger) if keep else set()) and (told.hold_elements > 0) == keep
    # and what the consumers are told is the same whether the first blocks are kept or read again
    w = np.linspace(-1, 1, len(STEPS))[None]
    results = []
    for keep in (False, True):
        recorder = Recorder(w)
        plan = plan_pass(reader, names, grams=names, sums=names, budget=dataclasses.replace(budget, keep_partly=keep), in_kernel=False)
        run_pass(reader, plan, [recorder], GRAM)
        results.append(recorder)
    for name in names:
        np.testing.assert_array_equal(results[0].grams[name], results[1].grams[name])
        torch.testing.assert_close(results[0].whole(name), results[1].whole(name), rtol=0, atol=0)


@pytest.mark.parametrize("in_kernel", [False, True])
def test_grams_and_sums_equal_a_float64_computation(store, in_kernel):
    reader = store.reader()
    names = store.trajectory_names
    rng = np.random.default_rng(0)
    first, second = Recorder(rng.normal(size=(2, len(STEPS)))), Recorder(rng.normal(size=(3, len(STEPS))))
    silent = Recorder(None)  # wants the Gram only
    budget = PassBudget(chunk_elements=len(STEPS) * 100, hold_elements=len(STEPS) * 1024)
    plan = plan_pass(reader, names, grams=names, sums=names, budget=budget, in_kernel=in_kernel)
    assert all(t.in_kernel == in_kernel for t in plan.tensors) and (plan.blocks() == []) == in_kernel
    run_pass(reader, plan, [first, silent, second], GRAM)
    assert first.order == names and not silent.parts
    for name in names:
        m = reader.read(name).double()
        np.testing.assert_allclose(first.grams[name], (m @ m.T).numpy(), rtol=1e-5, atol=1e-10)
        assert first.grams[name] is silent.grams[name]
        for recorder in (first, second):
            expected = torch.from_numpy(recorder.w) @ m
            torch.testing.assert_close(recorder.whole(name).double(), expected, rtol=1e-5, atol=1e-7)


def test_sums_without_a_gram_need_no_gram_arithmetic(store):
    reader = store.reader()
    names = store.trajectory_names[:3]
    w = np.linspace(-1, 1, len(STEPS))[None]
    recorder = Recorder(w)
    run_pass(reader, plan_pass(reader, names, sums=names, budget=PassBudget(chunk_elements=len(STEPS) * 64), in_kernel=False), [recorder])
    for name in names:
        torch.testing.assert_close(recorder.whole(name).double(), torch.from_numpy(w) @ reader.read(name).double(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="Gram arithmetic"):
        TrajectoryPass(reader, plan_pass(reader, names, grams=names, in_kernel=False))
    with pytest.raises(ValueError, match="reads by the CPU kernels"):
        TrajectoryPass(reader, plan_pass(reader, names, sums=names, in_kernel=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_same_pass_gives_the_same_results(store):
    reader = store.reader()
    names = store.trajectory_names
    w = np.random.default_rng(1).normal(size=(2, len(STEPS)))
    budget = PassBudget(chunk_elements=len(STEPS) * 100, hold_elements=len(STEPS) * 1024)
    results = {}
    for device in ("cpu", "cuda"):
        recorder = Recorder(w)
        plan = plan_pass(reader, names, grams=names, sums=names, budget=budget, device=torch.device(device))
        assert plan.pinned == (device == "cuda")
        run_pass(reader, plan, [recorder], GRAM)
        results[device] = recorder
    for name in names:
        np.testing.assert_allclose(results["cuda"].grams[name], results["cpu"].grams[name], rtol=1e-5, atol=1e-10)
        torch.testing.assert_close(results["cuda"].whole(name), results["cpu"].whole(name), rtol=1e-5, atol=1e-7)


def address(values: torch.Tensor) -> int:
    return values.untyped_storage().data_ptr()


def test_a_product_buffer_is_taken_again_only_when_every_holder_let_go():
    products = ProductBuffers(smallest=8, keep_bytes=4 * 1000)
    a = products.take(100)
    assert a.shape == (100,) and a.dtype == torch.float32 and products.held == 1
    products.hold(a[10:20].view(2, 5))  # a consumer keeps a view of it past its call
    products.release(a)  # the pass lets go after telling the consumers
    b = products.take(100)
    assert address(b) != address(a)  # still held by the consumer: new memory
    products.release(a[:5])  # the consumer is done
    assert products.held == 1  # b only
    c = products.take(60)
    assert address(c) == address(a) and c.numel() == 60  # a buffer of at most twice the values is reused
    products.release(c)
    d = products.take(40)
    assert address(d) != address(a)  # more than twice as large: not taken for so few values
    for values in (b, d):
        products.release(values)
    assert products.held == 0
    small = products.take(7)  # under `smallest`: left to the allocator, and holding it changes nothing
    products.hold(small)
    products.release(small)
    assert products.held == 0
    other = torch.ones(100)
    products.hold(other)  # a tensor that is no product (the base's values, a cast output): ignored
    products.release(other)
    assert products.held == 0


def test_free_product_buffers_stay_within_their_budget():
    products = ProductBuffers(smallest=1, keep_bytes=4 * 250)
    taken = [products.take(100) for _ in range(5)]
    for values in taken:
        products.release(values)
    assert sum(size for size, _ in products._free) <= 250  # the oldest free ones were let go
    again = products.take(100)
    assert address(again) in {address(t) for t in taken[-2:]}


def test_pooled_products_equal_new_ones_and_a_slow_consumer_keeps_its_values(store):
    """A consumer that hands every block's values to a slow thread, holding them until it has copied them: what that
    thread copies is what a pass with new memory per product gives, so no buffer was reused while held."""
    import queue
    import threading
    import time

    reader = store.reader()
    names = store.trajectory_names
    w = np.random.default_rng(2).normal(size=(2, len(STEPS)))
    budget = PassBudget(chunk_elements=len(STEPS) * 16, hold_elements=len(STEPS) * 64)
    fresh = Recorder(w)
    run_pass(reader, plan_pass(reader, names, grams=names, sums=names, budget=budget), [fresh], GRAM)

    products = ProductBuffers(smallest=1)
    handed: queue.Queue = queue.Queue()
    copied: dict[str, list[torch.Tensor]] = {}

    class HandsOver(Consumer):
        def weights(self, name, gram):
            return w

        def sums(self, name, rows, sums):
            products.hold(sums)
            handed.put((name, sums))

    def copier():
        while (item := handed.get()) is not None:
            time.sleep(0.002)  # slower than the pass: products wait while later ones are made
            name, sums = item
            copied.setdefault(name, []).append(sums.clone())
            products.release(sums)

    thread = threading.Thread(target=copier)
    thread.start()
    run_pass(reader, plan_pass(reader, names, grams=names, sums=names, budget=budget), [HandsOver()], GRAM, products=products)
    handed.put(None)
    thread.join()
    assert products.held == 0 and products._free  # every hold let go, and buffers were there to reuse
    for name in names:
        torch.testing.assert_close(torch.cat(copied[name], dim=1), fresh.whole(name), rtol=0, atol=0)


@pytest.mark.parametrize("use", ["gram", "sums"])
@pytest.mark.parametrize("cut", ["step", "base"])
def test_a_file_cut_short_while_the_kernels_read_it_is_named(store, use, cut):
    """A checkpoint (or θ₀'s file) cut short after the pass opened it: the kernels' read comes up short, and the pass
    fails in one line naming the file, whether the read was for a Gram or for sums."""
    reader = store.reader()
    names = store.trajectory_names
    plan = plan_pass(reader, names, grams=names if use == "gram" else (), sums=names if use == "sums" else (), in_kernel=True)
    assert all(t.in_kernel for t in plan.tensors)
    files = reader.tensor_files(names[0])
    which = 0 if cut == "step" else files.descriptors.size  # θ₀'s file comes after the steps' (one segment each)
    assert files.subtract.all() and files.base_descriptor >= 0  # a referenced run: every step is θ_s
    path = files.files[which].path
    os.truncate(path, int(files.offsets[0, 0] if cut == "step" else files.base_offset))
    with pytest.raises(RelexError, match="short read of tensor") as error:
        run_pass(reader, plan, [Recorder(np.ones((1, len(STEPS))))], GRAM)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_the_kernels_read_safetensors_files_through_the_page_cache_only(store):
    """Direct reads and a GPU go through the store's reader in blocks; safetensors files read through the page
    cache go to the kernels."""
    names = store.trajectory_names
    assert all(store.reader().tensor_files(n) is not None for n in names)
    assert all(store.reader(direct=True).tensor_files(n) is None for n in names)
    on_gpu = plan_pass(store.reader(), names, grams=names, budget=PassBudget(device_bytes=2**30), device=torch.device("cuda"))
    assert not any(t.in_kernel for t in on_gpu.tensors)


@pytest.mark.parametrize("kind", ["float32 referenced", "bf16 copied", "bf16 referenced", "fp16 copied", "fp16 referenced"])
def test_the_kernels_and_the_blocks_give_the_same_products(planted, store, tmp_path, kind):
    """bf16 and fp16 values (deltas stored in them, or such checkpoints and base referenced in place) are widened to
    float32 as the kernels read them; either way the Grams and sums equal the blocks' and a float64 computation."""
    dtype = parse_dtype(kind.split()[0])
    if kind.endswith("copied"):
        base, run, _ = planted
        assert cli("ingest", run, "--base", base, "--out", tmp_path / "halves", "--copy", "--delta-dtype", kind.split()[0]) == 0
        store = TrajectoryStore.open(tmp_path / "halves")
    elif dtype != torch.float32:
        base = make_base(tmp_path / "half-base", dtype=dtype)
        write_planted_run(base, tmp_path / "half-run", STEPS, noise=0.02)
        assert cli("ingest", tmp_path / "half-run", "--base", base, "--out", tmp_path / "half-store") == 0
        store = TrajectoryStore.open(tmp_path / "half-store")
    reader, names = store.reader(), store.trajectory_names
    files = reader.tensor_files(names[0])
    assert (files.dtypes == KERNEL_DTYPES[dtype]).all() and files.subtract.all() == kind.endswith("referenced")
    w = np.linspace(-1, 1, len(STEPS))[None]
    results = []
    for in_kernel in (False, True):
        recorder = Recorder(w)
        plan = plan_pass(reader, names, grams=names, sums=names, in_kernel=in_kernel)
        assert all(t.in_kernel == in_kernel for t in plan.tensors)
        run_pass(reader, plan, [recorder], GRAM)
        results.append(recorder)
    for name in names:
        m = reader.read(name).double()
        np.testing.assert_allclose(results[1].grams[name], results[0].grams[name], rtol=1e-6)
        np.testing.assert_allclose(results[1].grams[name], (m @ m.T).numpy(), rtol=1e-5, atol=1e-10)
        torch.testing.assert_close(results[1].whole(name), results[0].whole(name), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(results[1].whole(name).double(), torch.from_numpy(w) @ m, rtol=1e-5, atol=1e-7)


class AddsBase(Recorder):
    """A Recorder whose sums are θ₀ + W · M, as extrapolate's, with their checks."""

    adds_base = True

    def __init__(self, weights):
        super().__init__(weights)
        self.checks = {}

    def sums(self, name, rows, sums, checks):
        super().sums(name, rows, sums)
        self.checks.setdefault(name, []).append(checks.copy())


@pytest.mark.parametrize("kind", ["referenced", "copied", "copied, a float64 base"])
@pytest.mark.parametrize("in_kernel", [False, True])
def test_a_consumer_that_adds_base_gets_theta0_plus_its_sums_and_their_checks(planted, store, tmp_path, kind, in_kernel):
    """θ₀ + W · M for the consumer that asks for it, W · M for the one stacked beside it, the same whether the kernels
    add θ₀ as they read (θ₀ float32, bf16 or fp16 in a safetensors file), the pass adds it after them (a float64 θ₀) or
    the blocks are read by the store's reader; and the checks, Σ (W · M)² and Σ (θ₀ + W · M) per row, summed over
    the blocks, equal float64's."""
    if kind.startswith("copied"):
        base, run, _ = planted
        if kind.endswith("base"):
            base = make_base(tmp_path / "wide-base", dtype=torch.float64)
            run = tmp_path / "wide-run"
            write_planted_run(base, run, STEPS, noise=0.02)
        assert cli("ingest", run, "--base", base, "--out", tmp_path / "copied", "--copy", "--delta-dtype", "float32") == 0
        store = TrajectoryStore.open(tmp_path / "copied")
    reader, names = store.reader(), store.trajectory_names
    files = reader.tensor_files(names[0])
    assert (files.base_descriptor >= 0) == (kind != "copied, a float64 base")
    rng = np.random.default_rng(3)
    adds, plain = AddsBase(rng.normal(size=(2, len(STEPS)))), Recorder(rng.normal(size=(1, len(STEPS))))
    budget = PassBudget(chunk_elements=len(STEPS) * 100, hold_elements=0)  # several blocks per tensor
    plan = plan_pass(reader, names, grams=names, sums=names, budget=budget, in_kernel=in_kernel)
    assert all(t.in_kernel == in_kernel for t in plan.tensors) and any(len(t.rows) > 1 for t in plan.tensors)
    run_pass(reader, plan, [plain, adds], GRAM)
    theta = CheckpointReader(store.base_dir)
    for name in names:
        m = reader.read(name).double()
        update = torch.from_numpy(adds.w) @ m
        exact = update + theta.read(name).double().reshape(1, -1)
        torch.testing.assert_close(adds.whole(name).double(), exact, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plain.whole(name).double(), torch.from_numpy(plain.w) @ m, rtol=1e-5, atol=1e-7)
        checks = sum(adds.checks[name])
        np.testing.assert_allclose(checks[:, 0], (update**2).sum(dim=1).numpy(), rtol=1e-5)
        np.testing.assert_allclose(checks[:, 1], exact.sum(dim=1).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("in_kernel", [False, True])
def test_a_nan_read_makes_the_checks_non_finite_and_the_pass_names_its_step(planted, store, in_kernel):
    """With no Gram to catch it (as with a saved fit), a NaN read makes θ₀ + W · M and its checks non-finite, and
    the pass names the step that holds it, in one line."""
    _, run, _ = planted
    name = "model.layers.1.self_attn.v_proj.weight"
    edit(run / "checkpoint-13", lambda t: t[name].__setitem__((3, 4), math.nan))
    reader = store.reader()
    plan = plan_pass(reader, [name], sums=[name], in_kernel=in_kernel)
    with pytest.raises(RelexError, match="NaN or Inf at step 13") as error:
        run_pass(reader, plan, [AddsBase(np.ones((1, len(STEPS))))], GRAM)
    assert name in str(error.value) and "\n" not in str(error.value)


def test_a_pass_has_glibc_map_its_large_blocks(store, monkeypatch):
    """Every pass fixes glibc's mmap threshold (`map_large_blocks`), so that blocks of changing sizes are given back
    to the system when freed instead of fragmenting the heap (peak RSS of `--io direct` on the SmolLM2 run: 1.28-1.59
    GiB without, 0.95-1.00 GiB with). Where the C library is glibc, the setting takes."""
    import platform

    from relex.fit import passes

    calls = []
    monkeypatch.setattr(passes, "map_large_blocks", lambda: calls.append(1) or True)
    reader, names = store.reader(), store.trajectory_names
    run_pass(reader, plan_pass(reader, names, grams=names), [Recorder(None)], GRAM)
    assert calls
    monkeypatch.undo()
    if platform.libc_ver()[0] == "glibc":
        assert passes.map_large_blocks() is True


class Logs(Recorder):
    """A Recorder that logs every call it gets, in order."""

    def __init__(self, weights):
        super().__init__(weights)
        self.log = []

    def gram(self, name, gram):
        self.log.append(("gram", name))
        super().gram(name, gram)

    def weights(self, name, gram):
        self.log.append(("weights", name))
        return super().weights(name, gram)

    def sums(self, name, rows, sums):
        self.log.append(("sums", name))
        super().sums(name, rows, sums)

    def done(self, name):
        self.log.append(("done", name))


def test_the_kernels_form_one_tensors_sums_while_the_consumers_take_the_last_ones(store):
    """A tensor the kernels read is taken one ahead: its Gram and weights come before the sums of the tensor before
    it, so its W · M is formed meanwhile. Each kind of call still comes in plan order, a tensor's sums between its
    weights and its `done`, and the values are those of the pass read in blocks."""
    reader, names = store.reader(), store.trajectory_names
    w = np.random.default_rng(3).normal(size=(2, len(STEPS)))
    ahead, blocks = Logs(w), Recorder(w)
    run_pass(reader, plan_pass(reader, names, grams=names, sums=names, in_kernel=True), [ahead], GRAM)
    run_pass(reader, plan_pass(reader, names, grams=names, sums=names, in_kernel=False), [blocks], GRAM)
    for kind in ("gram", "weights", "done"):
        assert [n for k, n in ahead.log if k == kind] == names
    where = {(kind, name): i for i, (kind, name) in reversed(list(enumerate(ahead.log)))}  # first call of each kind
    for before, after in zip(names, names[1:]):
        assert where["weights", after] < where["sums", before]  # the next tensor's W · M was queued first
        assert where["done", before] < where["sums", after]
    for name in names:
        assert where["weights", name] < where["sums", name] < where["done", name]
        np.testing.assert_allclose(ahead.grams[name], blocks.grams[name], rtol=1e-6)
        torch.testing.assert_close(ahead.whole(name), blocks.whole(name), rtol=1e-5, atol=1e-6)


def test_an_error_one_tensor_ahead_gives_back_the_queued_products_and_stops_the_kernels(planted, store):
    """A NaN in a tensor's Gram, found while the sums of the tensor before it are queued and not yet told: the pass
    fails in one line naming it, the queued tensor's products are given back, and no kernel thread is left."""
    import threading

    _, run, _ = planted
    names = store.trajectory_names
    bad = names[2]
    edit(run / "checkpoint-13", lambda t: t[bad].view(-1).__setitem__(0, math.nan))
    reader = store.reader()
    products = ProductBuffers(smallest=1)
    consumer = Logs(np.ones((1, len(STEPS))))
    with pytest.raises(RelexError, match="NaN or Inf at step 13") as error:
        run_pass(reader, plan_pass(reader, names, grams=names, sums=names, in_kernel=True), [consumer], GRAM, products=products)
    assert bad in str(error.value) and "\n" not in str(error.value)
    assert ("weights", names[1]) in consumer.log and ("sums", names[1]) not in consumer.log  # queued, not told
    assert products.held == 0
    assert not any(t.name == "relex-kernel" for t in threading.enumerate())


def test_a_large_enough_tensor_is_summed_in_a_block_per_kernel_thread(store, monkeypatch):
    """Each kernel thread forms one block of a tensor's W · M at once, so a tensor is planned in at least as many
    blocks as there are threads, unless they would be under KERNEL_BLOCK_MIN values; `chunk_elements` still caps them."""
    from relex.fit import passes

    reader, names = store.reader(), store.trajectory_names
    monkeypatch.setattr(passes, "KERNEL_BLOCK_MIN", 1)
    for threads in (1, 2, 3):
        monkeypatch.setattr(passes, "kernel_threads", lambda threads=threads: threads)
        plan = plan_pass(reader, names, grams=names, sums=names, in_kernel=True)
        for reads in plan.tensors:
            shape = reader.infos[reads.name].shape
            assert len(reads.rows) >= min(threads, shape[0] if shape else 1)
    monkeypatch.setattr(passes, "KERNEL_BLOCK_MIN", 2**40)
    plan = plan_pass(reader, names, grams=names, sums=names, in_kernel=True)
    assert all(len(t.rows) == 1 for t in plan.tensors)
    capped = plan_pass(reader, names, grams=names, sums=names, budget=PassBudget(chunk_elements=len(STEPS) * 64), in_kernel=True)
    for reads in capped.tensors:  # at most 64 values a step, or one row where a row is longer
        row = reader.block_numel(reads.name, (0, 1))
        assert all(reader.block_numel(reads.name, r) <= max(64, row) for r in reads.rows)
