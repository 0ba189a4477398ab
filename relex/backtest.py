"""`relex backtest`: fit on an observed prefix, predict every later observed step, and measure the error.

Everything comes from one Gram pass over all recorded steps: a prediction Δ̂ = Σᵢ wᵢ Δᵢ over the prefix has
‖Δ̂ − Δ_m‖² = wᵀ G_pp w − 2 wᵀ G_pm + G_mm, and the cosine between the rank-1 direction of the prefix and of the
later steps is |u_pᵀ G_pl u_l| / (σ_p σ_l). No prediction is ever written out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import numpy as np

from relex.errors import RelexError
from relex.extrapolate.methods import Plan, get_method
from relex.fit.fit import FitConfig, FitResult, validate
from relex.fit.gram import GRAM, resolve_device
from relex.fit.passes import Consumer, PassBudget, plan_pass, run_pass
from relex.fit.trajectory_fit import fit_tensor
from relex.io.atomic import write_json_atomic
from relex.store import TrajectoryStore
from relex.util import grouped, module_type

LOG = logging.getLogger(__name__)

DEFAULT_METHODS = ("relex", "two-point", "per-param")


@dataclass
class BacktestResult:
    observed: list[int]
    later: list[int]
    methods: list[str]
    # method -> later step -> module type -> [error², truth²]
    errors: dict[str, dict[int, dict[str, list[float]]]] = field(default_factory=dict)
    drift: dict[str, float] = field(default_factory=dict)  # tensor -> |cos| of early vs late rank-1 direction

    def relative_error(self, method: str, step: int, group: str | None = None) -> float:
        cells = self.errors[method][step]
        keys = [group] if group is not None else list(cells)
        err = sum(cells[k][0] for k in keys)
        truth = sum(cells[k][1] for k in keys)
        return (err / truth) ** 0.5 if truth > 0 else float("nan")

    def module_types(self) -> list[str]:
        return sorted(next(iter(next(iter(self.errors.values())).values())))

    def drift_by_module_type(self) -> dict[str, float]:
        return {group: median(values) for group, values in grouped((module_type(name), cos) for name, cos in self.drift.items()).items()}

    def to_dict(self) -> dict:
        return {
            "observed_steps": self.observed,
            "later_steps": self.later,
            "relative_error": {
                m: {str(s): {"all": self.relative_error(m, s), **{g: self.relative_error(m, s, g) for g in self.module_types()}} for s in self.later}
                for m in self.methods
            },
            "drift_cosine_median": median(self.drift.values()) if self.drift else None,
            "drift_cosine_by_module_type": self.drift_by_module_type(),
            "drift_cosine_by_tensor": self.drift,
        }

    def save(self, path: str | Path) -> None:
        """Replace the file `path` whole (relex.io.atomic): a reader sees the old result or the new, never a part."""
        write_json_atomic(path, self.to_dict(), lock=True)


def _direction(gram: np.ndarray) -> tuple[np.ndarray, float]:
    values, vectors = np.linalg.eigh(gram)
    return vectors[:, -1], float(np.sqrt(max(values[-1], 0.0)))


class _Errors(Consumer):
    """The backtest's consumer of a pass: from each tensor's Gram over all steps, the squared errors of every
    method's prediction of every later step, and the drift of its rank-1 direction."""

    def __init__(self, result: BacktestResult, plan: Plan, methods: dict, config: FitConfig, steps: list[int]):
        self.result, self.plan, self.methods, self.config, self.steps = result, plan, methods, config, steps
        self.needs_fit = any(m.needs_fit for m in methods.values())

    def gram(self, name: str, gram: np.ndarray) -> None:
        p, n, group = len(self.plan.steps), len(self.steps), module_type(name)
        g_pp = gram[:p, :p]
        fit = fit_tensor(name, self.plan.steps, g_pp, self.config.rank, self.plan.model, self.plan.window) if self.needs_fit else None
        for method_name, method in self.methods.items():
            w = method.weights(self.plan, np.asarray(self.result.later), fit)
            for row, m in zip(w, range(p, n)):
                err = float(row @ g_pp @ row - 2 * row @ gram[:p, m] + gram[m, m])
                cell = self.result.errors[method_name][self.steps[m]].setdefault(group, [0.0, 0.0])
                cell[0] += max(err, 0.0)
                cell[1] += float(gram[m, m])
        if gram[0, 0] > 0 and gram[p:, p:].trace() > 0:
            (u_early, s_early), (u_late, s_late) = _direction(g_pp), _direction(gram[p:, p:])
            self.result.drift[name] = abs(float(u_early @ gram[:p, p:] @ u_late)) / (s_early * s_late)


def grams_of_fit(fit_dir: str | Path, store: TrajectoryStore) -> dict[str, np.ndarray]:
    """The Gram matrices of an earlier fit (`relex backtest --gram-from`), which must cover every recorded step."""
    previous = FitResult.load(fit_dir)
    if previous.steps.tolist() != store.steps:
        raise RelexError(f"{fit_dir}: its Gram covers steps {previous.steps.tolist()[:3]}…, not all {len(store.steps)} recorded steps")
    return previous.grams


def backtest_store(
    store: TrajectoryStore, observe_until: int, methods: list[str], config: FitConfig, grams: dict[str, np.ndarray] | None = None
) -> BacktestResult:
    """`grams`: Gram matrices over all of the store's steps (a FIT of the whole store), to skip the pass."""
    steps = store.steps
    prefix = [s for s in steps if s <= observe_until]
    later = [s for s in steps if s > observe_until]
    if not later:
        raise RelexError(f"--observe-until {observe_until}: no recorded step after it to predict (last is {steps[-1]})")
    window = validate(config, prefix)
    method_objs = {name: get_method(name) for name in methods}
    plan = Plan(np.asarray(prefix), window, config.temporal_model())
    for method in method_objs.values():
        if not method.extrapolates:
            raise RelexError(f"method {method.name!r} predicts observed steps only; backtest compares extrapolations")
        method.check(plan, later)
    result = BacktestResult(prefix, later, list(methods), {m: {s: {} for s in later} for m in methods})
    errors = _Errors(result, plan, method_objs, config, steps)
    names = store.trajectory_names
    if grams is not None:
        for name in names:
            errors.gram(name, grams[name])
        return result
    reader = store.reader(steps, direct=store.reads_direct(config.io))
    device = resolve_device(config.device)
    reads = plan_pass(reader, names, grams=names, budget=PassBudget(chunk_elements=config.chunk_elements), device=device)
    run_pass(reader, reads, [errors], GRAM, desc="backtest: Gram matrices")
    return result


__all__ = ["BacktestResult", "DEFAULT_METHODS", "backtest_store"]
