"""Extrapolation methods: each turns target steps into weights over the observed deltas (docs/method.md).

Every method predicts Δ̂(s*) = Σᵢ wᵢ Δᵢ, so a method is just `weights(plan, targets, fit) -> (targets × T)`;
the streaming pass that applies the weights is shared (relex.extrapolate.extrapolate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relex.errors import RelexError
from relex.fit.temporal import TemporalModel
from relex.fit.trajectory_fit import TensorFit
from relex.registry import Registry

METHODS: Registry["Method"] = Registry("method")


@dataclass
class Plan:
    """What the methods share for one run: the observed steps, the fit window and the options."""

    steps: np.ndarray  # observed steps (T)
    window: np.ndarray  # indices into steps that the temporal model / line fits see
    model: TemporalModel | None = None
    anchors: tuple[int, int] | None = None  # two-point: (a, b), a = 0 meaning the base

    @property
    def window_steps(self) -> np.ndarray:
        return self.steps[self.window]

    def index_of(self, step: int) -> int:
        hits = np.flatnonzero(self.steps == step)
        if not len(hits):
            raise RelexError(f"step {step} is not an observed step; observed: {self.steps.tolist()}")
        return int(hits[0])


def horizon_ratio(target: int, last_observed: int) -> float:
    """How far past the data a target lies, the same for every method: target / last observed step.

    Both are counted from the base (step 0), as RLVR horizons are reported: 2.0 means twice the observed run, and a
    ratio ≤ 1 is a target inside the observed steps (interpolation).
    """
    return float(target / last_observed)


class Method:
    name = ""
    needs_fit = False  # needs the rank-r fit (the Gram pass)
    extrapolates = True  # targets past the window are extrapolation; inside it, interpolation

    def anchors(self, plan: Plan) -> tuple[int, int] | None:
        """The two steps the method draws its line through (two-point), or None."""
        return None

    def check(self, plan: Plan, targets: list[int]) -> None:
        """Raise for targets or options this method cannot serve (before any data is read)."""

    def horizon_ratio(self, plan: Plan, target: int) -> float:
        return horizon_ratio(target, int(plan.steps[-1]))

    def weights(self, plan: Plan, targets: np.ndarray, fit: TensorFit | None) -> np.ndarray:
        raise NotImplementedError


@METHODS.register("relex")
class RankRExtrapolation(Method):
    """Rank-r directions with a temporal model of their coefficients: wᵢ = Σⱼ ĉⱼ u_{ij} / σⱼ."""

    name = "relex"
    needs_fit = True

    def weights(self, plan, targets, fit):
        return fit.extrapolation_weights(plan.model, targets)


@METHODS.register("relex-anchored")
class AnchoredExtrapolation(Method):
    """The fitted rank-r slope carried on from the last observed checkpoint itself:
    Δ̂(s*) = Δ_last + (ĉ(s*) − ĉ(s_last)) V, so w = e_last + w_relex(s*) − w_relex(s_last).

    The regression line of `relex` need not pass through the last real checkpoint; this one does, which is what
    a train → jump → train loop wants (it continues from where training actually is)."""

    name = "relex-anchored"
    needs_fit = True

    def weights(self, plan, targets, fit):
        last_index = int(plan.window[-1])
        last = np.eye(len(plan.steps))[last_index]
        if fit.is_zero:
            return np.tile(last, (len(targets), 1))
        at_last = fit.extrapolation_weights(plan.model, np.asarray([plan.steps[last_index]]))
        return last + fit.extrapolation_weights(plan.model, np.asarray(targets)) - at_last


@METHODS.register("reconstruct")
class Reconstruction(Method):
    """The oracle rank-r projection of an observed step: w = U_r U_rᵀ e_m."""

    name = "reconstruct"
    needs_fit = True
    extrapolates = False

    def check(self, plan, targets):
        for target in targets:
            plan.index_of(target)

    def weights(self, plan, targets, fit):
        if fit.is_zero:
            return np.zeros((len(targets), len(plan.steps)))
        return np.stack([fit.reconstruction_weights(plan.index_of(int(t))) for t in targets])


@METHODS.register("observed")
class Observed(Method):
    """The real checkpoint at an observed step (w = e_m): evaluates recorded steps without a separate copy."""

    name = "observed"
    extrapolates = False

    def check(self, plan, targets):
        for target in targets:
            plan.index_of(target)

    def weights(self, plan, targets, fit):
        return np.eye(len(plan.steps))[[plan.index_of(int(t)) for t in targets]]


@METHODS.register("two-point")
class TwoPoint(Method):
    """ExPO-style line through two checkpoints: θ_a + α(θ_b − θ_a), α = (s* − s_a)/(s_b − s_a); a = 0 is the base."""

    name = "two-point"

    def anchors(self, plan: Plan) -> tuple[int, int]:
        return plan.anchors or (0, int(plan.window_steps[-1]))

    def check(self, plan, targets):
        a, b = self.anchors(plan)
        if a >= b:
            raise RelexError(f"two-point anchors must satisfy a < b, got a={a}, b={b}")
        for anchor in (a, b):
            if anchor != 0:
                plan.index_of(anchor)

    def weights(self, plan, targets, fit):
        a, b = self.anchors(plan)
        alpha = (np.asarray(targets, dtype=np.float64) - a) / (b - a)
        w = np.zeros((len(targets), len(plan.steps)))
        w[:, plan.index_of(b)] += alpha
        if a != 0:
            w[:, plan.index_of(a)] += 1.0 - alpha
        return w


@METHODS.register("per-param")
class PerParameterLine(Method):
    """Each number's own least-squares line over the window: wᵢ = 1/n + (s* − s̄)(sᵢ − s̄)/Σ(sᵢ − s̄)²."""

    name = "per-param"

    def check(self, plan, targets):
        if len(np.unique(plan.window_steps)) < 2:
            raise RelexError("per-param needs at least 2 distinct observed steps in the window")

    def weights(self, plan, targets, fit):
        s = plan.window_steps.astype(np.float64)
        centred = s - s.mean()
        t = np.asarray(targets, dtype=np.float64)[:, None]
        w = np.zeros((len(targets), len(plan.steps)))
        w[:, plan.window] = 1.0 / len(s) + (t - s.mean()) * centred / np.sum(centred**2)
        return w


def get_method(name: str) -> Method:
    return METHODS.get(name)()


# ---- options that apply to every method ----------------------------------------------------------------------------
def scaled_weights(plan: Plan, targets: np.ndarray, w: np.ndarray, scale: float) -> np.ndarray:
    """Shrink (λ < 1) or stretch the predicted displacement beyond the last observed step of the window:
    Δ̂_λ(s*) = Δ_last + λ (Δ̂(s*) − Δ_last) for s* past it; targets inside the window are left alone."""
    if scale == 1.0:
        return w
    last_index = int(plan.window[-1])
    last = np.eye(len(plan.steps))[last_index]
    beyond = np.asarray(targets) > plan.steps[last_index]
    out = w.copy()
    out[beyond] = last + scale * (w[beyond] - last)
    return out


def kept_weights(plan: Plan, count: int) -> np.ndarray:
    """`--keep`: the tensor is copied from the last observed step of the window for every target (w = e_last)."""
    return np.tile(np.eye(len(plan.steps))[int(plan.window[-1])], (count, 1))


def check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or scale != scale:
        raise RelexError(f"--scale {scale!r}: give a positive number (1 leaves the prediction as it is, 0.5 halves "
                         "the displacement beyond the last observed step)")
    return float(scale)
