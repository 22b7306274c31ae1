"""The statistics of evaluation tables (`envs.stats`): every interval inside its quantity's range, never zero-width,
and the paired permutation test of `scipy.stats` giving the p-values of the sign-flip test it replaced."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agents.evaluation import metric_intervals
from envs.stats import (
    bootstrap_interval,
    constant_interval,
    mean_ci,
    paired_difference,
    paired_permutation_p,
    t_interval,
    t_quantile,
    wilson_interval,
)


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706204736), (3, 3.182446305), (30, 2.042272456)])
def test_t_quantile_matches_published_values(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-8)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-8)


def test_intervals_cover_the_mean_shrink_with_n_and_are_seeded():
    rng = np.random.default_rng(0)
    small, large = rng.random(20), rng.random(2000)
    for interval in (t_interval(small), bootstrap_interval(small), mean_ci(large)):
        assert interval.low < interval.mean < interval.high
    assert mean_ci(large).half_width < mean_ci(small).half_width
    assert bootstrap_interval(small, seed=3) == bootstrap_interval(small, seed=3)
    with pytest.raises(ValueError):
        mean_ci([])
    with pytest.raises(ValueError):
        mean_ci([1.0], method="wald")
    with pytest.raises(ValueError, match="lie in"):
        mean_ci([1.5, 0.5])  # a score past its range is a bug upstream, not a number to average


def test_a_rate_gets_wilsons_interval_inside_zero_and_one():
    answered = [1.0] * 98 + [0.0] * 2
    wilson = wilson_interval(answered)
    # Wilson's score interval for 98 of 100 (the textbook values; the unclipped t interval reached 1.008)
    assert (round(wilson.low, 4), round(wilson.high, 4)) == (0.9300, 0.9945)
    assert mean_ci(answered, method="wilson") == wilson and wilson.method == "wilson"
    none = mean_ci([0.0] * 100, method="wilson")  # 0 of 100 is not certain: the interval has width
    assert none.low == 0 and 0.03 < none.high < 0.04
    with pytest.raises(ValueError, match="0 or 1"):
        wilson_interval([0.5, 1.0])


@pytest.mark.parametrize("seed", range(6))
def test_every_interval_stays_in_its_range_and_has_width(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 300))
    # scores piled up at 0 and 1, as F1 and invalid-action shares are (the old t interval left [0, 1] on these)
    scores = np.clip(rng.beta(0.2, 0.2 + 3 * seed, n) * rng.integers(0, 2, n), 0, 1)
    rates = (rng.random(n) < rng.random()).astype(float)
    counts = rng.poisson(0.3, n).astype(float)
    for interval, (low, high) in (
        (mean_ci(scores), (0, 1)),
        (mean_ci(rates, method="wilson"), (0, 1)),
        (mean_ci(counts, method="t"), (0, math.inf)),
        (paired_difference(scores, scores[::-1]), (-1, 1)),
    ):
        assert low <= interval.low <= interval.mean <= interval.high <= high
        assert interval.high > interval.low


def test_the_published_out_of_range_intervals_now_stay_in_range():
    # invalid-action shares: 199 questions without one, one with 0.8 ("0.004 [-0.004, 0.012]" under t)
    shares = mean_ci([0.0] * 199 + [0.8])
    assert shares.low == 0 and shares.high > shares.mean
    # a valid-answer rate over 3 seeds ("0.770 [0.170, 1.370]" under t): clipped to [0, 1]
    seeds = mean_ci([0.5, 0.9, 0.91], method="t", bounds=(0, 1))
    assert seeds.high == 1 and seeds.low > 0
    # searches per question ("0.565 [-1.823, 2.953]" under t): clipped at 0
    assert mean_ci([0, 0, 0, 0, 3], method="t").low == 0


def test_a_constant_sample_gets_the_rule_of_three_not_a_zero_width_interval():
    zeros = mean_ci([0.0] * 200)  # F1 0 on every question
    assert zeros.method == "rule of three" and zeros.low == 0
    assert zeros.high == pytest.approx(1 - 0.025 ** (1 / 200))  # exact binomial bound for 0 of 200, about 3.7/200
    ones = mean_ci([1.0] * 200)
    assert ones.high == 1 and ones.low == pytest.approx(1 - zeros.high)
    same = paired_difference([1.0, 0.0, 1.0], [1.0, 0.0, 1.0])  # two identical systems
    assert same.mean == 0 and same.low < 0 < same.high
    # a count: the exact Poisson interval of the total, divided by n
    searches = metric_intervals([{"num_searches": 1, "answered": 1.0}] * 50, ["num_searches", "answered"])
    assert searches["num_searches"].method == "poisson"
    assert searches["num_searches"].low < 1 < searches["num_searches"].high
    assert searches["answered"].low < 1 == searches["answered"].high
    with pytest.raises(ValueError, match="every value equal"):
        constant_interval([0.0, 1.0])


def test_metric_intervals_name_their_method():
    predictions = [
        {"em": float(i % 2), "f1": (i % 5) / 4, "num_searches": i % 3, "answered": 1.0 - (i % 7 == 0)}
        for i in range(40)
    ]
    intervals = metric_intervals(predictions, ["em", "f1", "num_searches", "answered"])
    assert {name: i.method for name, i in intervals.items()} == {
        "em": "wilson",
        "f1": "bootstrap",
        "num_searches": "t",
        "answered": "wilson",
    }


def _sign_flip_p(a, b, resamples=20_000, seed=0):
    """The hand-written sign-flip test `paired_permutation_p` replaced, kept here as the reference."""
    diff = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    observed = abs(diff.mean())
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(resamples, diff.size))
    flipped = np.abs((signs * diff).mean(axis=1))
    return float((1 + np.count_nonzero(flipped >= observed - 1e-12)) / (resamples + 1))


def test_the_paired_permutation_p_value_matches_the_exact_sign_flip_count():
    # 4 equal positive differences: only "all +" and "all -" of the 16 sign patterns are as extreme (p = 1/8)
    assert paired_permutation_p([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]) == pytest.approx(0.125)
    assert paired_permutation_p([0.3, 0.7], [0.3, 0.7]) == 1.0  # no difference at all
    rng = np.random.default_rng(1)
    base = rng.random(200)
    assert paired_permutation_p(base + 0.1, base + rng.normal(0, 0.05, 200)) < 0.001
    with pytest.raises(ValueError):
        paired_permutation_p([1.0], [1.0, 0.0])


@pytest.mark.parametrize("shift", [0.0, 0.02, 0.04, 0.06, 0.1, 0.2])
def test_scipys_permutation_test_gives_the_hand_written_p_values(shift):
    """Same p-values within Monte Carlo error: both estimate one p from 20,000 random sign patterns, the reference
    as the share of |mean| at least the observed one (standard error sqrt(p (1 - p) / R)), scipy as twice the
    smaller tail's share (standard error 2 sqrt(q (1 - q) / R), q = p / 2), so they differ by a few of those."""
    rng = np.random.default_rng(7)
    a = rng.integers(0, 2, 200).astype(float)  # EM-like, paired with a system `shift` better on average
    b = np.clip(a + (rng.random(200) < 0.3) * rng.choice((-1.0, 1.0), 200) + (rng.random(200) < shift), 0, 1)
    ours, reference = paired_permutation_p(b, a), _sign_flip_p(b, a)
    q = reference / 2
    tolerance = 4.5 * (math.sqrt(reference * (1 - reference) / 20_000) + 2 * math.sqrt(q * (1 - q) / 20_000))
    assert abs(ours - reference) <= tolerance, (ours, reference)


@pytest.mark.parametrize("mu", [0.0, 0.04, 0.08, 0.1, 0.12])
def test_the_p_values_agree_from_no_difference_to_a_clear_one(mu):
    # F1-like scores, paired, with p from about 0.3 down to 0.0006
    rng = np.random.default_rng(7)
    a = rng.random(150)
    b = np.clip(a + rng.normal(mu, 0.3, 150), 0, 1)
    ours, reference = paired_permutation_p(b, a), _sign_flip_p(b, a)
    q = reference / 2
    tolerance = 4.5 * (math.sqrt(reference * (1 - reference) / 20_000) + 2 * math.sqrt(q * (1 - q) / 20_000))
    assert abs(ours - reference) <= tolerance + 2 / 20_000, (ours, reference)
