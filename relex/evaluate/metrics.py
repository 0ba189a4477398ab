"""Accuracy statistics over per-problem verdicts: bootstrap intervals, unbiased pass@k and majority vote.

Pure functions of numbers (numpy only), so they are tested against hand computations:

    low, high = bootstrap_ci(correct)                   # 95% percentile bootstrap of the mean
    diff, low, high = paired_bootstrap_diff(b, a)       # mean(b) - mean(a), resampling problems jointly
    mean_pass_at_k(correct_counts, n=16, k=4)           # Chen et al. (2021), averaged over problems
    majority_vote(["3", "4", "3", None])                # "3"
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

import numpy as np


def _as_scores(scores: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what}: need a non-empty 1-d sequence of scores, got shape {array.shape}")
    return array


def _bootstrap_means(values: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Means of `n_boot` resamples (with replacement) of `values`; rows of a 2-d array are resampled jointly."""
    rng = np.random.default_rng(seed)
    n = values.shape[0]
    means = np.empty((n_boot,) + values.shape[1:])
    chunk = max(1, 2**22 // n)  # bounds the index matrix at about 32 MiB for large problem sets
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        index = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = values[index].mean(axis=1)
    return means


def _percentiles(samples: np.ndarray, alpha: float) -> tuple[float, float]:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    low, high = np.quantile(samples, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def bootstrap_ci(
    scores: Sequence[float], n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> tuple[float, float]:
    """(low, high): the percentile bootstrap interval of the mean of `scores` at level 1 - alpha."""
    values = _as_scores(scores, "bootstrap_ci")
    return _percentiles(_bootstrap_means(values, n_boot, seed), alpha)


def paired_bootstrap_diff(
    a: Sequence[float], b: Sequence[float], n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high), resampling the problems jointly: a[i] and b[i] score the same problem."""
    first, second = _as_scores(a, "paired_bootstrap_diff a"), _as_scores(b, "paired_bootstrap_diff b")
    if first.shape != second.shape:
        raise ValueError(f"paired_bootstrap_diff: {first.size} scores against {second.size}; they must pair up")
    means = _bootstrap_means(np.stack([first, second], axis=1), n_boot, seed)
    low, high = _percentiles(means[:, 0] - means[:, 1], alpha)
    return float(first.mean() - second.mean()), low, high


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): a product of factors in [0, 1], stable for large n
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each with `correct_counts[i]` correct out of `n` samples."""
    if len(correct_counts) == 0:
        raise ValueError("mean_pass_at_k: no problems")
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct_counts]))


def pass_at_k_values(samples: int) -> list[int]:
    """The k reported for `samples` samples per problem: the powers of two below it, and `samples` itself."""
    ks = [2**i for i in range(samples.bit_length()) if 2**i < samples]
    return ks + [samples]


def majority_vote(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most frequent answer, ignoring None; a tie goes to the answer that appeared first. None if none voted."""
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return None
    return max(votes, key=votes.__getitem__)  # Counter keeps first-seen order and max keeps the first maximum
