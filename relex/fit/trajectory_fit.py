"""The rank-r fit of one tensor's trajectory, computed from its Gram matrix alone (docs/method.md).

From G = U Λ Uᵀ: σⱼ = √λⱼ, coefficients C = U Σ, explained variance Σ_{j≤r} λⱼ / Σ λⱼ, and a temporal model per
direction fitted on the window's rows of C. A prediction is a weight vector over the observed steps,
wᵢ = Σⱼ ĉⱼ u_{ij} / σⱼ, so Δ̂ = Σᵢ wᵢ Δᵢ needs the stored deltas only once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from relex.fit.temporal import TemporalModel, r_squared

# eigenvalues below this fraction of the largest are numerical zeros, not directions
RELATIVE_EIGEN_FLOOR = 1e-12


@dataclass
class TensorFit:
    name: str
    steps: np.ndarray  # observed steps, length T
    window: np.ndarray  # indices (into steps) of the rows the temporal model saw
    eigenvalues: np.ndarray  # all T, descending
    u: np.ndarray  # T × r left vectors, signs chosen so the last window coefficient is ≥ 0
    temporal: list[dict] = field(default_factory=list)  # parameters per direction
    r2: list[float] = field(default_factory=list)  # temporal R² per direction on the window

    @property
    def rank(self) -> int:
        return self.u.shape[1]

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    @property
    def sigma(self) -> np.ndarray:
        return np.sqrt(np.maximum(self.eigenvalues[: self.rank], 0.0))

    @property
    def coefficients(self) -> np.ndarray:
        """C = U Σ: the projection of each observed delta on each direction (T × r)."""
        return self.u * self.sigma

    def explained_variance(self, rank: int | None = None) -> float:
        total = float(np.sum(np.maximum(self.eigenvalues, 0.0)))
        if total == 0:
            return 1.0
        r = self.rank if rank is None else rank
        return float(np.sum(np.maximum(self.eigenvalues[:r], 0.0)) / total)

    def predicted_coefficients(self, model: TemporalModel, targets: np.ndarray) -> np.ndarray:
        """ĉ (len(targets) × r)."""
        return np.stack([model.predict(p, targets) for p in self.temporal], axis=1) if self.rank else np.zeros((len(targets), 0))

    def extrapolation_weights(self, model: TemporalModel, targets: np.ndarray) -> np.ndarray:
        """w (len(targets) × T) with Δ̂(s*) = Σᵢ wᵢ Δᵢ."""
        if self.is_zero:
            return np.zeros((len(targets), len(self.steps)))
        return self.predicted_coefficients(model, targets) @ (self.u / self.sigma).T

    def reconstruction_weights(self, observed_index: int) -> np.ndarray:
        """w = U_r U_rᵀ e_m: the rank-r projection of observed step m."""
        return self.u @ self.u[observed_index]


def fit_tensor(name: str, steps: np.ndarray, gram: np.ndarray, rank: int, model: TemporalModel, window: np.ndarray) -> TensorFit:
    eigenvalues, vectors = np.linalg.eigh(gram)
    order = np.argsort(eigenvalues)[::-1]
    eigenvalues, vectors = eigenvalues[order], vectors[:, order]
    floor = max(eigenvalues[0], 0.0) * RELATIVE_EIGEN_FLOOR
    effective = int(min(rank, np.sum(eigenvalues > floor))) if eigenvalues[0] > 0 else 0
    u = vectors[:, :effective].copy()
    last = window[-1]
    u *= np.where(u[last] < 0, -1.0, 1.0)  # the sign of uⱼ is arbitrary; make the latest coefficient positive
    fit = TensorFit(name, steps, window, eigenvalues, u)
    s = steps[window].astype(np.float64)
    for c in fit.coefficients[window].T:
        params = model.fit(s, c)
        fit.temporal.append(params)
        fit.r2.append(r_squared(c, model.predict(params, s)))
    return fit
