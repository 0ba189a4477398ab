"""`relex extrapolate`: write θ₀ + Σᵢ wᵢ Δᵢ for every target step in one streaming pass over the store.

For each tensor, in order: its weights (targets × T) come from the method (and the rank-r fit, computed here
from the Gram when no FIT is given), then out = θ₀ + W · M is formed block by block and streamed into one Hugging
Face folder per target (`OUT/step-<S>/`). The pass is relex.fit.passes's: it plans every read up front (a
trajectory that fits in `cache_elements` is read once, whole, for both the Gram and the weighted sum; a larger one
twice, one block of T × rows values at a time), and hands each tensor's Gram and θ₀ + W · M (`_Outputs` adds θ₀:
the pass reads it beside the steps' values) to `_Outputs`, which turns them into output blocks in the layout's
order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from relex import __version__
from relex.errors import RelexError
from relex.extrapolate.methods import (
    Method,
    Plan,
    check_scale,
    get_method,
    kept_weights,
    scaled_weights,
)
from relex.fit.fit import (
    FitConfig,
    FitResult,
    fit_from_grams,
    observed_steps,
    validate,
    window_indices,
)
from relex.fit.gram import GRAM, resolve_device, rounded
from relex.fit.passes import DEFAULT_HOLD_ELEMENTS, Consumer, PassBudget, ProductBuffers, plan_pass, run_pass
from relex.fit.trajectory_fit import fit_tensor
from relex.io.atomic import atomic_output, check_output, write_lock
from relex.io.checkpoint import CheckpointReader, TensorInfo, read_config
from relex.io.dtypes import dtype_name, parse_dtype
from relex.io.hf_folder import HFFolderWriter, model_order, parse_size
from relex.io.stream_writer import WriteBehind, writes_direct
from relex.settings import setting
from relex.store import TrajectoryStore, all_finite
from relex.util import comma_list, module_type, most_common_float_dtype, reused

LOG = logging.getLogger(__name__)

DEFAULT_CACHE_ELEMENTS = DEFAULT_HOLD_ELEMENTS  # a trajectory up to this size is read once, not twice


@dataclass
class ExtrapolateConfig:
    """What `relex extrapolate` writes (targets, method, output) and the fit it uses (relex.settings fields)."""

    targets: list[int] = setting(help="target steps, each written as one Hugging Face folder step-N")
    method: str = setting("relex", "extrapolation method (relex.extrapolate.methods)")
    fit: FitConfig = setting(help="the fit's recipe and how it runs", factory=FitConfig)
    anchors: tuple[int, int] | None = setting(None, "two-point's two recorded steps (default: the first and last observed)")
    dtype: str | None = setting(None, "output dtype of float tensors (default: each tensor's base dtype)")
    max_shard_size: str = setting("5GB", "largest safetensors shard written")
    overwrite: bool = setting(False, "replace a non-empty output folder")
    cache_elements: int = setting(DEFAULT_CACHE_ELEMENTS, "a trajectory up to this many values is read once, not twice")
    scale: float = setting(1.0, "λ: the displacement predicted beyond the last observed step is multiplied by this")
    keep: tuple[str, ...] = setting((), "module-type patterns copied from the last observed step instead of extrapolated")


@dataclass
class TargetReport:
    target: int
    path: Path
    horizon_ratio: float
    interpolation: bool
    delta_norm: float = 0.0  # ‖Δ̂‖ over all tensors
    rounding_loss: float = 0.0  # ‖cast(θ₀ + Δ̂) − (θ₀ + Δ̂)‖ / ‖Δ̂‖: the part of the update the output dtype loses
    _lost_sq: float = 0.0
    _pred_sq: float = 0.0

    def finish(self) -> None:
        """The norms from the sums of squares the pass added up."""
        self.delta_norm = self._pred_sq**0.5
        self.rounding_loss = (self._lost_sq / self._pred_sq) ** 0.5 if self._pred_sq > 0 else 0.0


def parse_targets(text: str) -> list[int]:
    try:
        targets = [int(part) for part in comma_list(str(text))]
    except ValueError:
        raise RelexError(f"cannot read targets {text!r}; give step numbers like 100,200,500") from None
    if not targets or any(t <= 0 for t in targets):
        raise RelexError(f"targets {text!r}: give one or more positive step numbers like 100,200,500")
    if len(set(targets)) != len(targets):
        raise RelexError(f"targets {text!r}: a step is listed twice")
    return targets


def output_layout(
    base: dict[str, TensorInfo], tied: dict[str, str], dtype: torch.dtype | None, config_dir: Path | None = None
) -> list[tuple[str, TensorInfo]]:
    """Base tensors in output order: the model's (as save_pretrained writes them), tied aliases after the tensor they
    share, float tensors in `dtype`."""
    def out_info(info: TensorInfo) -> TensorInfo:
        return TensorInfo(info.shape, dtype) if dtype is not None and info.is_float else info

    names = sorted(model_order(list(base), config_dir), key=lambda n: n in tied)  # stable: model order otherwise
    return [(name, out_info(base[name])) for name in names]


class _Pass:
    """One extrapolation: the targets' reports, each tensor's weights from the method, and the planned pass over the
    store (relex.fit.passes) that forms θ₀ + W · M for every tensor of the output layout, in its order (`run`)."""

    def __init__(
        self, store: TrajectoryStore, out_dir: Path, config: ExtrapolateConfig, fit: FitResult | None,
        reads: set[str] | None = None,  # only these trajectory tensors are read: one rank's share (relex.distributed)
    ):
        self.store, self.out_dir, self.config, self.fit = store, out_dir, config, fit
        self.method: Method = get_method(config.method)
        steps = fit.steps.tolist() if fit is not None else observed_steps(store, config.fit.observe_until)
        # a saved fit brings its recipe (rank, temporal model, window); how this pass runs comes from this command
        fit_config = (dataclasses.replace(fit.config, device=config.fit.device, io=config.fit.io, chunk_elements=config.fit.chunk_elements)
                      if fit is not None else config.fit)
        if self.method.needs_fit and fit is None:
            validate(fit_config, steps)
        window = fit.tensors[next(iter(fit.tensors))].window if fit is not None and fit.tensors else window_indices(len(steps), fit_config.window)
        self.fit_config = fit_config
        self.plan = Plan(np.asarray(steps, dtype=np.int64), window, fit_config.temporal_model(), config.anchors)
        self.method.check(self.plan, config.targets)
        self.scale = check_scale(config.scale)
        self.device = resolve_device(fit_config.device)
        self.base = CheckpointReader(store.base_dir)
        self.out_dtype = parse_dtype(config.dtype) if config.dtype else None
        self._lost = torch.empty(0, dtype=torch.float32)  # `combine`'s rounding errors, reused from block to block
        # the manifest's views, computed once: the pass consults them for every tensor
        self.infos, self.tied, self.trajectory = store.tensors, store.tied, set(store.trajectory_names)
        self.kept = kept_tensors(store.trajectory_names, config.keep)
        self.layout = output_layout(self.base.infos(), self.tied, self.out_dtype, store.base_dir)
        self.reader = store.reader(steps, direct=store.reads_direct(config.fit.io))
        self.grams: dict[str, np.ndarray] = {}
        self.reports = [self._report(t) for t in config.targets]
        names = [n for n, _ in self.layout if n in self.trajectory and (reads is None or n in reads)]
        needs_gram = self.method.needs_fit and fit is None
        budget = PassBudget(fit_config.chunk_elements, config.cache_elements)
        self.reads = plan_pass(self.reader, names, grams=names if needs_gram else (), sums=names, budget=budget, device=self.device)

    def _report(self, target: int) -> TargetReport:
        inside = bool(target <= self.plan.window_steps[-1])
        ratio = self.method.horizon_ratio(self.plan, target)
        if inside and self.method.extrapolates:
            LOG.warning(
                "target %d is inside the observed window (steps %d..%d): this is interpolation, not extrapolation",
                target, self.plan.window_steps[0], self.plan.window_steps[-1],
            )
        return TargetReport(target, self.out_dir / f"step-{target}", ratio, inside)

    def run(self, emit, wanted: set[str] | None = None, begin=None, products: ProductBuffers | None = None) -> None:
        """Compute the layout's tensors in order, calling `emit(name, outputs)` with one block per target each time.

        `wanted`: the names to compute (default all), and the tensors their tied aliases share; `begin(name)` is
        called before a tensor's norms are added to the reports (relex.distributed keeps them per tensor).
        `products`: reused memory for the outputs (relex.fit.passes): an output is then valid only until `emit`
        returns, unless `emit` holds it (`products.hold`) until it is done with it (`products.release`).
        """
        outputs = _Outputs(self, emit, wanted, begin, products)
        run_pass(self.reader, self.reads, [outputs], GRAM, desc=f"extrapolate ({self.config.method})", products=products)
        outputs.advance(None)

    # ---- per tensor ----------------------------------------------------------------------------------------------
    def weights(self, name: str, gram: np.ndarray | None) -> np.ndarray | None:
        """W (targets × T) for tensor `name`, fitted from `gram` when the pass formed it; None when all zero."""
        fit = None
        if gram is not None:
            self.grams[name] = gram
            fit = fit_tensor(name, self.plan.steps, gram, self.fit_config.rank, self.plan.model, self.plan.window)
        elif self.method.needs_fit:
            fit = self.fit.tensors[name]
        targets = np.asarray(self.config.targets)
        if name in self.kept:
            w = kept_weights(self.plan, len(targets))
        else:
            w = scaled_weights(self.plan, targets, self.method.weights(self.plan, targets, fit), self.scale)
        return w if np.any(w) else None  # an all-zero trajectory keeps the base values

    def combine(self, exact: torch.Tensor, checks: np.ndarray, report: TargetReport, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """θ₀ + Δ̂ (`exact`, float32, as the pass formed it) in the output `dtype`, adding to the report's norms; and
        whether every output value is known to be finite (else `check_finite` looks at the values). `checks` are
        the pass's for these values (relex.fit.passes.Consumer.sums): Σ Δ̂² and Σ (θ₀ + Δ̂).

        Float32 output is `exact` itself, finite when its sum is. In another dtype a NaN or Inf in an output makes its
        rounding error, output − θ₀ − Δ̂, a NaN or Inf too (θ₀ + Δ̂ itself not finite, or rounded up to Inf), so a
        finite sum of the errors' squares shows the output finite. The errors go into memory reused from block to
        block.
        """
        report._pred_sq += float(checks[0])
        if dtype == torch.float32:  # float32 output is the computation itself: nothing is rounded away
            return exact, math.isfinite(float(checks[1]))
        if (by_kernel := rounded(exact, dtype)) is not None:  # bf16 or fp16 on the CPU: one loop, no GIL
            out, lost_sq = by_kernel
            report._lost_sq += lost_sq
            return out, math.isfinite(lost_sq)
        out = exact.to(dtype)
        if out.dtype in (torch.bfloat16, torch.float16):
            self._lost = reused(self._lost, exact.numel(), torch.float32)
            lost = self._lost[: exact.numel()].copy_(out).sub_(exact)
        else:
            lost = out.float().sub_(exact)
        lost_sq = float(torch.dot(lost, lost))
        report._lost_sq += lost_sq
        return out, math.isfinite(lost_sq)


class _Outputs(Consumer):
    """What an extrapolation pass yields, in the output layout's order: θ₀ + W · M block by block for the tensors
    with a trajectory (as the pass reaches them), the base's values for the others and for all-zero trajectories,
    and a tied alias's values from the tensor it shares (kept until its last alias is written)."""

    adds_base = True  # the pass forms θ₀ + W · M (relex.fit.passes): the read θ₀'s values go into the sums there

    def __init__(self, state: _Pass, emit, wanted: set[str] | None, begin, products: ProductBuffers | None = None):
        self.state, self.emit, self.begin = state, emit, begin or (lambda name: None)
        self.products = products  # the outputs kept for an alias are held there until it is written
        self.todo = iter(state.layout)
        self.infos = dict(state.layout)
        names = set(self.infos) if wanted is None else set(wanted)
        self.computed = names | {state.tied[n] for n in names if n in state.tied}
        self.aliases = Counter(state.tied[n] for n in names if n in state.tied)  # aliases yet to be written, per tensor
        self.parts: dict[str, list[list[torch.Tensor]]] = {}  # a tensor's output blocks, per target, for its aliases
        self.current: str | None = None  # the tensor being written (`_start`)
        self.keeps_base: set[str] = set()  # asked for, with all-zero weights: its base values are written at `done`

    def advance(self, until: str | None) -> None:
        """Emit the layout's entries up to `until` (the pass's next tensor; None: to the end) that the pass does not compute."""
        for name, info in self.todo:
            if name == until:
                return
            alias_of = self.state.tied.get(name)
            if name not in self.computed or name in self.state.trajectory:
                continue  # not this caller's, or a trajectory tensor (the pass computes those it reads)
            if alias_of is not None and alias_of in self.parts:
                self._alias(name, alias_of, info)
            else:
                self.begin(name)
                self._emit(name, [self.state.base.read(name).to(info.dtype)] * len(self.state.reports))

    def _alias(self, name: str, alias_of: str, info) -> None:
        outputs = [torch.cat([p.reshape(-1) for p in part]).reshape(info.shape) for part in self.parts[alias_of]]
        self.emit(name, outputs)
        self.aliases[alias_of] -= 1
        if not self.aliases[alias_of]:
            if self.products is not None:
                for part in self.parts[alias_of]:
                    for values in part:
                        self.products.release(values)
            del self.parts[alias_of]

    def _emit(self, name: str, outputs: list[torch.Tensor], finite: Sequence[bool] = ()) -> None:
        """Hand one block per target to `emit`, each checked for values its dtype cannot hold unless `finite` (per
        output) says it is known to be finite (`_Pass.combine`)."""
        for i, (values, target) in enumerate(zip(outputs, self.state.config.targets)):
            if not (i < len(finite) and finite[i]):
                check_finite(name, values, target)
        if self.aliases[name]:
            for part, values in zip(self.parts.setdefault(name, [[] for _ in outputs]), outputs):
                part.append(values)
                if self.products is not None:
                    self.products.hold(values)
        self.emit(name, outputs)

    def _start(self, name: str) -> None:
        """Emit the layout's entries before tensor `name` and begin it, once, as its first output is written."""
        if name != self.current:
            self.advance(name)
            self.begin(name)
            self.current = name

    def weights(self, name: str, gram: np.ndarray | None) -> np.ndarray | None:
        """W for tensor `name`. The pass asks as soon as the tensor's Gram is formed, which may be before the tensor
        ahead of it is written (relex.fit.passes.Consumer.weights), so nothing is written here: the outputs go out
        from `sums`, and the base values of an all-zero trajectory from `done`, in the layout's order."""
        w = self.state.weights(name, gram)
        if w is None:
            self.keeps_base.add(name)
        return w

    def done(self, name: str) -> None:
        if name in self.keeps_base:
            self.keeps_base.discard(name)
            self._start(name)
            base = self.state.base.read(name).to(self.state.out_dtype or self.infos[name].dtype)
            self._emit(name, [base] * len(self.state.reports))

    def sums(self, name: str, rows, sums: torch.Tensor, checks: np.ndarray | None = None) -> None:
        self._start(name)
        info = self.infos[name]  # in the output dtype
        shape = info.shape if rows is None else (rows[1] - rows[0], *info.shape[1:])
        combined = [self.state.combine(exact, row_checks, report, info.dtype)
                    for exact, row_checks, report in zip(sums, checks, self.state.reports)]
        self._emit(name, [values.reshape(shape) for values, _ in combined], [finite for _, finite in combined])


