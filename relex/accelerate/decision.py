"""The guard of a jump: score candidates and the current weights on the same validation problems, paired.

The best candidate (highest validation accuracy; a tie goes to the farther target) is taken only when

    mean(candidate − current) ≥ min_gain   and   the paired 95% interval's lower end ≥ −margin,

that is, when it scores at least `min_gain` above the current weights and the validation problems rule out a loss
larger than `margin` (a non-inferiority test on paired problems). Otherwise the run keeps its weights and trains on.

The best of several candidates, judged on the problems that picked it, looks better than it is (the winner's
curse: its gain is the largest of several noisy gains). `confirm` judges the picked candidate once more, by the
same rule, on fresh problems that took no part in picking it; only then does the run jump.

A rollback (the weights the segment started from, offered unless `rollback: false`) undoes real GRPO steps, which on
average improve the policy, so "no worse" is not enough for it: it is picked by the same rule, but on the fresh
confirmation problems its paired interval must lie above zero (a credible loss since the segment started, not a
tie). Without confirmation problems (confirm_size 0) that test falls on the validation problems instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from relex.evaluate.metrics import paired_bootstrap_diff

ROLLBACK = "rollback"  # the candidate that goes back to the weights the segment started from


@dataclass
class Candidate:
    """One candidate checkpoint of a jump: which method, horizon and shrink made it, and how it scored."""

    method: str
    alpha: float  # target = start + α × segment length, in GRPO steps
    scale: float  # λ
    target: int  # the GRPO-step equivalent of the candidate
    path: Path | None = None  # its folder, when candidates are written (keep_candidates)
    weights: dict | None = field(default=None, repr=False)  # its tensors, when formed in memory
    accuracy: float | None = None
    correct: list[float] = field(default_factory=list, repr=False)
    diff: float | None = None  # paired difference against the current weights
    ci_low: float | None = None
    ci_high: float | None = None

    @property
    def source(self):
        """What the scorer loads: the tensors in memory, else the folder."""
        return self.weights if self.weights is not None else self.path

    @property
    def is_rollback(self) -> bool:
        return self.method == ROLLBACK

    @property
    def name(self) -> str:
        if self.is_rollback:
            return f"{ROLLBACK} to step {self.target}"
        return f"{self.method} α={self.alpha:g} λ={self.scale:g}"

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("correct")
        out.pop("weights")
        out["path"] = None if self.path is None else str(self.path)
        out["name"] = self.name
        return out


@dataclass
class Decision:
    jump: bool
    chosen: Candidate | None
    reason: str


def compare(candidates: list[Candidate], current: list[float], seed: int = 0) -> None:
    """Each candidate's paired difference against the current weights, with its 95% bootstrap interval."""
    for candidate in candidates:
        candidate.diff, candidate.ci_low, candidate.ci_high = paired_bootstrap_diff(candidate.correct, current, seed=seed)


def decide(candidates: list[Candidate], current: list[float], *, margin: float, min_gain: float, seed: int = 0,
           confirmation_follows: bool = True) -> Decision:
    """The guard: the best candidate if it is credibly no worse than `margin` and gains at least `min_gain`.
    `confirmation_follows`: fresh problems will judge the pick again (`confirm`); if not, a rollback's interval
    must lie above zero here."""
    if not candidates:
        return Decision(False, None, "no candidate")
    compare(candidates, current, seed)
    best = max(candidates, key=lambda c: (c.accuracy, c.target))
    jump, verdict = rule(best.diff, best.ci_low, best.ci_high, margin=margin, min_gain=min_gain,
                         above_zero=best.is_rollback and not confirmation_follows)
    return Decision(jump, best, f"{best.name} {verdict}" if jump else f"best candidate ({best.name}) {verdict}")


def rule(diff: float, low: float, high: float, *, margin: float, min_gain: float, above_zero: bool = False) -> tuple[bool, str]:
    """The guard's rule on a paired difference and its 95% interval: (pass?, what it found). `above_zero`: the
    interval must also lie above zero (a rollback's rule)."""
    if diff < min_gain:
        return False, f"gains {diff:+.3f} < {min_gain:+.3f}"
    if above_zero and low <= 0:
        return False, f"gains {diff:+.3f} but its interval [{low:+.3f}, {high:+.3f}] reaches zero; a rollback must lie above it"
    if low < -margin:
        return False, f"may lose up to {-low:.3f} > margin {margin:.3f}"
    return True, f"gains {diff:+.3f} [{low:+.3f}, {high:+.3f}]"


@dataclass
class Confirmation:
    """The picked candidate against the current weights on the fresh confirmation problems."""

    n: int
    accuracy: float
    current_accuracy: float
    diff: float
    ci_low: float
    ci_high: float
    jump: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def confirm(chosen: Candidate, correct: list[float], current: list[float], *, margin: float, min_gain: float,
            seed: int = 0) -> Confirmation:
    """The guard's rule once more, on problems that took no part in picking `chosen`."""
    diff, low, high = paired_bootstrap_diff(correct, current, seed=seed)
    jump, verdict = rule(diff, low, high, margin=margin, min_gain=min_gain, above_zero=chosen.is_rollback)
    return Confirmation(len(current), float(sum(correct) / len(correct)), float(sum(current) / len(current)),
                        diff, low, high, jump, f"{verdict} on {len(current)} fresh problems")
