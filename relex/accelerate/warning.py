"""The early warning that linearity is breaking, from what a run already records.

Extrapolation holds while the reward still rises and fails once it plateaus (relex sweep on the study run; the
RELEX replication's plateaued tasks), so the loop stops jumping when any of these signals says so:

- the reward's least-squares slope over the last k GRPO steps is at or below `min_reward_slope` (a plateau);
- the segment's rank-1 fit explains less than `min_explained_variance` of its deltas (median over tensors), or its
  temporal R² falls below `min_r2`: the segment is not a line;
- the median cosine between this segment's displacement and the previous segment's falls below `min_cosine`:
  the direction drifts.

`relex train` logs the reward signal on every step (`reward_slope` in log.jsonl); `relex accelerate` checks all
three at every jump decision and records them with the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from relex.train.progress import reward_slope

__all__ = ["Signals", "check", "fit_signals", "reward_slope"]


@dataclass
class Signals:
    """What the warning looked at for one decision; None where it could not be measured yet."""

    reward_slope: float | None = None
    explained_variance: float | None = None  # median over tensors of the rank-1 share of the segment's deltas
    r2: float | None = None  # median temporal R² of direction 1
    cosine: float | None = None  # median cosine with the previous segment's displacement
    reasons: list[str] = field(default_factory=list)

    @property
    def raised(self) -> bool:
        return bool(self.reasons)

    def to_dict(self) -> dict:
        return {"reward_slope": self.reward_slope, "explained_variance": self.explained_variance, "r2": self.r2,
                "cosine": self.cosine, "raised": self.raised, "reasons": list(self.reasons)}


def check(signals: Signals, config) -> Signals:
    """Fill `signals.reasons` from the thresholds of a `WarningConfig`."""
    tests = [
        ("reward_slope", config.min_reward_slope, "the reward stopped rising (slope {:.4f} per step ≤ {})", True),
        ("explained_variance", config.min_explained_variance, "the segment is not a line (rank-1 share {:.3f} < {})", False),
        ("r2", config.min_r2, "the coefficient does not grow linearly (R² {:.3f} < {})", False),
        ("cosine", config.min_cosine, "the direction drifted (cosine with the previous segment {:.3f} < {})", False),
    ]
    signals.reasons = []
    if not config.enabled:
        return signals
    for key, threshold, text, inclusive in tests:
        value = getattr(signals, key)
        if value is not None and (value <= threshold if inclusive else value < threshold):
            signals.reasons.append(text.format(value, threshold))
    return signals


def fit_signals(fit) -> tuple[float | None, float | None]:
    """(median rank-1 explained variance, median temporal R² of direction 1) over the fitted tensors."""
    rows = fit.rows()
    if not rows:
        return None, None
    r2 = [row["r2_direction1"] for row in rows if row["r2_direction1"] == row["r2_direction1"]]
    return median(row["explained_variance_rank1"] for row in rows), (median(r2) if r2 else None)