def kept_tensors(names: list[str], patterns) -> set[str]:
    """The trajectory tensors whose module type (or full name) matches one of the `--keep` patterns (fnmatch)."""
    from fnmatch import fnmatchcase

    kept: set[str] = set()
    for pattern in patterns:
        hits = {n for n in names if fnmatchcase(module_type(n), pattern) or fnmatchcase(n, pattern)}
        if not hits:
            types = sorted({module_type(n) for n in names})
            raise RelexError(f"--keep {pattern!r} names no module type of this store; types: {', '.join(types)}")
        kept |= hits
    return kept


def extrapolate_store(store: TrajectoryStore, out_dir: str | Path, config: ExtrapolateConfig, fit: FitResult | None = None) -> list[TargetReport]:
    """Write one HF folder per target under `out_dir`; returns what each target holds.

    The whole of `out_dir` (every step folder and `fit/`) is written under a temporary name and replaces an
    old one only when complete, with `out_dir`'s lock held (relex.io.atomic); `--overwrite` never replaces an
    input (the store, its base or checkpoints, the fit).

    Args:
        store: an open trajectory store.
        out_dir: the folder to write: `OUT/step-S/` per target (loads with `from_pretrained`) and `OUT/fit/`.
        config: the targets, the method (`relex`, `relex-anchored`, `two-point`, …), output dtype, shard size,
            `scale` (λ) and `keep` patterns; `config.fit` is the fit's recipe when `fit` is not given.
        fit: a saved fit (`FitResult.load`) to reuse instead of fitting again.

    Returns:
        One `TargetReport` per target: its folder, horizon ratio (target / last observed step), whether it is an
        interpolation, ‖Δ̂‖ and the part of it the output dtype loses.

    Example:
        from relex.extrapolate import ExtrapolateConfig, extrapolate_store
        reports = extrapolate_store(store, "runs/demo/extrapolated", ExtrapolateConfig(targets=[30, 60]),
                                    FitResult.load("runs/demo/fit"))
        [(r.target, r.horizon_ratio, r.path) for r in reports]
    """
    out_dir = Path(out_dir)
    inputs = extrapolation_inputs(store, fit)
    check_output(out_dir, overwrite=config.overwrite, inputs=inputs)
    read_config(store.base_dir)  # a broken config.json fails now, not after the pass
    max_shard = parse_size(config.max_shard_size)
    with write_lock(out_dir):
        state = _Pass(store, out_dir, config, fit)  # validates everything before anything is written
        started = time.time()
        with atomic_output(out_dir, overwrite=config.overwrite, inputs=inputs) as tmp:
            fit_used = _write_targets(state, tmp, max_shard)
            if fit is None and state.grams:
                fit_used.write_into(tmp / "fit")
    LOG.info("wrote %d checkpoint(s) in %.1f s", len(state.reports), time.time() - started)
    return state.reports


