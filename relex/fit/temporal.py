"""Temporal models of a direction's coefficient c(s) against the real step number s (docs/method.md, "Temporal model").

Each model fits parameters on (steps, coefficients) inside the fit window and predicts ĉ at any step. Parameters
are plain JSON values, so a saved fit extrapolates to new targets without refitting.
"""

from __future__ import annotations

import numpy as np

from relex.errors import RelexError
from relex.registry import Registry

TEMPORAL_MODELS: Registry[type["TemporalModel"]] = Registry("temporal model")


class TemporalModel:
    name = ""
    min_points = 2

    def describe(self) -> dict:
        return {"name": self.name}

    def check_points(self, steps: np.ndarray) -> None:
        distinct = len(set(np.asarray(steps).tolist()))  # a set: np.unique costs 0.2 ms a call, once per tensor
        if distinct < self.min_points:
            raise RelexError(
                f"temporal model {self.name!r} needs at least {self.min_points} distinct observed steps in the fit "
                f"window, got {distinct}"
            )

    def fit(self, steps: np.ndarray, coefficients: np.ndarray) -> dict:
        raise NotImplementedError

    def predict(self, params: dict, steps: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    residual = float(np.sum((observed - predicted) ** 2))
    total = float(np.sum((observed - observed.mean()) ** 2))
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)


@TEMPORAL_MODELS.register("linear")
class Linear(TemporalModel):
    """Ordinary least squares c(s) = a·s + b on the real step numbers (the paper's model)."""

    name = "linear"

    def fit(self, steps, coefficients):
        self.check_points(steps)
        s_mean, c_mean = steps.mean(), coefficients.mean()
        slope = float(np.sum((steps - s_mean) * (coefficients - c_mean)) / np.sum((steps - s_mean) ** 2))
        return {"slope": slope, "intercept": float(c_mean - slope * s_mean)}

    def predict(self, params, steps):
        return params["slope"] * np.asarray(steps, dtype=np.float64) + params["intercept"]


@TEMPORAL_MODELS.register("poly")
class Polynomial(TemporalModel):
    """Least-squares polynomial of a given degree (default 2) in the step number."""

    name = "poly"

    def __init__(self, degree: int = 2):
        if degree < 1:
            raise RelexError(f"polynomial degree must be at least 1, got {degree}")
        self.degree = degree
        self.min_points = degree + 1

    def describe(self) -> dict:
        return {"name": self.name, "degree": self.degree}

    def fit(self, steps, coefficients):
        self.check_points(steps)
        poly = np.polynomial.Polynomial.fit(steps, coefficients, self.degree)
        return {"coef": poly.coef.tolist(), "domain": poly.domain.tolist(), "window": poly.window.tolist()}

    def predict(self, params, steps):
        poly = np.polynomial.Polynomial(params["coef"], domain=params["domain"], window=params["window"])
        return poly(np.asarray(steps, dtype=np.float64))


@TEMPORAL_MODELS.register("robust")
class Robust(TemporalModel):
    """A line fitted with scikit-learn's Huber loss: steps with outlying coefficients pull it less."""

    name = "robust"
    min_points = 3

    def fit(self, steps, coefficients):
        from sklearn.linear_model import HuberRegressor

        self.check_points(steps)
        s_mean, s_scale = steps.mean(), steps.std() or 1.0
        c_scale = np.abs(coefficients).max() or 1.0
        model = HuberRegressor(alpha=0.0, max_iter=1000)
        model.fit(((steps - s_mean) / s_scale)[:, None], coefficients / c_scale)
        slope = float(model.coef_[0]) * c_scale / s_scale
        return {"slope": slope, "intercept": float(model.intercept_ * c_scale - slope * s_mean)}

    def predict(self, params, steps):
        return params["slope"] * np.asarray(steps, dtype=np.float64) + params["intercept"]


def make_temporal(name: str, degree: int | None = None) -> TemporalModel:
    cls = TEMPORAL_MODELS.get(name)
    if name == "poly":
        return cls(degree=degree or 2)
    return cls()
