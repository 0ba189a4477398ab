"""Benchmark: fit + extrapolate against one plain read of the stored trajectory.

Builds (once, in --workdir) a trajectory store with the tensor shapes of a real model (SmolLM2-135M by default;
`--shape qwen2.5-1.5b` for a 1.5B-parameter one) and T recorded steps of float32 deltas, then measures, each
phase in its own process so that peak RSS is that phase's own:
  1. read: every stored value read once through the store's reader (the I/O floor of any method);
  2. fit + extrapolate: `relex extrapolate` without a saved fit (Gram pass + weighted sum) to two targets.
Both are measured three ways: from storage with direct I/O (`--io direct`, what a trajectory larger than RAM
gets by default), from storage through the page cache (`--io cached` after dropping the store's pages), and
from the page cache (values already in RAM, where the floor is a memory copy and the Gram's arithmetic shows).
Each is repeated; medians, every run, their ratio, CPU time and peak RSS are printed, and whether each mode
meets the goal on SmolLM2 shapes, T = 20: ratio ≤ 2.0 and peak RSS under 3 GiB while the trajectory is ~11 GB.

`--layout verl` measures what a user with a finished run does instead (issue 14): the run is written as float32
checkpoints (or `--dtype bf16` or `fp16` ones, with a base in the same dtype) in verl's layout
(`global_step_N/actor/huggingface/`, relex.synthetic), and
  1. read: every byte of the run's checkpoint files and the base read once (the floor: what `cat` does);
  2. `relex ingest` (referenced in place: names, shapes, dtypes and headers), and for comparison `relex ingest
     --verify` (every value scanned for NaN/Inf) and `relex ingest --copy` (float32 deltas written into a store);
  3. fit + extrapolate: `relex extrapolate` to two targets on that store (Gram pass + weighted sum), that pass
     reduced to its products (below) read by the kernels and read in blocks by the store's reader, and the same
     on a store of copied float32 deltas of the same run (`relex ingest --copy`, made once, untimed), against a
     read of that store's files; with the command's default I/O (`--io auto`, printed: here reads through the
     page cache, checkpoints written direct); and that pass reduced to its reads, each tensor's Gram and a W · M
     with fixed weights (`phase_products`: no fit, no θ₀ added, nothing written), what every fitted method computes,
     as planned (float32 files read by the kernels themselves) and read in blocks by the store's reader.
The phases time the work inside their process. So that what a user waits for shows too, `relex ingest` and
`relex extrapolate` are also run as typed, from the page cache, each process timed from its start to its exit.
All of them from the page cache: the run's phases after an untimed read of the run, the copied store's after one of
that store, the other's pages dropped first (the two do not fit in a 24 GiB machine's page cache together). Then
1, `relex ingest` and 3 on the referenced store again from storage, the run's and the base's pages dropped before
each phase, and 3 once more with `--io direct` (O_DIRECT reads, what `--io auto` picks for a store larger than the
memory available), each with the bytes of the run's files it read per second. The ratios (ingest + fit +
extrapolate) / read, both ways, referenced / copied extrapolation, copied extrapolation / read and the products
alone / read are formed from medians of the same run. Last, the check (`phase_check`): the checkpoints of the two
last extrapolations (from storage: through the page cache, read by the kernels, and with direct reads, read in
blocks) against RELEX in float64 from the checkpoint files, untimed.

Peak RSS is each phase's own: VmHWM of the phase's process, read by itself at its end. ru_maxrss (RUSAGE_SELF in
the child, or os.wait4 on it) is not: Linux carries the forking parent's RSS over into it at exec.

    .venv/bin/python scripts/bench_fit.py --workdir /tmp/relex-bench [--steps 20] [--device cpu|cuda] [--repeats 3]
    .venv/bin/python scripts/bench_fit.py --layout verl --workdir /tmp/relex-bench-verl --steps 6
    .venv/bin/python scripts/bench_fit.py --layout verl --dtype fp16 --workdir /tmp/relex-bench-fp16 --steps 20
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

GOAL_RATIO, GOAL_RSS_GIB = 2.0, 3.0  # the goal for SmolLM2 shapes, T = 20
SHAPES = {  # LlamaConfig fields of real models
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # checks the script itself
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


DTYPES = ("float32", "bf16", "fp16")  # what `--dtype` may name (the verl layout's checkpoints and base)


def write_base(workdir: Path, shape: str, dtype: str = "float32"):
    """A fresh `workdir` holding `base/`, random weights of the shape's model in `dtype` (DTYPES); (name -> shape,
    generator)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from relex.io.dtypes import parse_dtype

    shutil.rmtree(workdir, ignore_errors=True)
    base = workdir / "base"
    base.mkdir(parents=True)
    config = LlamaConfig(**SHAPES[shape])
    config.architectures = ["LlamaForCausalLM"]  # as a trained checkpoint's config.json states it
    config.save_pretrained(base)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    kind = parse_dtype(dtype)
    save_file({n: (torch.randn(s, generator=gen) * 0.02).to(kind) for n, s in names.items()}, str(base / "model.safetensors"),
              metadata={"format": "pt"})
    return names, gen


