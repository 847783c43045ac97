"""Statistics for ``attnquant bench``: ratio of means with a bootstrap confidence interval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

__all__ = ["RatioEstimate", "ratio_of_means"]


@dataclass(frozen=True)
class RatioEstimate:
    """``mean(theta) / mean(base)`` with a bootstrap confidence interval."""

    ratio: float
    low: float
    high: float
    confidence: float

    def verdict(self, gate: float) -> str:
        """ "pass" / "fail" on the point estimate, qualified by where the interval lies."""
        if self.ratio < gate:
            return "fail"
        return "pass" if self.low >= gate else "pass (interval reaches below the gate)"

    def to_json(self) -> dict:
        return {
            "ratio": self.ratio,
            "ci_low": self.low,
            "ci_high": self.high,
            "confidence": self.confidence,
        }


def ratio_of_means(
    theta: Sequence[float],
    base: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> RatioEstimate:
    """Ratio of the two samples' means, with a percentile bootstrap interval.

    The two samples are resampled independently (``scipy.stats.bootstrap`` with two samples,
    unpaired), which is right for interleaved runs of two models whose noise is not shared
    run by run. Seeded, so the same measurements give the same interval.
    """
    t = np.asarray(theta, dtype=np.float64)
    b = np.asarray(base, dtype=np.float64)
    if t.size < 2 or b.size < 2:
        raise ValueError("a bootstrap interval needs at least 2 measurements on each side")

    def stat(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean(x, axis=axis) / np.mean(y, axis=axis)

    res = scipy.stats.bootstrap(
        (t, b),
        stat,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return RatioEstimate(
        ratio=float(stat(t, b)),
        low=float(res.confidence_interval.low),
        high=float(res.confidence_interval.high),
        confidence=confidence,
    )