def extrapolate_states(store: TrajectoryStore, config: ExtrapolateConfig, fit: FitResult | None = None) -> tuple[list[TargetReport], list[dict[str, torch.Tensor]]]:
    """What `extrapolate_store` writes, kept in memory instead: one state dict (tensor name -> values, in the output
    dtype, tied aliases included) per target, from the same pass. For weights that are used once and thrown away,
    such as the candidates of a `relex accelerate` jump; memory holds every target's whole model at once. The
    reports' norms are those `extrapolate_store` reports; their `path` names no folder (nothing is written).

    Example:
        reports, states = extrapolate_states(store, ExtrapolateConfig(targets=[12], method="relex-anchored"), fit)
        model.load_state_dict(states[0], strict=False)
    """
    state = _Pass(store, Path("<memory>"), config, fit)
    parts: list[dict[str, list[torch.Tensor]]] = [{} for _ in state.reports]

    def keep(name: str, outputs: list[torch.Tensor]) -> None:
        for held, values in zip(parts, outputs):
            held.setdefault(name, []).append(values)

    state.run(keep)
    infos = dict(state.layout)
    states = [{name: _joined(blocks, infos[name].shape) for name, blocks in held.items()} for held in parts]
    for report in state.reports:
        report.finish()
    return state.reports, states