def build_verl_run(workdir: Path, shape: str, steps: int, dtype: str = "float32") -> Path:
    """(once) `workdir/run-…`: checkpoints in `dtype` (and a base in it) at steps 2, 4, ..., 2T in verl's layout, a
    planted rank-1 path."""
    from relex.synthetic import step_folder, write_planted_run

    run = workdir / f"run-{shape}-T{steps}{_suffix(dtype)}"
    numbers = [2 * (i + 1) for i in range(steps)]
    if all((step_folder(run, s, "verl") / "model.safetensors").is_file() for s in numbers):
        return run
    write_base(workdir, shape, dtype)
    write_planted_run(workdir / "base", run, numbers, layout="verl")
    return run


def _suffix(dtype: str) -> str:
    """What a run or store of `dtype` adds to its folder's name (nothing for float32, the first kind built)."""
    return "" if dtype == "float32" else f"-{dtype}"


def build(workdir: Path, shape: str, steps: int) -> Path:
    import torch

    from relex.io.checkpoint import CheckpointReader
    from relex.store import TrajectoryStore

    store_dir = workdir / f"store-{shape}-T{steps}"
    if (store_dir / "manifest.json").is_file() and len(TrajectoryStore.open(store_dir).steps) == steps:
        return store_dir
    base = workdir / "base"
    names, gen = write_base(workdir, shape)
    store = TrajectoryStore.create(store_dir, base_dir=base, tensors=CheckpointReader(base).infos(), created_by={"command": "bench_fit"})
    directions = {}
    for step in range(1, steps + 1):
        def delta(name, step=step):
            if name not in directions:
                directions[name] = torch.randn(names[name], generator=gen) * 1e-4
            noise = torch.randn(names[name], generator=gen) * 1e-5
            return directions[name] * (0.5 * step + 1) + noise

        store.append_deltas(step * 2, delta)
        print(f"built step {step * 2}", file=sys.stderr)
    return store_dir


def phase_read(store_dir: str, io: str) -> dict:
    from relex.fit.fit import DEFAULT_CHUNK_ELEMENTS
    from relex.store import Block, TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    reader = store.reader(direct=store.reads_direct(io))
    started, values = time.perf_counter(), 0
    plan = [Block(name, rows) for name in store.trajectory_names for rows in reader.row_blocks(name, DEFAULT_CHUNK_ELEMENTS)]
    for _, matrix, _ in reader.stream(plan):
        values += matrix.numel()
    return {"seconds": time.perf_counter() - started, "values": values}


def phase_extrapolate(store_dir: str, out: str, device: str, io: str) -> dict:
    from relex.extrapolate import ExtrapolateConfig, extrapolate_store
    from relex.fit import FitConfig
    from relex.io.stream_writer import writes_direct
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    last = store.steps[-1]
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's output: removing it is not part of the work (as in run_commands)
    started = time.perf_counter()
    extrapolate_store(store, out, ExtrapolateConfig(targets=[2 * last, 5 * last], fit=FitConfig(device=device, io=io), overwrite=True))
    seconds = time.perf_counter() - started
    how = {True: "direct (O_DIRECT)", False: "through the page cache"}
    return {"seconds": seconds, "io": f"--io {io}: reads {how[store.reads_direct(io)]}, checkpoints written {how[writes_direct(io)]}"}


