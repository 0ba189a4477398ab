"""Fit and extrapolate across the processes that `torchrun` starts (torch.distributed: gloo on CPUs, NCCL on GPUs).

    torchrun --nproc-per-node N -m relex fit STORE --out FIT
    torchrun --nproc-per-node N -m relex extrapolate STORE --targets 500 --out OUT --max-shard-size 1GB

Every rank opens the same store (across nodes: on a shared filesystem), computes the same plan from it and takes
its share of the work, split by bytes (`split_by_bytes`):

- `relex fit`: the trajectory tensors. Each rank forms the Gram matrices of its tensors; rank 0 gathers them
  (T × T each), fits and writes FIT. `relex backtest` shares its Gram pass the same way.
- `relex extrapolate`: the output shards. The shard plan (`plan_shards`, the files `save_pretrained` would write)
  is the same on every rank; each rank computes the tensors of its shards and writes those shard files, for every
  target, into rank 0's temporary output. Rank 0 then writes each folder's index, config and `relex.json`, and the
  fit, and renames the whole output into place (relex.io.atomic).

Only small things travel between ranks: Gram matrices, the norms of the predicted updates and one status per rank.
The outputs are byte-identical to one process's: each tensor is computed by the same code on the same row blocks,
and the sums over tensors are formed on rank 0 in the single process's order. The CPU kernels give the same bits
for any number of threads (relex.fit.gram, `PART_COLUMNS`), so a rank's OMP_NUM_THREADS does not matter either;
torch's product, used without numba, makes no such promise.

A failure on any rank (bad input, a full disk, a bug) is exchanged at the end of the phase it happens in, so every
rank stops with the same line naming the rank and the cause, and rank 0 removes the temporary output; a rank that
dies outright is reported by the others as lost. torchrun stops the remaining ranks with SIGTERM, which also
unwinds the temporary output.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from relex.backtest import backtest_store
from relex.errors import RelexError
from relex.extrapolate.extrapolate import (
    ExtrapolateConfig,
    TargetReport,
    _config_dtype,
    _Pass,
    _provenance,
    extrapolation_inputs,
    output_layout,
)
from relex.fit.fit import FitConfig, FitResult, fit_from_grams, observed_steps, refit, validate
from relex.fit.gram import resolve_device
from relex.fit.passes import ProductBuffers, tensor_grams
from relex.io.atomic import atomic_output, check_output, write_lock
from relex.io.checkpoint import INDEX_NAME, checkpoint_infos, read_config
from relex.io.dtypes import parse_dtype
from relex.io.hf_folder import copy_model_files, make_inference_ready, parse_size, plan_shards, shard_names
from relex.io.stream_writer import StreamingSafetensorsWriter, tensor_bytes, writes_direct
from relex.ranks import process_group, together
from relex.store import TrajectoryStore

LOG = logging.getLogger(__name__)

def split_by_bytes(sizes: Sequence[int], world: int) -> list[list[int]]:
    """The indices of `sizes` each rank takes: largest first, each to the least-loaded rank (ties: the lower rank).

    Deterministic, so every rank computes the same split; each rank's indices are returned in increasing order.
    """
    loads, parts = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(part) for part in parts]


# ---- fit -----------------------------------------------------------------------------------------------------------
def fit_across_ranks(
    store: TrajectoryStore, config: FitConfig, out: str | Path, *, overwrite: bool = False, inputs=(), gram_from=None
) -> FitResult | None:
    """`relex fit` under torchrun: each rank forms the Gram matrices of its share of the tensors, rank 0 fits and
    saves FIT. Returns the fit on rank 0, None on the others."""
    with process_group() as ranks, contextlib.ExitStack() as hold:
        with together(ranks, "preparing the fit"):
            check_output(out, overwrite=overwrite, inputs=inputs)
            if ranks.is_first:
                hold.enter_context(write_lock(out))
            steps = observed_steps(store, config.observe_until)
            validate(config, steps)
            names, infos = store.trajectory_names, store.tensors
            share = [names[i] for i in split_by_bytes([infos[n].numel for n in names], ranks.world)[ranks.rank]]
        grams: dict[str, np.ndarray] = {}
        with together(ranks, "forming Gram matrices"):
            if gram_from is None:
                grams = share_grams(store, config, steps, share)
        gathered = ranks.all_gather(grams)
        result = None
        with together(ranks, f"writing {out}"):
            if ranks.is_first:
                if gram_from is not None:  # no pass over the store: nothing to share
                    result = refit(store, config, gram_from)
                else:
                    merged = {name: gram for part in gathered for name, gram in part.items()}
                    grams = {name: merged[name] for name in names}
                    result = fit_from_grams(config, steps, grams, {n: infos[n].numel for n in names}, str(store.path))
                result.save(out, overwrite=overwrite, inputs=inputs)
            hold.close()
        return result


def backtest_across_ranks(store: TrajectoryStore, observe_until: int, methods: list[str], config: FitConfig):
    """`relex backtest` under torchrun: the ranks share the Gram pass over every recorded step as `fit` does; rank 0
    backtests from the gathered matrices. Returns the BacktestResult on rank 0, None on the others."""
    with process_group() as ranks:
        with together(ranks, "preparing the backtest"):
            names, infos = store.trajectory_names, store.tensors
            share = [names[i] for i in split_by_bytes([infos[n].numel for n in names], ranks.world)[ranks.rank]]
        grams: dict[str, np.ndarray] = {}
        with together(ranks, "forming Gram matrices"):
            grams = share_grams(store, config, store.steps, share)
        gathered = ranks.all_gather(grams)
        result = None
        with together(ranks, "backtesting"):
            if ranks.is_first:
                merged = {name: gram for part in gathered for name, gram in part.items()}
                result = backtest_store(store, observe_until, methods, config, merged)
        return result


def share_grams(store: TrajectoryStore, config: FitConfig, steps: list[int], names: list[str]) -> dict[str, np.ndarray]:
    """The Gram matrices of `names`, read as `fit_store` reads them (same blocks, so the same values)."""
    if not names:
        return {}
    started = time.perf_counter()
    reader = store.reader(steps, direct=store.reads_direct(config.io))
    stream = tensor_grams(reader, names, resolve_device(config.device), config.chunk_elements)
    grams = dict(stream)
    values = len(steps) * sum(store.tensors[name].numel for name in names)
    LOG.info("this rank: the Gram matrices of %d tensors (%.2f G values read) in %.2f s",
             len(grams), values / 1e9, time.perf_counter() - started)
    return grams


# ---- extrapolate ---------------------------------------------------------------------------------------------------
class _Tally:
    """Stands in for a TargetReport while a rank computes its share: it keeps each term added to the norms.

    `_Pass` adds ‖Δ̂‖² and the rounding loss block by block (`report._pred_sq += x`); reading 0.0 each time makes
    every addition store its term exactly. Rank 0 then sums the terms of all ranks in the single process's order
    (float addition is not associative, so only that order gives identical bytes in relex.json).
    """

    def __init__(self):
        self.terms: dict[str, tuple[list[float], list[float]]] = {}
        self._current: tuple[list[float], list[float]] = ([], [])

    def begin(self, name: str) -> None:
        self._current = self.terms.setdefault(name, ([], []))

    @property
    def _pred_sq(self) -> float:
        return 0.0

    @_pred_sq.setter
    def _pred_sq(self, value: float) -> None:
        self._current[0].append(value)

    @property
    def _lost_sq(self) -> float:
        return 0.0

    @_lost_sq.setter
    def _lost_sq(self, value: float) -> None:
        self._current[1].append(value)


def extrapolate_across_ranks(
    store: TrajectoryStore, out_dir: str | Path, config: ExtrapolateConfig, fit: FitResult | None = None
) -> list[TargetReport] | None:
    """`relex extrapolate` under torchrun: each rank writes the shard files of its share, rank 0 the rest.

    Returns the reports on rank 0, None on the others. Nothing of OUT exists until every rank has succeeded.
    """
    out_dir = Path(out_dir)
    with process_group() as ranks, contextlib.ExitStack() as hold:
        inputs = extrapolation_inputs(store, fit)
        with together(ranks, "preparing the extrapolation"):
            check_output(out_dir, overwrite=config.overwrite, inputs=inputs)
            read_config(store.base_dir)  # a broken config.json fails now, not after the pass
            max_shard = parse_size(config.max_shard_size)
            tmp = None
            if ranks.is_first:
                hold.enter_context(write_lock(out_dir))
                tmp = hold.enter_context(atomic_output(out_dir, overwrite=config.overwrite, inputs=inputs))
            out_dtype = parse_dtype(config.dtype) if config.dtype else None
            layout = output_layout(checkpoint_infos(store.base_dir), store.tied, out_dtype, store.base_dir)
            shards = plan_shards(layout, max_shard)
            share = split_by_bytes([sum(tensor_bytes(i) for _, i in s) for s in shards], ranks.world)[ranks.rank]
            if ranks.is_first and len(shards) < ranks.world:
                LOG.warning(
                    "%d output shard(s) for %d ranks: %d rank(s) have nothing to write; a smaller --max-shard-size "
                    "gives each rank a share", len(shards), ranks.world, ranks.world - len(shards),
                )
            mine = {name for i in share for name, _ in shards[i]}
            needed = {store.tied.get(name, name) for name in mine}
            state = _Pass(store, out_dir, config, fit, reads=needed & set(store.trajectory_names))
            assert state.layout == layout, "the output layout differs from the one the shards were planned on"
            if tmp is not None:
                for report in state.reports:
                    (tmp / report.path.name).mkdir()
        tmp = Path(ranks.broadcast(str(tmp) if tmp is not None else None))
        tallies = [_Tally() for _ in state.reports]
        reports, state.reports = state.reports, tallies
        with together(ranks, "computing and writing shards"):
            started = time.perf_counter()
            write_share(state, tmp, shards, share, mine)
            LOG.info("this rank: %d of %d shard files per target (%.2f GB each target) in %.2f s", len(share), len(shards),
                     sum(tensor_bytes(info) for i in share for _, info in shards[i]) / 1e9, time.perf_counter() - started)
        gathered = ranks.all_gather((state.grams, [t.terms for t in tallies]))
        state.reports = reports
        with together(ranks, f"writing {out_dir}"):
            if ranks.is_first:
                finish_output(state, tmp, shards, gathered, fit)
            hold.close()  # rank 0: renames the output into place (on an error, the stack removes it)
        return reports if ranks.is_first else None


def write_share(state: _Pass, tmp: Path, shards: list, share: list[int], mine: set[str]) -> None:
    """Write the shard files `share` of every target into `tmp/step-S/`, computing each tensor as `_Pass` does."""
    names = shard_names(len(shards))
    shard_of = {name: i for i in share for name, _ in shards[i]}
    open_writers: dict[tuple[int, int], StreamingSafetensorsWriter] = {}
    direct = writes_direct(state.fit_config.io)

    def write(name: str, outputs: list[torch.Tensor]) -> None:
        if name not in mine:  # computed for an alias of this rank's
            return
        for target, values in enumerate(outputs):
            key = (target, shard_of[name])
            if key not in open_writers:
                folder = tmp / f"step-{state.config.targets[target]}"  # the folder _Pass names TargetReport.path
                open_writers[key] = StreamingSafetensorsWriter(folder / names[key[1]], shards[key[1]], {"format": "pt"},
                                                               direct=direct)
            writer = open_writers[key]
            writer.write(name, values)
            if writer.complete:
                writer.close()
                del open_writers[key]

    def begin(name: str) -> None:
        for tally in state.reports:
            tally.begin(name)

    try:
        state.run(write, wanted=mine, begin=begin, products=ProductBuffers())  # written before `write` returns
    except BaseException:
        for writer in open_writers.values():
            writer.abort()
        raise
    if open_writers:
        raise RelexError(f"shards {sorted(k[1] for k in open_writers)} were not complete after every tensor was written")


def finish_output(state: _Pass, tmp: Path, shards: list, gathered: list, fit: FitResult | None) -> None:
    """Rank 0: the norms and the fit from every rank's share, then each folder's index, config and relex.json."""
    order = {}
    for name, _ in state.layout:
        order.setdefault(state.tied.get(name, name), len(order))
    grams: dict[str, np.ndarray] = {}
    for rank_grams, _ in gathered:
        for name, gram in rank_grams.items():
            grams.setdefault(name, gram)
    grams = dict(sorted(grams.items(), key=lambda item: order[item[0]]))
    fit_used = fit
    if fit is None and grams:
        numel = {name: state.infos[name].numel for name in grams}
        fit_used = fit_from_grams(state.fit_config, state.plan.steps.tolist(), grams, numel, str(state.store.path))
    names = shard_names(len(shards))
    for k, report in enumerate(state.reports):
        terms: dict[str, tuple[list[float], list[float]]] = {}
        for _, rank_terms in gathered:
            for name, pair in rank_terms[k].items():
                terms.setdefault(name, pair)
        report._pred_sq, report._lost_sq = 0.0, 0.0
        for name in sorted(terms, key=order.__getitem__):  # the single process's order of additions
            for x in terms[name][0]:
                report._pred_sq += x
            for x in terms[name][1]:
                report._lost_sq += x
        report.delta_norm = report._pred_sq**0.5
        report.rounding_loss = (report._lost_sq / report._pred_sq) ** 0.5 if report._pred_sq > 0 else 0.0
        folder = tmp / report.path.name
        write_folder_files(folder, state, shards, names)
        make_inference_ready(folder, state.out_dtype or _config_dtype(state))
        (folder / "relex.json").write_text(json.dumps(_provenance(state, report, fit_used), indent=2, default=str) + "\n")
    if fit is None and grams:
        fit_used.write_into(tmp / "fit")


def write_folder_files(folder: Path, state: _Pass, shards: list, names: list[str]) -> None:
    """What HFFolderWriter.finish writes besides the shards: the index (when sharded) and the base's model files."""
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise RelexError(f"{folder}: shard(s) {', '.join(missing)} missing after every rank finished")
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name, _ in shard}
        sizes = [info for _, info in state.layout]
        metadata = {"total_parameters": sum(i.numel for i in sizes), "total_size": sum(tensor_bytes(i) for i in sizes)}
        index = {"metadata": metadata, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    copy_model_files(state.store.base_dir, folder)