def _joined(blocks: list[torch.Tensor], shape) -> torch.Tensor:
    """A tensor's output blocks (row ranges, in order) as one tensor of its shape."""
    if len(blocks) == 1:
        return blocks[0].reshape(shape)
    return torch.cat([b.reshape(-1) for b in blocks]).reshape(shape)


def extrapolation_inputs(store: TrajectoryStore, fit: FitResult | None) -> list[Path]:
    """What an extrapolation reads: an output there would be refused by --overwrite."""
    referenced = [store.checkpoint_dir(e) for e in store.entries if e.kind == "checkpoint"]
    return [store.path, store.base_dir, *referenced, getattr(fit, "folder", None)]


def _write_targets(state: _Pass, out_dir: Path, max_shard: int) -> FitResult | None:
    """Stream every tensor into one HF folder per target under `out_dir`; returns the fit that was used."""
    store, fit = state.store, state.fit
    direct = writes_direct(state.fit_config.io)
    writers = [HFFolderWriter(out_dir / r.path.name, state.layout, base_dir=store.base_dir, max_shard_bytes=max_shard, direct=direct)
               for r in state.reports]

    products = ProductBuffers()  # the outputs' memory, reused once they are written

    def write(name: str, outputs: list[torch.Tensor]) -> None:
        try:
            for writer, values in zip(writers, outputs):
                writer.write(name, values)
        finally:
            for values in outputs:
                products.release(values)

    def hand_over(name: str, outputs: list[torch.Tensor]) -> None:
        for values in outputs:
            products.hold(values)  # until the writer thread has written them
        behind.put((name, outputs), sum(v.nbytes for v in outputs))

    try:
        with WriteBehind(write) as behind:  # a block is written while the pass computes the next one
            state.run(hand_over, products=products)
        fit_used = fit or (fit_from_grams(state.fit_config, state.plan.steps.tolist(), state.grams, {n: state.infos[n].numel for n in state.grams}, str(store.path)) if state.grams else None)
        for writer, report in zip(writers, state.reports):
            report.finish()
            writer.finish(state.out_dtype or _config_dtype(state), _provenance(state, report, fit_used))
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    return fit_used


