"""The `accelerate:` section of a train config: how `relex accelerate` alternates GRPO segments with jumps.

    accelerate:
      segment_steps: 4            # m: GRPO optimizer steps per segment (a jump decision after each)
      alphas: [2, 3, 4]           # candidate horizons, as multiples of the segment: target = start + α·m
      scales: [1.0]               # λ: shrink of the displacement predicted beyond the segment's last step
      methods: [relex-anchored]   # the fitted slope carried on from the last real weights (also: relex, two-point)
      rank: 1
      keep: []                    # module types copied from the segment's last step (e.g. ['*norm.weight'])
      validation_size: 64         # problems, disjoint from the train and test problems
      margin: 0.05                # a jump may not be credibly worse than the current weights by more than this
      min_gain: 0.01              # ... and must score at least this much above them (1 problem in 64 is 0.016)
      optimizer: reset            # reset (RL-Extra), keep, or rescale (see relex.accelerate.optimizer)
      warning: {enabled: true, reward_window: 8, min_reward_slope: 0.0, min_r2: 0.5, min_explained_variance: 0.5, min_cosine: 0.0}
      jump: true                  # false: the same loop and validation, never jumping (the plain control run)
      rollback: true              # the segment's start weights are one more candidate (a way back); false: none

Every key is checked here, with one-line errors that say how to fix the input; flags of `relex accelerate`
override the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from relex.errors import RelexError
from relex.extrapolate.methods import METHODS
from relex.settings import load, setting
from relex.util import is_int

OPTIMIZER_POLICIES = ("reset", "keep", "rescale")


@dataclass
class WarningConfig:
    """Thresholds of the early warning that linearity is breaking (relex.accelerate.warning); the R², explained
    variance and cosine are medians over tensors. `warning: false` in a config is short for `enabled: false`."""

    enabled: bool = setting(True, "raise the warning at all")
    reward_window: int = setting(8, "GRPO steps over which the reward's least-squares slope is taken")
    min_reward_slope: float = setting(0.0, "a reward slope at or below it means the reward has stopped rising")
    min_r2: float = setting(0.5, "the segment fit's temporal R² below which linearity is breaking")
    min_explained_variance: float = setting(0.5, "the segment fit's rank-1 explained variance below which it is")
    min_cosine: float = setting(0.0, "cosine between this segment's displacement and the previous one's (drift)")

    def __post_init__(self) -> None:
        if not is_int(self.reward_window) or self.reward_window < 2:
            raise RelexError(f"accelerate.warning.reward_window: expected an integer ≥ 2, got {self.reward_window!r}")
        for key in ("min_reward_slope", "min_r2", "min_explained_variance", "min_cosine"):
            if not _is_number(getattr(self, key)):
                raise RelexError(f"accelerate.warning.{key}: expected a number, got {getattr(self, key)!r}")


def warning_shorthand(value: Any) -> Any:
    """`warning: false` is short for `warning: {enabled: false}`."""
    return {"enabled": False} if value is False else value


@dataclass
class AccelerateConfig:
    segment_steps: int = setting(4, "m: GRPO optimizer steps per segment (a jump decision after each)")
    # the slow-regime study (analysis/README.md, section 5c): with candidates at 1.5-3x by relex-anchored and relex
    # no jump passed the guard; at 2-4x by relex-anchored alone the runs jumped to 4x in all three seeds, and 7 of
    # the 9 jumps of sections 5-5b were relex-anchored's. Three candidates also cost half the
    # validation of six and weaken the winner's curse of the pick.
    alphas: list[float] = setting(
        help="candidate horizons as multiples of the segment, each > 1: target = start + α·m",
        factory=lambda: [2.0, 3.0, 4.0],
    )
    scales: list[float] = setting(
        help="λ: shrink of the displacement predicted beyond the segment's last step, each > 0", factory=lambda: [1.0]
    )
    methods: list[str] = setting(
        help="extrapolation methods of the candidates (relex-anchored, relex, two-point, per-param)",
        factory=lambda: ["relex-anchored"],
    )
    rank: int = setting(1, "directions per tensor of the segment fit")
    keep: list[str] = setting(
        help="module types copied from the segment's last step instead of extrapolated, e.g. '*norm.weight'",
        factory=list,
    )
    validation_size: int = setting(64, "validation problems, disjoint from the train and test problems")
    # the GPU study (analysis/README.md, section 5): picking the best of several candidates on the problems that
    # then judge it overstates its gain (the winner's curse); a second, fresh set judges the one picked
    confirm_size: int = setting(
        64, "fresh validation problems on which the picked candidate must pass the guard again (0: no confirmation)"
    )
    margin: float = setting(0.05, "a jump may not be credibly worse than the current weights by more than this")
    # the study (analysis/README.md, section 5): a jump whose validation score equalled the current weights' cost
    # 0.040 [0.003, 0.077] held-out accuracy, and resetting the optimizer after a jump ended 0.043 above keeping it
    min_gain: float = setting(0.01, "validation gain a jump needs over the current weights (1 problem in 64: 0.016)")
    optimizer: str = setting("reset", f"optimizer state after a jump: {', '.join(OPTIMIZER_POLICIES)}")
    warning: WarningConfig = setting(
        help="the early warning that linearity is breaking", factory=WarningConfig, parse=warning_shorthand
    )
    jump: bool = setting(True, "jump where the guard allows; false (--no-jump): the same loop and validation, never jumping (the plain control)")
    rollback: bool = setting(
        True, "offer the weights the segment started from (the last decision's) as one more candidate: picked by the "
        "same guard, taken only if the confirmation problems put its gain above zero (analysis/README.md, 5e)"
    )
    keep_candidates: bool = setting(
        False, "write every candidate as a checkpoint folder and keep it (default: formed in memory, only scores kept)"
    )
    batch_size: int = setting(64, "validation generation batch")
    max_new_tokens: int | None = setting(None, "validation completion length (default: grpo.max_completion_length)")

    def __post_init__(self) -> None:
        if not is_int(self.segment_steps) or self.segment_steps < 2:
            raise RelexError(
                f"accelerate.segment_steps: {self.segment_steps!r}; a segment needs at least 2 GRPO steps to fit a line"
            )
        self.alphas = _numbers(self.alphas, "alphas")
        if any(a <= 1 for a in self.alphas):
            raise RelexError(f"accelerate.alphas {self.alphas}: each α must be > 1 (α = 1 is the segment's own end)")
        self.scales = _numbers(self.scales, "scales")
        if any(s <= 0 for s in self.scales):
            raise RelexError(f"accelerate.scales {self.scales}: each λ must be > 0 (λ = 1 keeps the prediction)")
        if not isinstance(self.methods, list) or not self.methods:
            raise RelexError("accelerate.methods: give one or more extrapolation methods, e.g. [relex-anchored, relex]")
        for name in self.methods:
            METHODS.get(name)  # an unknown name fails with the valid ones
            if name in ("observed", "reconstruct"):
                raise RelexError(f"accelerate.methods: {name!r} does not extrapolate; use relex, relex-anchored, two-point or per-param")
        if not is_int(self.rank) or self.rank < 1 or self.rank > self.segment_steps:
            raise RelexError(f"accelerate.rank: expected an integer from 1 to segment_steps ({self.segment_steps}), got {self.rank!r}")
        if isinstance(self.keep, str):
            self.keep = [p.strip() for p in self.keep.split(",") if p.strip()]
        if not isinstance(self.keep, list) or not all(isinstance(p, str) and p for p in self.keep):
            raise RelexError(f"accelerate.keep: expected a list of module-type patterns, got {self.keep!r}")
        if not is_int(self.validation_size) or self.validation_size < 1:
            raise RelexError(f"accelerate.validation_size: {self.validation_size!r}: the validation split is empty; the guard needs at least one problem")
        if not _is_number(self.margin) or self.margin < 0 or not _is_number(self.min_gain):
            raise RelexError(f"accelerate.margin {self.margin!r}, min_gain {self.min_gain!r}: expected numbers, margin ≥ 0")
        if not is_int(self.confirm_size) or self.confirm_size < 0:
            raise RelexError(f"accelerate.confirm_size: expected a non-negative integer, got {self.confirm_size!r}")
        for key in ("validation_size", "confirm_size"):
            size = getattr(self, key)
            if size and self.margin > 0 and size * self.margin < 1:
                raise RelexError(
                    f"accelerate.{key} {size} cannot resolve margin {self.margin}: one problem moves the accuracy by "
                    f"{1 / size:.3f}; use at least {_ceil(1 / self.margin)} problems or a larger margin"
                )
        if self.optimizer not in OPTIMIZER_POLICIES:
            raise RelexError(f"accelerate.optimizer: unknown policy {self.optimizer!r}; valid: {', '.join(OPTIMIZER_POLICIES)}")
        if not isinstance(self.warning, WarningConfig):
            raise RelexError(f"accelerate.warning: expected a WarningConfig, got {self.warning!r}")
        for key in ("jump", "rollback", "keep_candidates"):
            if not isinstance(getattr(self, key), bool):
                raise RelexError(f"accelerate.{key}: expected true or false, got {getattr(self, key)!r}")
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise RelexError(f"accelerate.batch_size: expected a positive integer, got {self.batch_size!r}")
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise RelexError(f"accelerate.max_new_tokens: expected a positive integer, got {self.max_new_tokens!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "AccelerateConfig":
        """The `accelerate:` section (None: every default), its keys and the `warning` section's checked."""
        return load(cls, data, "accelerate")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _numbers(values: Any, key: str) -> list[float]:
    if _is_number(values):
        values = [values]
    if not isinstance(values, list) or not values or not all(_is_number(v) for v in values):
        raise RelexError(f"accelerate.{key}: expected a list of numbers, got {values!r}")
    return [float(v) for v in values]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _ceil(value: float) -> int:
    return int(-(-value // 1))
