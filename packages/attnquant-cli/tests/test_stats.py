"""The bootstrap ratio of ``attnquant bench`` on samples whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from attnquant_cli._stats import RatioEstimate, ratio_of_means


def test_point_estimate_is_the_ratio_of_means():
    est = ratio_of_means([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert est.ratio == pytest.approx(2.0)
    assert est.low <= 2.0 <= est.high


def test_same_distribution_interval_contains_one():
    rng = np.random.default_rng(0)
    est = ratio_of_means(rng.normal(100, 5, 30), rng.normal(100, 5, 30))
    assert est.low < 1.0 < est.high
    assert est.high - est.low < 0.1


def test_interval_covers_the_true_ratio_and_narrows_with_more_runs():
    rng = np.random.default_rng(1)
    widths = []
    for n in (10, 100, 1000):
        est = ratio_of_means(rng.normal(80, 4, n), rng.normal(100, 4, n))
        assert est.low < 0.8 < est.high
        widths.append(est.high - est.low)
    assert widths[0] > widths[1] > widths[2]


def test_coverage_is_near_nominal():
    # 200 experiments of 20 runs each: a 95% interval should cover the truth about 95% of the time.
    rng = np.random.default_rng(2)
    hits = 0
    for i in range(200):
        est = ratio_of_means(rng.normal(90, 6, 20), rng.normal(100, 6, 20), n_resamples=999, seed=i)
        hits += est.low <= 0.9 <= est.high
    assert 0.88 <= hits / 200 <= 0.99


def test_seeded_and_deterministic():
    a, b = [1.0, 1.1, 0.9, 1.05], [1.0, 0.95, 1.02, 0.99]
    assert ratio_of_means(a, b) == ratio_of_means(a, b)


def test_needs_two_runs_each():
    with pytest.raises(ValueError, match="at least 2"):
        ratio_of_means([1.0], [1.0, 2.0])


@pytest.mark.parametrize(
    ("est", "verdict"),
    [
        (RatioEstimate(0.9, 0.85, 0.95, 0.95), "pass"),
        (RatioEstimate(0.82, 0.7, 0.9, 0.95), "pass (interval reaches below the gate)"),
        (RatioEstimate(0.7, 0.6, 0.85, 0.95), "fail"),
    ],
)
def test_verdict_against_the_gate(est, verdict):
    assert est.verdict(0.8) == verdict
