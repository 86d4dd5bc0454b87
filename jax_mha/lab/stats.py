"""Seed statistics for the studies: sample spread, t intervals, seed-paired differences.

Every study trains a handful of seeds (usually 3) per configuration, so the spread
must be the *sample* standard deviation (ddof=1; the population one, ddof=0,
understates it by sqrt(n / (n - 1)) = 1.22x at n = 3) and intervals must use
Student's t with n - 1 degrees of freedom (t = 4.30 at n = 3, not the normal 1.96).
A seed gets the same data stream and evaluation set at every head count, so
differences between two configurations are taken seed by seed (paired), which
removes the part of the spread that the seed's data order shares.

NumPy only: no SciPy dependency. The t quantile is computed by bisection on the
regularized incomplete beta function (a continued fraction, Numerical Recipes
§6.4), accurate to ~1e-10; the tests compare it with tabulated values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np


def _finite(values: Iterable[float | None]) -> np.ndarray:
    """The values as float64, without None (a seed that never reached a target) and non-finite ones."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    return v[np.isfinite(v)]


def sample_std(values: Iterable[float | None]) -> float:
    """Sample standard deviation (ddof=1) of the finite values; NaN for fewer than 2."""
    v = _finite(values)
    return float(v.std(ddof=1)) if v.size >= 2 else float("nan")


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    """`(mean, sample std)` of the finite values, ignoring None; NaNs when empty
    (the std is NaN for a single value: one seed says nothing about the spread)."""
    v = _finite(values)
    return (float(v.mean()) if v.size else float("nan"), sample_std(v))


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    guard = lambda v: v if abs(v) > tiny else tiny  # Lentz's guard against a zero denominator
    c, d = 1.0, 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((a - 1.0 + m2) * (a + m2)),  # even step, then odd step
                   -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1.0 + m2))):
            d = 1.0 / guard(1.0 + aa * d)
            c = guard(1.0 + aa / c)
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use the symmetry on the other
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t cumulative distribution function with `df` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (bisection on `t_cdf`).

    Raises:
      ValueError: for p outside (0, 1) or df <= 0.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # heavy tails at df = 1: the 0.999 quantile is 318
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean with its two-sided t interval over `n` values."""

    mean: float
    std: float  # sample std (ddof=1)
    low: float
    high: float
    n: int
    level: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    def excludes(self, value: float = 0.0) -> bool:
        """True if `value` lies outside the interval (a difference 'beyond the spread')."""
        return not self.low <= value <= self.high

    def format(self, digits: int = 3) -> str:
        """'m [lo, hi]', e.g. for a results table."""
        if self.n < 2:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def t_interval(values: Iterable[float | None], level: float = 0.95) -> Interval:
    """Mean and `level` t interval (n - 1 degrees of freedom) of the finite values.

    With one value the interval is (NaN, NaN); with none everything is NaN.
    """
    v = _finite(values)
    n = int(v.size)
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), float("nan"), 0, level)
    mean, std = float(v.mean()), sample_std(v)
    if n < 2:
        return Interval(mean, std, float("nan"), float("nan"), n, level)
    half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    return Interval(mean, std, mean - half, mean + half, n, level)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """t interval of the seed-by-seed differences `a[i] - b[i]`.

    Args:
      a, b: one value per seed, in the same seed order (same length).

    Raises:
      ValueError: if the lengths differ.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values need equal 1-D shapes, got {a.shape} and {b.shape}")
    return t_interval(a - b, level)