def phase_products(store_dir: str, device: str, io: str, reads: str = "planned") -> dict:
    """The pass of `relex extrapolate` reduced to what it must compute from every stored value: the same planned
    reads (relex.fit.passes, the command's block and hold sizes), each tensor's Gram and a product W · M with two
    rows of weights, and nothing else: the weights are fixed instead of fitted, θ₀ is not added (on checkpoints
    referenced in place it is still read, to be subtracted), nothing is written. What the command takes beyond it
    is the fit, θ₀ + W · M and the writing; its ratio to a read bounds the ratio the whole command can reach with
    these reads and kernels. `reads`: "planned" as the command plans
    them (float32 files through the page cache: by the kernels themselves), or "blocks" (every tensor read in blocks
    by the store's reader, as before stop 35), to compare the two in one run."""
    import numpy as np

    from relex.extrapolate.extrapolate import DEFAULT_CACHE_ELEMENTS
    from relex.fit.gram import GRAM, resolve_device
    from relex.fit.passes import DEFAULT_CHUNK_ELEMENTS, Consumer, PassBudget, ProductBuffers, plan_pass, run_pass
    from relex.store import TrajectoryStore

    store = TrajectoryStore.open(store_dir)
    started = time.perf_counter()
    reader = store.reader(direct=store.reads_direct(io))
    names = list(store.trajectory_names)
    weights = np.full((2, len(reader.steps)), 1 / len(reader.steps), dtype=np.float32)

    class TwoTargets(Consumer):
        values = 0

        def weights(self, name: str, gram) -> np.ndarray:
            return weights

        def sums(self, name: str, rows, sums) -> None:
            self.values += len(reader.steps) * sums.shape[1]  # the values this product was formed from

    budget = PassBudget(DEFAULT_CHUNK_ELEMENTS, DEFAULT_CACHE_ELEMENTS)
    plan = plan_pass(reader, names, grams=names, sums=names, budget=budget, device=resolve_device(device),
                     in_kernel=None if reads == "planned" else False)
    consumer = TwoTargets()
    run_pass(reader, plan, [consumer], GRAM, products=ProductBuffers())
    return {"seconds": time.perf_counter() - started, "values": consumer.values}


READ_BUFFER = 256 << 10  # the plain read's buffer (`phase_read_files`)


def phase_read_files(*folders: str) -> dict:
    """Every byte of the safetensors files under `folders` read once into one reused buffer (what `cat` does).

    The buffer is page-aligned (an anonymous memory map), as relex's own read buffers are (torch aligns them to 64
    bytes). A `bytearray`'s data start 16 bytes past an alignment, and the kernel copies into such a destination
    several times slower on some CPUs: on the development machine on 2026-12-01 (AMD EPYC, Zen 3), 10.76 GB took
    4.3-4.7 s into a bytearray and 1.0-1.1 s into the same memory 64-byte aligned (`cat`: 1.05 s), which made
    this floor, and so every ratio to it, look 4x better than it is.

    It is READ_BUFFER bytes, small enough to stay in a core's L2 as `cat`'s 128 KiB does. Up to run 27 it was 16
    MiB, which was as fast as `cat` on the AMD machines but not on the Intel Xeon of 2026-12-02: the copied store
    (10.76 GB) took 2.78-3.33 s into 16 MiB, 1.82-2.18 s into 256 KiB, and `cat` 2.03 s, a floor 1.5x too slow.
    """
    buffer, total = mmap.mmap(-1, READ_BUFFER), 0
    started = time.perf_counter()
    for path in sorted(p for folder in folders for p in Path(folder).rglob("*.safetensors")):
        with open(path, "rb", buffering=0) as file:
            while n := file.readinto(buffer):
                total += n
    return {"seconds": time.perf_counter() - started, "bytes": total}