def check_finite(name: str, values: torch.Tensor, target: int) -> None:
    """Refuse an output value the output dtype cannot hold (an overflow to Inf), naming the tensor and target
    (`all_finite`: a sum first, the values one by one only when it is not finite)."""
    if not values.is_floating_point():
        return
    if not all_finite(values):
        largest = torch.finfo(values.dtype).max
        raise RelexError(
            f"tensor {name} at step {target}: the extrapolated weights overflow {dtype_name(values.dtype)} "
            f"(|value| > {largest:.3g} becomes Inf); choose a nearer target or a wider --dtype such as float32"
        )


def _config_dtype(state: _Pass) -> torch.dtype | None:
    """The dtype config.json should state: the base's most common float dtype."""
    return most_common_float_dtype(info.dtype for _, info in state.layout)


def _listed(steps: tuple[int, ...] | None) -> list[int] | None:
    return list(steps) if steps is not None else None


def _provenance(state: _Pass, report: TargetReport, fit: FitResult | None) -> dict:
    config = state.config
    return {
        "relex_version": __version__,
        "method": config.method,
        "target_step": report.target,
        "horizon_ratio": report.horizon_ratio,
        "interpolation": report.interpolation,
        "rank": state.fit_config.rank if state.method.needs_fit else None,
        "temporal": state.fit_config.temporal_model().describe() if state.method.needs_fit else None,
        "window_steps": state.plan.window_steps.tolist(),
        "observed_steps": state.plan.steps.tolist(),
        "anchors": _listed(state.method.anchors(state.plan)),
        "scale": state.scale,
        "kept": sorted(state.kept),
        "fit_summary": fit.summary() if fit is not None and state.method.needs_fit else None,
        "store": str(state.store.path.resolve()),
        "base": str(state.store.base_dir.resolve()),
        "output_dtype": dtype_name(state.out_dtype) if state.out_dtype else "base",
        "predicted_delta_norm": report.delta_norm,
        "rounding_loss": report.rounding_loss,
    }


def materialize_step(store_dir: str | Path, step: int, out_dir: str | Path) -> Path:
    """Write the real checkpoint θ₀ + Δ_step of a recorded step as an HF folder at `out_dir` (replaced whole)."""
    store = TrajectoryStore.open(store_dir)
    store.entry(step)
    out_dir = Path(out_dir)
    config = ExtrapolateConfig(targets=[step], method="observed", overwrite=True)
    with atomic_output(out_dir, overwrite=True, inputs=extrapolation_inputs(store, None)) as tmp:
        folder = extrapolate_store(store, tmp / "written", config)[0].path
        for child in (tmp / "written" / folder.name).iterdir():
            os.replace(child, tmp / child.name)
        shutil.rmtree(tmp / "written")
    return out_dir
