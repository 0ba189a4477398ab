"""Write checkpoints at target steps: every method is a weighted sum of stored deltas (docs/method.md)."""

from relex.extrapolate.extrapolate import (
    ExtrapolateConfig,
    TargetReport,
    extrapolate_states,
    extrapolate_store,
    materialize_step,
    parse_targets,
)
from relex.extrapolate.methods import METHODS, Plan, get_method

__all__ = ["ExtrapolateConfig", "METHODS", "Plan", "TargetReport", "extrapolate_states", "extrapolate_store", "get_method", "materialize_step", "parse_targets"]
