"""Means with 95% confidence intervals and paired tests: the statistics of evaluation tables, on `scipy.stats`.

Every interval stays inside the range of its quantity, and none is zero-width:

* `wilson_interval`: a rate (every value 0 or 1: EM, valid answers), Wilson's score interval
  (`scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`).
* `bootstrap_interval`: the mean of a bounded score (F1, format, a share of actions, a paired difference), a seeded
  BCa bootstrap over questions (`scipy.stats.bootstrap`; percentile where BCa is undefined), clipped to `bounds`.
* `t_interval`: the mean of an unbounded quantity (searches per question), Student's t
  (`scipy.stats.ttest_1samp(...).confidence_interval()`), clipped to `bounds` (at 0 for a count).
* `constant_interval`: what the other two give for a constant sample (every value c), which has no spread to
  resample or to scale a t quantile by. For a bounded quantity, the rule of three: no value of the n differed from c,
  so at most a share q of the population does, q the exact binomial upper bound for 0 of n
  (`binomtest(0, n).proportion_ci(method="exact")`, about 3.7/n at 95%), and the mean lies in
  [c - q (c - low), c + q (high - c)]. For a count (bounded below only), the exact Poisson interval of the total
  n c, divided by n (Garwood's, from `scipy.stats.chi2`). `Interval.method` says which interval a mean got.

`mean_ci` picks one by name. `paired_difference` is the interval of the mean difference of two systems scored on
the same questions (paired by question); `paired_permutation_p` is its two-sided p-value under "no difference"
(`scipy.stats.permutation_test`, random swaps within each pair, seeded). No torch; SciPy is imported when first
needed (it takes a noticeable time to import).

    from envs.stats import mean_ci
    print(mean_ci([0.0, 1.0, 0.5, 1.0]))     # 0.625 [0.125, 0.875] (n=4, bootstrap)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "METHODS",
    "Interval",
    "bootstrap_interval",
    "constant_interval",
    "mean_ci",
    "paired_difference",
    "paired_permutation_p",
    "t_interval",
    "t_quantile",
    "wilson_interval",
]

METHODS = {
    "wilson": "Wilson score interval",
    "bootstrap": "BCa bootstrap over questions (seeded), in the metric's range",
    "t": "Student's t interval, clipped to the metric's range",
    "rule of three": "a constant sample: the rule-of-three bound (exact binomial for 0 of n differing)",
    "poisson": "a constant count: the exact Poisson interval of its total",
}
"""Each interval `Interval.method` can name, in words (for table captions)."""

UNIT = (0.0, 1.0)
"""The range of a score or rate."""


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
    method: str = ""
    """Which interval it is (a key of `METHODS`; empty for one read from a file that did not say)."""

    @property
    def half_width(self) -> float:
        """Half the interval's width (the +- of a symmetric interval)."""
        return (self.high - self.low) / 2

    def as_dict(self) -> dict[str, float | int | str]:
        """JSON-ready `{"mean", "low", "high", "n", "method"}`."""
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "method": self.method}

    def format(self, digits: int = 3) -> str:
        """`mean [low, high]` with `digits` decimals."""
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def __str__(self) -> str:
        method = f", {self.method}" if self.method else ""
        return f"{self.format(2 if abs(self.mean) >= 10 else 3)} (n={self.n}{method})"


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
    from scipy import stats

    return float(stats.t.ppf(p, df))


def _as_array(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise ValueError("no values: a mean needs at least one")
    if not np.all(np.isfinite(array)):
        raise ValueError("values must be finite")
    return array


def _check_bounds(array: np.ndarray, bounds: tuple[float, float]) -> None:
    low, high = bounds
    if not low < high:
        raise ValueError(f"bounds must be (low, high) with low < high, got {bounds}")
    if array.min() < low or array.max() > high:
        raise ValueError(f"values must lie in {list(bounds)}, got [{array.min():g}, {array.max():g}]")


def _clipped(mean: float, low: float, high: float, n: int, confidence: float, method: str, bounds) -> Interval:
    # an interval's end past the range of its quantity is a statement about impossible values; the mean lies inside
    low, high = max(bounds[0], min(low, mean)), min(bounds[1], max(high, mean))
    return Interval(mean, float(low), float(high), n, confidence, method)


def constant_interval(
    values: Sequence[float] | np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] = UNIT
) -> Interval:
    """The interval of a constant sample (every value c): the rule of three in a bounded range, else Poisson's.

    A bounded range: no value of the n differed from c, so at most a share q of the population does (q: the exact
    binomial upper bound for 0 of n), and the mean lies in [c - q (c - low), c + q (high - c)]; for a rate of
    0 of n this is the exact (Clopper-Pearson) interval. A range bounded below only (a count): the exact Poisson
    interval of the total n (c - low), divided by n. Unbounded on both sides: (-inf, inf), nothing to say.
    """
    from scipy import stats

    array = _as_array(values)
    _check_bounds(array, bounds)
    if np.ptp(array) != 0:
        raise ValueError("a constant sample has every value equal")
    c, n, (lo, hi) = float(array[0]), array.size, bounds
    if math.isfinite(lo) and math.isfinite(hi):
        q = stats.binomtest(0, n).proportion_ci(confidence, method="exact").high
        return _clipped(c, c - q * (c - lo), c + q * (hi - c), n, confidence, "rule of three", bounds)
    if math.isfinite(lo):
        total, alpha = n * (c - lo), 1 - confidence
        low = stats.chi2.ppf(alpha / 2, 2 * total) / 2 if total > 0 else 0.0
        high = stats.chi2.ppf(1 - alpha / 2, 2 * total + 2) / 2
        return _clipped(c, lo + low / n, lo + high / n, n, confidence, "poisson", bounds)
    return Interval(c, -math.inf, math.inf, n, confidence, "")