def phase_check(run: str, base: str, out: str, *targets: str) -> dict:
    """The checkpoints `relex extrapolate` wrote to `out`, against RELEX computed in float64 from the run's
    checkpoint files and the base by other code: safetensors' own loader, a float64 Gram M Mᵀ and its top
    eigenvector, a least-squares line through the coefficients (the defaults: rank 1, linear, every step).

    Per target, over the tensors: the largest ‖out − round(θ₀ + Δ̂)‖ / ‖Δ̂‖, where Δ̂ is the float64 prediction and
    round() writes it in the output's dtype (float32 here), so the error is relex's own, not the output format's;
    and that format's own loss, the largest ‖round(θ₀ + Δ̂) − (θ₀ + Δ̂)‖ / ‖Δ̂‖. The benchmark's planted deltas are
    small against θ₀ (on the tiny shape a float32 output alone loses 2.4e-4 of Δ̂ at step 16)."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from relex.ingest import discover_checkpoints

    def tensors(folder: Path) -> dict[str, Path]:
        files = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                files.update(dict.fromkeys(f.keys(), path))
        return files

    def load(files: dict[str, Path], name: str) -> torch.Tensor:
        with safe_open(str(files[name]), "pt") as f:
            return f.get_tensor(name).reshape(-1)

    found = discover_checkpoints([run])  # the step folders only; their values are read by safetensors below
    steps, checkpoints = np.asarray([c.step for c in found], float), [tensors(c.folder) for c in found]
    base_files, outputs = tensors(Path(base)), [tensors(Path(out) / f"step-{t}") for t in targets]
    worst, floor = dict.fromkeys(targets, 0.0), dict.fromkeys(targets, 0.0)
    piece = 1 << 22  # columns converted to float64 at a time

    def deltas(theta0: torch.Tensor, rows: list[torch.Tensor]):
        """(θ₀, M) in float64, one piece of columns at a time."""
        for start in range(0, theta0.numel(), piece):
            t0 = theta0[start:start + piece].double()
            yield start, t0, torch.stack([r[start:start + piece] for r in rows]).double() - t0

    for name in base_files:
        theta0 = load(base_files, name)
        rows = [load(files, name) for files in checkpoints]  # float32, memory-mapped
        gram = sum(m @ m.T for _, _, m in deltas(theta0, rows))
        values, vectors = torch.linalg.eigh(gram)
        u, sigma = vectors[:, -1], float(values[-1]) ** 0.5
        if sigma == 0:
            continue  # a frozen tensor: its output is θ₀, which the tests check
        line = np.polyfit(steps, (u * sigma).numpy(), 1)
        # Δ̂ = Σ_s w_s δ_s for every target at once: one row of weights per target
        weights = torch.stack([u * (float(np.polyval(line, float(t))) / sigma) for t in targets])
        written = [load(files, name) for files in outputs]
        error_sq, floor_sq, delta_sq = (np.zeros(len(targets)) for _ in range(3))
        for start, t0, m in deltas(theta0, rows):
            for i, predicted in enumerate(weights @ m):
                exact = t0 + predicted
                rounded = exact.to(written[i].dtype).double()
                error_sq[i] += float((written[i][start:start + piece].double() - rounded).square().sum())
                floor_sq[i] += float((rounded - exact).square().sum())
                delta_sq[i] += float(predicted.square().sum())
        for i, target in enumerate(targets):
            worst[target] = max(worst[target], float(error_sq[i] / delta_sq[i]) ** 0.5)
            floor[target] = max(floor[target], float(floor_sq[i] / delta_sq[i]) ** 0.5)
    return {"tensors": len(base_files), "worst": worst, "format": floor}


def phase_ingest(run: str, base: str, store: str, mode: str) -> dict:
    """`mode`: headers (referenced in place), verify (every value scanned) or copy (deltas written into the store)."""
    from relex.ingest import ingest

    started = time.perf_counter()
    ingest([run], base, store, overwrite=True, verify=mode == "verify", copy=mode == "copy")
    return {"seconds": time.perf_counter() - started}


# what each phase's command imports before it starts (a plain read of the files imports nothing)
PHASE_MODULES = {"read": ("relex.fit", "relex.store"), "extrapolate": ("relex.extrapolate", "relex.fit", "relex.store"),
                 "products": ("relex.extrapolate", "relex.fit", "relex.store"), "ingest": ("relex.ingest",)}
PHASES = {"read": phase_read, "extrapolate": phase_extrapolate, "products": phase_products, "read-files": phase_read_files,
          "ingest": phase_ingest, "check": phase_check}


def peak_rss_gib() -> float:
    """This process's own peak RSS: VmHWM of its address space (ru_maxrss includes the parent's RSS at fork)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 2**20
    except (OSError, StopIteration):  # not Linux: ru_maxrss, an upper bound
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_commands(run: Path, base: Path, store: Path, out: Path, targets: str, device: str) -> dict:
    """`relex ingest` then `relex extrapolate` as a user types them, each process timed from its start to its exit,
    so with what the phases leave out: Python's start, the imports and the exit."""
    relex = [sys.executable, "-m", "relex"]
    commands = {
        "ingest": [*relex, "ingest", str(run), "--base", str(base), "--out", str(store), "--overwrite"],
        "extrapolate": [*relex, "extrapolate", str(store), "--targets", targets, "--out", str(out), "--device", device],
    }
    shutil.rmtree(out, ignore_errors=True)  # removing an earlier output is not part of the work
    seconds = {}
    for name, command in commands.items():
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds[name] = time.perf_counter() - started
        if done.returncode:
            raise SystemExit(f"{' '.join(command)}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    return seconds


def run_phase(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def evict(*folders: Path) -> None:
    """Drop the files' pages from the OS page cache, so that the next read comes from storage."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/relex-bench")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each phase; medians are reported")
    parser.add_argument("--layout", default="store", choices=["store", "verl"],
                        help="store: copied float32 deltas (default); verl: a run of checkpoints, ingested in place")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="verl layout: the dtype of the run's checkpoints and its base (the issue's run: float32)")
    parser.add_argument("--phase", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print_phase(*args.phase)
    elif args.layout == "verl":
        bench_verl(args)
    else:
        bench_store(args)


def print_phase(kind: str, *rest: str) -> None:
    """One phase in this process (a child of the benchmark), its result as one JSON line; run as the CLI runs a
    command: relex imported with the garbage collector off, then frozen (relex.cli.collector_for_one_command)."""
    import importlib

    from relex.cli import collector_for_one_command

    with collector_for_one_command() as imported:
        for module in PHASE_MODULES.get(kind, ()):
            importlib.import_module(module)
        imported()
        result = PHASES[kind](*rest)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result.update(peak_rss_gib=peak_rss_gib(), user_s=usage.ru_utime, sys_s=usage.ru_stime)
    print(json.dumps(result))


def bench_store(args) -> None:
    """Read against fit + extrapolate on a store of copied deltas, three ways of reading (see the docstring)."""
    workdir = Path(args.workdir)
    store_dir = build(workdir, args.shape, args.steps)
    base_dir, out_dir = workdir / "base", workdir / "out"
    size = sum(f.stat().st_size for f in (store_dir / "deltas").iterdir())
    # (how the store is read, whether the page cache is dropped first)
    modes = {
        "from storage, through the page cache (--io cached, page cache dropped first)": ("cached", True),
        "from the page cache (--io cached, data already in RAM)": ("cached", False),
        "from storage, direct I/O (--io direct: O_DIRECT, page cache bypassed)": ("direct", True),
    }
    if not hasattr(os, "posix_fadvise"):
        modes = {label: mode for label, mode in modes.items() if not mode[1]}
    runs: dict[tuple[str, str], list[dict]] = {(label, k): [] for label in modes for k in ("read", "extrapolate")}
    for _ in range(args.repeats):
        for label, (io, drop) in modes.items():
            if drop and io == "cached":
                # a virtual machine's disk may be cached by its host, invisibly: one untimed read first puts that
                # cache in the same state for both timed phases
                run_phase("read", str(store_dir), io)
            for kind in ("read", "extrapolate"):
                shutil.rmtree(out_dir, ignore_errors=True)  # removing an earlier output is not part of the work
                if drop:
                    evict(store_dir, base_dir)
                phase = ("read", str(store_dir), io) if kind == "read" else ("extrapolate", str(store_dir), str(out_dir), args.device, io)
                runs[label, kind].append(run_phase(*phase))
    first = runs[next(iter(modes)), "read"][0]
    print(f"trajectory: {args.shape} shapes, T={args.steps} steps, {first['values'] / 1e9:.2f} G values, "
          f"{size / 1e9:.2f} GB on disk; device {args.device}; median of {args.repeats} runs each")
    for label in modes:
        print_mode(label, {k: runs[label, k] for k in ("read", "extrapolate")})
    if not hasattr(os, "posix_fadvise"):
        print("\nthis OS has no posix_fadvise: the page cache could not be dropped, so only warm reads were measured")


def print_mode(label: str, runs: dict[str, list[dict]]) -> None:
    """The medians, CPU times and peak RSS of one way of reading, and their ratio against the goal."""
    read, fit = (sorted(r["seconds"] for r in runs[k]) for k in ("read", "extrapolate"))
    read_median, fit_median = median(read), median(fit)
    rss = {k: max(r["peak_rss_gib"] for r in runs[k]) for k in runs}
    cpu = {k: "user {:.1f} + sys {:.1f} s".format(*(median(r[c] for r in runs[k]) for c in ("user_s", "sys_s"))) for k in runs}
    ratio = fit_median / read_median
    met = ratio <= GOAL_RATIO and max(rss.values()) < GOAL_RSS_GIB
    print(f"\nreads {label}")
    print(f"  read every stored value once:      {read_median:7.2f} s   peak RSS {rss['read']:.2f} GiB  "
          f"CPU {cpu['read']}  (runs: {_runs(read)})")
    print(f"  fit + extrapolate to two targets:  {fit_median:7.2f} s   peak RSS {rss['extrapolate']:.2f} GiB  "
          f"CPU {cpu['extrapolate']}  (runs: {_runs(fit)})")
    print(f"  ratio (fit + extrapolate) / read:  {ratio:7.2f}   goal (ratio <= {GOAL_RATIO}, "
          f"peak RSS < {GOAL_RSS_GIB} GiB): {'met' if met else 'not met'}")


def bench_verl(args) -> None:
    """Ingest + fit + extrapolate on a verl-layout run against one read of its files, from the page cache and from
    storage (the run's and the base's pages dropped before each phase)."""
    workdir = Path(args.workdir)
    run = build_verl_run(workdir, args.shape, args.steps, args.dtype)
    base, store, out = workdir / "base", workdir / "store", workdir / "out"
    out_direct = workdir / "out-direct"  # the checkpoints of the pass with direct reads, checked beside `out`'s
    copied = workdir / f"store-copied-{args.shape}-T{args.steps}{_suffix(args.dtype)}"
    copy_timed = workdir / "store-copy-timed"  # removed after each run of its phase
    if not (copied / "manifest.json").is_file():
        run_phase("ingest", str(run), str(base), str(copied), "copy")
    size = sum(p.stat().st_size for folder in (run, base) for p in folder.rglob("*.safetensors"))
    read = ("read-files", str(run), str(base))
    ingest = ("ingest", str(run), str(base), str(store), "headers")
    extrapolate = ("extrapolate", str(store), str(out), args.device, "auto")  # as a user runs it
    in_ram = {
        "read every byte of the run and the base once": read,
        "relex ingest (headers: names, shapes, dtypes, sizes)": ingest,
        "relex ingest --verify (every value scanned)": ("ingest", str(run), str(base), str(store), "verify"),
        "relex ingest --copy (float32 deltas written)": ("ingest", str(run), str(base), str(copy_timed), "copy"),
        "fit + extrapolate to two targets": extrapolate,
        "referenced: its reads, Gram and W · M alone (kernels)": ("products", str(store), args.device, "auto"),
        "referenced: the same, read in blocks by the reader": ("products", str(store), args.device, "auto", "blocks"),
        "fit + extrapolate, store of copied float32 deltas": ("extrapolate", str(copied), str(out), args.device, "auto"),
        "its reads, Gram and W · M alone (no fit, θ₀ or outputs)": ("products", str(copied), args.device, "auto"),
        "the same, read in blocks by the store's reader": ("products", str(copied), args.device, "auto", "blocks"),
        "read every byte of the copied store once": ("read-files", str(copied)),
    }
    from_storage = {"read every byte of the run and the base once": read, "relex ingest (headers: names, shapes, dtypes, sizes)": ingest,
                    "fit + extrapolate to two targets": extrapolate,
                    # what --io auto picks for a store larger than the memory available
                    "fit + extrapolate, reads direct (--io direct)": ("extrapolate", str(store), str(out_direct), args.device, "direct")}
    storage = hasattr(os, "posix_fadvise")
    runs = {("ram", label): [] for label in in_ram} | ({("storage", label): [] for label in from_storage} if storage else {})
    on_copied = [label for label, phase in in_ram.items() if str(copied) in phase]
    resident, resident_copied, kept = None, None, []  # kept: the run's bytes still cached after its phases
    copied_size = sum(p.stat().st_size for p in copied.rglob("*.safetensors"))
    from relex.ingest import discover_checkpoints

    last = discover_checkpoints([run])[-1].step
    commands = []  # `relex ingest` and `relex extrapolate` as a user runs them, each whole process timed
    for _ in range(args.repeats):
        # the run and the copied store do not fit in the page cache together on a 24 GiB machine (11.3 + 10.8 GB at
        # T = 20): the run's phases are timed after a read of the run, the copied store's after a read of that. The
        # other one's pages are dropped first: read in earlier phases, they are what the kernel keeps, and it
        # evicted the run's fresh pages instead (run 23: the referenced pass took 5.31, 8.44 and 11.09 s)
        evict(copied)
        run_phase(*read)  # untimed: puts the files in the page cache
        resident = _resident_bytes(run, base)
        for label, phase in in_ram.items():
            if label == on_copied[0]:
                commands.append(run_commands(run, base, store, out, f"{2 * last},{5 * last}", args.device))
                kept.append(_resident_bytes(run, base))
                evict(run)  # the base stays: a pass on the copied store reads θ₀ from it
                run_phase("read-files", str(copied))
                resident_copied = _resident_bytes(copied)
            shutil.rmtree(out, ignore_errors=True)  # removing an earlier output is not part of the work
            runs["ram", label].append(run_phase(*phase))
            shutil.rmtree(copy_timed, ignore_errors=True)
        if storage:
            # a virtual machine's disk may be cached by its host, invisibly: the untimed read above put that cache
            # in the same state for every phase below
            for label, phase in from_storage.items():
                if phase[0] == "extrapolate":
                    shutil.rmtree(phase[2], ignore_errors=True)
                evict(run, base)
                runs["storage", label].append(run_phase(*phase))
    print(f"run: verl layout, {args.shape} shapes, T={args.steps} {args.dtype} checkpoints + base, {size / 1e9:.2f} GB; "
          f"{'unknown' if resident is None else f'{resident / size:.0%}'} of it in the page cache after the warm-up read "
          f"({'unknown' if None in kept else f'{min(kept) / size:.0%}'} after the phases on it, the least of the runs) "
          f"(the copied store, {copied_size / 1e9:.2f} GB: {'unknown' if resident_copied is None else f'{resident_copied / copied_size:.0%}'}); "
          f"device {args.device}; median of {args.repeats} runs each, each phase in its own process")
    print(f"relex extrapolate with {runs['ram', 'fit + extrapolate to two targets'][0]['io']}")
    medians = {}
    for (where, label), results in runs.items():
        if (where, label) == ("storage", next(iter(from_storage))):
            print("from storage (the run's and the base's pages dropped before each phase):")
        elif (where, label) == ("ram", next(iter(in_ram))):
            print("from the page cache:")
        seconds = sorted(r["seconds"] for r in results)
        medians[where, label] = median(seconds)
        cpu = "user {:.1f} + sys {:.1f} s".format(*(median(r[c] for r in results) for c in ("user_s", "sys_s")))
        rss = max(r["peak_rss_gib"] for r in results)
        print(f"  {label:<55} {medians[where, label]:7.2f} s   peak RSS {rss:.2f} GiB  CPU {cpu}  (runs: {_runs(seconds)})")
        if where == "storage" and (label == next(iter(from_storage)) or label.startswith("fit")):
            print(f"  {'':<55} {size / medians[where, label] / 1e9:7.2f} GB/s of the run's files")
    print("ratios:")
    for where in ("ram", "storage") if storage else ("ram",):
        read_s, ingest_s, fit_s = (medians[where, label] for label in list(from_storage)[:3])
        print(f"  (ingest + fit + extrapolate) / read, {'from the page cache' if where == 'ram' else 'from storage':<19} "
              f"{(ingest_s + fit_s) / read_s:7.2f}   (goal <= 4)")
    (read_s, ingest_s, verify_s, copy_s, fit_s, referenced_products_s, referenced_blocks_s, copied_s, products_s, blocks_s,
     read_copied_s) = (medians["ram", label] for label in in_ram)
    print(f"  (ingest --verify + fit + extrapolate) / read, page cache  {(verify_s + fit_s) / read_s:7.2f}")
    print(f"  ingest --verify / read, page cache:                     {verify_s / read_s:7.2f}")
    print(f"  ingest --copy / read, page cache:                       {copy_s / read_s:7.2f}")
    print(f"  fit + extrapolate, referenced / copied store:           {fit_s / copied_s:7.2f}   (goal: 1)")
    print(f"  fit + extrapolate / read, copied store, page cache:     {copied_s / read_copied_s:7.2f}   (goal <= 2.5)")
    print(f"  its reads, Gram and W · M alone / read, copied store:   {products_s / read_copied_s:7.2f}   (what the goal above "
          "leaves for the fit, θ₀ and the outputs: none where this is over 2.5)")
    print(f"  the same read in blocks / read by the kernels:          {blocks_s / products_s:7.2f}   (what the kernels' own "
          "reads gained)")
    print(f"  referenced: read in blocks / read by the kernels:       {referenced_blocks_s / referenced_products_s:7.2f}   "
          f"(the same, on the {args.dtype} checkpoints referenced in place)")
    whole = {name: median(c[name] for c in commands) for name in commands[0]}
    print(f"as a user runs them, from the page cache, each process from its start to its exit (Python's start, the imports "
          f"and the exit included; runs: {_runs(sorted(sum(c.values()) for c in commands))} s):")
    total = sum(whole.values())
    print(f"  relex ingest {whole['ingest']:.2f} s + relex extrapolate {whole['extrapolate']:.2f} s = {total:.2f} s, "
          f"{total / medians['ram', next(iter(in_ram))]:.2f} × the read")
    if not storage:
        print("this OS has no posix_fadvise: the page cache could not be dropped, so only warm reads were measured")
    checked = {"referenced, read by the kernels through the page cache": out, "referenced, --io direct: read in blocks": out_direct}
    for what, folder in (checked if storage else {"copied store, read by the kernels": out}).items():
        check = run_phase("check", str(run), str(base), str(folder), str(2 * last), str(5 * last))
        print(f"results ({what}) against RELEX in float64 from the checkpoint files, each written as {args.dtype}; "
              f"largest relative error of {check['tensors']} tensors:")
        for target, error in check["worst"].items():
            goal = f"goal <= 1e-4: {'met' if error <= 1e-4 else 'NOT MET'}; " if args.dtype == "float32" else ""
            print(f"  step {target}: {error:.1e}   ({goal}{args.dtype} itself loses up to {check['format'][target]:.1e} of the "
                  "predicted update)")


def _resident_bytes(*folders: Path) -> int | None:
    """Bytes of the folders' safetensors files in the page cache (util-linux `fincore`), or None without it."""
    files = [str(p) for folder in folders for p in folder.rglob("*.safetensors")]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                             check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(line) for line in out.split())


def _runs(seconds: list[float]) -> str:
    return ", ".join(f"{s:.2f}" for s in seconds)


if __name__ == "__main__":
    main()
