"""Confidence intervals against known distributions: the t quantile against closed forms,
coverage of the t and bootstrap intervals near 95% on normal and exponential draws, and
the interval-to-verdict rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.stats import (
    Interval,
    bootstrap_interval,
    compare,
    mean_statistic,
    percentile_statistic,
    t_cdf,
    t_interval,
    t_quantile,
)


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_closed_forms(p):
    # df=1 is Cauchy: tan(pi (p - 1/2)); df=2: (2p-1) / sqrt(2p(1-p))
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    # large df tends to the normal quantile (NormalDist is exact to double precision)
    from statistics import NormalDist

    assert t_quantile(p, 1e7) == pytest.approx(NormalDist().inv_cdf(p), rel=1e-5)
    assert t_cdf(t_quantile(p, 4), 4) == pytest.approx(p, abs=1e-12)
    assert t_quantile(1 - p, 7) == pytest.approx(-t_quantile(p, 7), rel=1e-12)


def test_t_interval_of_known_values():
    iv = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = t_quantile(0.975, 4) * math.sqrt(2.5) / math.sqrt(5)
    assert iv.mean == 3.0 and iv.lo == pytest.approx(3 - half) and iv.hi == pytest.approx(3 + half)
    assert iv.num == 5 and iv.num_nan == 0
    one = t_interval([2.0, float("nan")])
    assert one.mean == 2.0 and not one.is_defined and one.num_nan == 1
    assert "no interval" in one.format()


def test_t_interval_covers_the_true_mean_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    num_trials, hits = 4000, 0
    for _ in range(num_trials):
        iv = t_interval(rng.normal(10.0, 3.0, size=5))
        hits += iv.lo <= 10.0 <= iv.hi
    # binomial sd at 4000 trials is 0.34 points: 95 +- 1.5 is > 4 sd
    assert 0.935 <= hits / num_trials <= 0.965


@pytest.mark.parametrize("num_groups", [1, 5])
def test_bootstrap_interval_of_a_percentile_covers_the_true_quantile(num_groups):
    # p90 of 200 exponential(1) draws per run (the true p90 is ln 10): the interval of the
    # mean over runs should cover it ~95% of the time (binomial sd 1.3 points at 300 trials).
    rng = np.random.default_rng(2)
    true = math.log(10.0)
    num_trials, hits = 300, 0
    for trial in range(num_trials):
        groups = [rng.exponential(1.0, size=200) for _ in range(num_groups)]
        iv = bootstrap_interval(groups, percentile_statistic(90), num_resamples=500, seed=trial)
        hits += iv.lo <= true <= iv.hi
    assert 0.91 <= hits / num_trials <= 0.99


def test_bootstrap_is_deterministic_and_skips_empty_groups():
    groups = [[1.0, 2.0, 3.0], [], [2.0, 4.0]]
    a = bootstrap_interval(groups, mean_statistic, seed=3, num_resamples=200)
    b = bootstrap_interval(groups, mean_statistic, seed=3, num_resamples=200)
    assert a == b and a.num == 2 and a.num_nan == 1 and a.lo <= a.mean <= a.hi


def test_verdict_only_when_the_interval_is_on_one_side():
    iv = Interval(0.3, 0.2, 0.4, 5)
    assert compare(iv, 0.1, claimed="above") == "held"
    assert compare(iv, 0.5, claimed="above") == "did not hold"
    assert compare(iv, 0.3, claimed="above") is None
    assert compare(iv, 0.5, claimed="below") == "held"
    assert compare(Interval(0.3, math.nan, math.nan, 1), 0.0, claimed="above") is None