def t_interval(
    values: Sequence[float] | np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] = (0.0, math.inf)
) -> Interval:
    """Student's t interval for the mean (`scipy.stats.ttest_1samp`), clipped to `bounds`; a constant sample gets
    `constant_interval`. For unbounded quantities (counts); a bounded score takes `bootstrap_interval`."""
    from scipy import stats

    array = _as_array(values)
    _check_bounds(array, bounds)
    if np.ptp(array) == 0:
        return constant_interval(array, confidence, bounds)
    ci = stats.ttest_1samp(array, 0.0).confidence_interval(confidence)
    return _clipped(float(array.mean()), ci.low, ci.high, array.size, confidence, "t", bounds)


def bootstrap_interval(
    values: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
    resamples: int = 9_999,
    seed: int = 0,
    bounds: tuple[float, float] = UNIT,
) -> Interval:
    """BCa bootstrap interval for the mean of a bounded score (`scipy.stats.bootstrap`, questions resampled with
    replacement, seeded), clipped to `bounds`. Percentile where BCa is undefined (a sample with one value apart);
    a constant sample gets `constant_interval`."""
    import warnings

    from scipy import stats

    array = _as_array(values)
    _check_bounds(array, bounds)
    if np.ptp(array) == 0:
        return constant_interval(array, confidence, bounds)
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BCa's "degenerate distribution" warning: the percentile follows
            ci = stats.bootstrap(
                (array,),
                np.mean,
                confidence_level=confidence,
                n_resamples=resamples,
                method=method,
                random_state=np.random.default_rng(seed),
            ).confidence_interval
        if np.isfinite(ci.low) and np.isfinite(ci.high) and ci.high > ci.low:
            break
    else:  # almost every resample equal: no spread the bootstrap can see
        return constant_interval(np.full(array.size, array.mean()), confidence, bounds)
    return _clipped(float(array.mean()), ci.low, ci.high, array.size, confidence, "bootstrap", bounds)


def wilson_interval(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> Interval:
    """Wilson's score interval for a rate: the values are successes (1) and failures (0).

    `scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`: inside [0, 1] at every rate and not zero-width at
    0% or 100%; a rate of 0.98 over 100 values is 0.980 [0.930, 0.994], where the t interval gives [0.952, 1.008].
    """
    from scipy import stats

    array = _as_array(values)
    if not np.all((array == 0) | (array == 1)):
        raise ValueError("a rate's values are 0 or 1")
    n, k = array.size, int(array.sum())
    ci = stats.binomtest(k, n).proportion_ci(confidence, method="wilson")
    return _clipped(k / n, ci.low, ci.high, n, confidence, "wilson", UNIT)


def mean_ci(
    values: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
    method: str = "bootstrap",
    bounds: tuple[float, float] | None = None,
) -> Interval:
    """Mean and confidence interval of per-question scores.

    Args:
        values: one score per question.
        confidence: coverage of the interval.
        method: "bootstrap" (a bounded score), "wilson" (a rate, every value 0 or 1) or "t" (an unbounded
            quantity such as a count).
        bounds: the range of the quantity, which the interval stays inside; default [0, 1] for bootstrap (a score)
            and [0, inf) for t (a count). A rate's is [0, 1].
    """
    if method == "t":
        return t_interval(values, confidence, bounds or (0.0, math.inf))
    if method == "bootstrap":
        return bootstrap_interval(values, confidence, bounds=bounds or UNIT)
    if method == "wilson":
        return wilson_interval(values, confidence)
    raise ValueError(f"method must be 'bootstrap', 'wilson' or 't', got {method!r}")


def _paired(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a_array, b_array = _as_array(a), _as_array(b)
    if a_array.shape != b_array.shape:
        raise ValueError(f"paired scores need equal lengths, got {a_array.size} and {b_array.size}")
    return a_array, b_array


def paired_difference(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
    bounds: tuple[float, float] = UNIT,
) -> Interval:
    """Mean of `a - b` over paired scores (the same questions, in the same order) with its bootstrap interval.

    `bounds` is the range of each score, so a difference lies in [low - high, high - low] ([-1, 1] for scores in
    [0, 1]), and its interval too.
    """
    a_array, b_array = _paired(a, b)
    width = bounds[1] - bounds[0]
    return bootstrap_interval(a_array - b_array, confidence, bounds=(-width, width))


def paired_permutation_p(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, resamples: int = 20_000, seed: int = 0
) -> float:
    """Two-sided p-value of the mean of `a - b` over paired scores: a paired permutation test (seeded).

    Under "the two systems do not differ", the two scores of each question are exchangeable: the observed mean
    difference is compared with those of `resamples` random swaps within pairs (sign flips of the differences;
    every one of the 2^n when there are fewer), `scipy.stats.permutation_test` with ``permutation_type="samples"``.
    The observed assignment counts among the random ones, so p is never 0.
    """
    from scipy import stats

    a_array, b_array = _paired(a, b)

    def mean_difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        # rounded so that ties stay ties: summation-order noise (1e-17) must not split an observed mean of 0 from the
        # resamples equal to it, which scipy's tolerance (relative to the observed value) cannot absorb
        return np.round(np.mean(x - y, axis=axis), 12)

    result = stats.permutation_test(
        (a_array, b_array),
        mean_difference,
        permutation_type="samples",
        vectorized=True,
        n_resamples=resamples,
        alternative="two-sided",
        random_state=np.random.default_rng(seed),
    )
    return float(result.pvalue)
