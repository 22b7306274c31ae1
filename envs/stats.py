"""Means with 95% confidence intervals and paired tests: the statistics of evaluation tables.

Two intervals for the mean of per-question scores (EM, F1, searches, ...):

* `t_interval`: Student's t interval, mean +- t_{(1+c)/2, n-1} * s / sqrt(n). The default: per-question
  metrics are bounded, and at the sizes benchmarks use (n >= 100) the central limit theorem makes it accurate.
* `bootstrap_interval`: percentile bootstrap over questions (seeded); no normality assumption, for small
  or very skewed samples.
* `wilson_interval`: Wilson's score interval for a rate (every value 0 or 1: EM, valid answers). Unlike the t
  interval it stays inside [0, 1] and is not zero-width at 0% or 100%.

`mean_ci` picks one by name (`method`); an evaluation's metrics take Wilson's for the rates
(`agents.evaluation.RATES`) and t for the rest.

`paired_difference` gives the interval of a mean difference between two systems scored on the same questions
(paired by question), much tighter than two separate intervals; `paired_permutation_p` is its two-sided p-value
under "no difference" (random sign flips of the per-question differences), which needs no normality.

The evaluations (`agents.evaluation`, `algos.evaluation`) and the benchmark scripts take their intervals from
here. Plain NumPy (SciPy for t quantiles, imported when first needed), no torch, below every layer that uses it.

    from envs.stats import mean_ci
    ci = mean_ci([0.0, 1.0, 0.5, 1.0])
    print(ci)             # 0.625 [-0.136, 1.386] (n=4)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

__all__ = [
    "Interval",
    "bootstrap_interval",
    "mean_ci",
    "paired_difference",
    "paired_permutation_p",
    "t_interval",
    "t_quantile",
    "wilson_interval",
]


@dataclass(frozen=True)
class Interval:
    """A sample mean and its confidence interval."""

    mean: float
    """Sample mean."""
    low: float
    """Lower end of the interval."""
    high: float
    """Upper end of the interval."""
    n: int
    """Sample size."""
    confidence: float = 0.95
    """Coverage the interval aims for."""

    @property
    def half_width(self) -> float:
        """Half the interval's width (the +- of a symmetric interval)."""
        return (self.high - self.low) / 2

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready `{"mean", "low", "high", "n"}`."""
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}

    def format(self, digits: int = 3) -> str:
        """`mean [low, high]` with `digits` decimals."""
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def __str__(self) -> str:
        return f"{self.format(2 if abs(self.mean) >= 10 else 3)} (n={self.n})"


def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t distribution with `df` degrees of freedom (`scipy.stats.t.ppf`).

    Args:
        p: probability in (0, 1).
        df: degrees of freedom, >= 1.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    from scipy import stats  # imported here: scipy.stats takes a noticeable time to import

    return float(stats.t.ppf(p, df))


def _as_array(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise ValueError("no values: a mean needs at least one")
    if not np.all(np.isfinite(array)):
        raise ValueError("values must be finite")
    return array


def t_interval(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> Interval:
    """Student's t interval for the mean. One value gives a zero-width interval (no spread to estimate)."""
    array = _as_array(values)
    mean, n = float(array.mean()), array.size
    if n == 1:
        return Interval(mean, mean, mean, 1, confidence)
    half = t_quantile((1 + confidence) / 2, n - 1) * float(array.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, confidence)


def bootstrap_interval(
    values: Sequence[float] | np.ndarray, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Interval:
    """Percentile bootstrap interval for the mean (resampling questions with replacement, seeded)."""
    array = _as_array(values)
    rng = np.random.default_rng(seed)
    means = array[rng.integers(0, array.size, size=(resamples, array.size))].mean(axis=1)  # (resamples,)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(float(array.mean()), float(low), float(high), array.size, confidence)


def wilson_interval(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> Interval:
    """Wilson's score interval for a rate: the values are successes (1) and failures (0).

    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), with p the observed rate and z the normal
    quantile; it lies inside [0, 1] at every p, including 0 and 1: a rate of 0.98 over 100 values is
    0.980 [0.930, 0.994], where the t interval gives [0.952, 1.008].
    """
    array = _as_array(values)
    if not np.all((array == 0) | (array == 1)):
        raise ValueError("a rate's values are 0 or 1")
    n, rate = array.size, float(array.mean())
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(rate, max(0.0, centre - half), min(1.0, centre + half), n, confidence)


def mean_ci(values: Sequence[float] | np.ndarray, confidence: float = 0.95, method: str = "t") -> Interval:
    """Mean and confidence interval of per-question scores.

    Args:
        values: one score per question.
        confidence: coverage of the interval.
        method: "t" (Student's t interval), "bootstrap" (percentile bootstrap, seed 0) or "wilson" (Wilson's score
            interval; for a rate, every value 0 or 1).
    """
    if method == "t":
        return t_interval(values, confidence)
    if method == "bootstrap":
        return bootstrap_interval(values, confidence)
    if method == "wilson":
        return wilson_interval(values, confidence)
    raise ValueError(f"method must be 't', 'bootstrap' or 'wilson', got {method!r}")


def paired_difference(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, confidence: float = 0.95, method: str = "t"
) -> Interval:
    """Mean of `a - b` over paired scores (the same questions, in the same order) with its interval."""
    a_array, b_array = _as_array(a), _as_array(b)
    if a_array.shape != b_array.shape:
        raise ValueError(f"paired scores need equal lengths, got {a_array.size} and {b_array.size}")
    return mean_ci(a_array - b_array, confidence, method)


def paired_permutation_p(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, resamples: int = 20_000, seed: int = 0
) -> float:
    """Two-sided p-value of the mean of `a - b` over paired scores: a sign-flip permutation test (seeded).

    Under "the two systems do not differ", each question's difference is as likely negative as positive, so
    the observed |mean difference| is compared with those of `resamples` random sign flips. The observed
    assignment counts as one of them, so p is never 0.
    """
    a_array, b_array = _as_array(a), _as_array(b)
    if a_array.shape != b_array.shape:
        raise ValueError(f"paired scores need equal lengths, got {a_array.size} and {b_array.size}")
    diff = a_array - b_array
    observed = abs(diff.mean())
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(resamples, diff.size))
    flipped = np.abs((signs * diff).mean(axis=1))  # (resamples,)
    return float((1 + np.count_nonzero(flipped >= observed - 1e-12)) / (resamples + 1))
