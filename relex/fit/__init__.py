"""Fit each tensor's rank-r trajectory direction and its growth in the step number (docs/method.md)."""

from relex.fit.fit import (
    FitConfig,
    FitResult,
    fit_from_grams,
    fit_store,
    module_type,
    refit,
)
from relex.fit.temporal import TEMPORAL_MODELS

__all__ = ["FitConfig", "FitResult", "TEMPORAL_MODELS", "fit_from_grams", "fit_store", "module_type", "refit"]
