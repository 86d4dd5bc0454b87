"""Seed statistics for the studies: sample spread, t intervals, seed-paired differences,
paired t tests with Holm's correction over a family of comparisons, Wilson intervals.

Every study trains a handful of seeds (usually 3) per configuration, so the spread
must be the *sample* standard deviation (ddof=1; the population one, ddof=0,
understates it by sqrt(n / (n - 1)) = 1.22x at n = 3) and intervals must use
Student's t with n - 1 degrees of freedom (t = 4.30 at n = 3, not the normal 1.96).
A seed gets the same data stream and evaluation set at every head count, so
differences between two configurations are taken seed by seed (paired), which
removes the part of the spread that the seed's data order shares.

A page that reports several paired differences makes a family of comparisons: each
95 % interval holds for one comparison alone, and over k independent ones the chance
that at least one excludes 0 by luck is 1 - 0.95^k (30 % at k = 7). So each
difference also gets a paired t test, and the family's p values are adjusted by
Holm's step-down method (`holm`, `paired_comparisons`), which keeps the family-wise
error rate at the level whatever the dependence between the comparisons. A share of
seeds (how many of n solve a task) gets Wilson's score interval (`wilson_interval`).

NumPy and the standard library only: no SciPy dependency. The t quantile is computed by bisection on the
regularized incomplete beta function (a continued fraction, Numerical Recipes
§6.4), accurate to ~1e-10; the tests compare it with tabulated values.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
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
        """'m [lo, hi]', e.g. for a results table; 'm (n=1)' for one value, '–' for none."""
        if self.n == 0:
            return "–"
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


def _pairs(a: Sequence[float | None], b: Sequence[float | None]) -> np.ndarray:
    """`a[i] - b[i]` as float64 `(n,)`, a None read as NaN (dropped by `_finite` later).

    Raises:
      ValueError: if the two are not 1-D of one length.
    """
    to_array = lambda x: np.asarray([np.nan if v is None else v for v in x], np.float64)
    a, b = to_array(a), to_array(b)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values need equal 1-D shapes, got {a.shape} and {b.shape}")
    return a - b


def paired_difference(a: Sequence[float | None], b: Sequence[float | None], level: float = 0.95) -> Interval:
    """t interval of the seed-by-seed differences `a[i] - b[i]`.

    Args:
      a, b: one value per seed, in the same seed order (same length). A seed with None
        or a non-finite value on either side is left out of the pair.

    Raises:
      ValueError: if the lengths differ.
    """
    return t_interval(_pairs(a, b), level)


def paired_t_test(a: Sequence[float | None], b: Sequence[float | None]) -> tuple[float, float]:
    """Student's paired t test of `mean(a - b) = 0`: `(t, two-sided p)`, n - 1 dof.

    Pairs with a missing side are left out. Fewer than 2 pairs give `(NaN, NaN)`; zero
    spread gives `t = ±inf, p = 0` for a non-zero mean and `(NaN, NaN)` for a zero one.

    Raises:
      ValueError: if the lengths differ.
    """
    d = _finite(_pairs(a, b))
    if d.size < 2:
        return float("nan"), float("nan")
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(d.size)
    if se == 0.0:
        return (float("nan"), float("nan")) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / se
    return t, min(1.0, 2.0 * t_cdf(-abs(t), d.size - 1))


def holm(p_values: Sequence[float | None]) -> list[float]:
    """Holm's (1979) step-down adjustment of a family of p values.

    With the m finite p values sorted, p_(1) <= … <= p_(m), the adjusted value of p_(i)
    is `max_{j <= i} min(1, (m - j + 1) p_(j))`; rejecting where it is <= alpha holds the
    family-wise error rate at alpha for any dependence between the tests.

    Args:
      p_values: one per comparison; None or NaN (no test) stays NaN and does not count
        towards m.

    Returns:
      the adjusted p values, in the order given.

    Raises:
      ValueError: for a p value outside [0, 1].
    """
    p = np.asarray([np.nan if v is None else v for v in p_values], np.float64)
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p values must lie in [0, 1], got {p.tolist()}")
    out = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    m = order.size
    running = 0.0
    for rank, i in enumerate(order):  # rank 0 is the smallest p: multiplier m
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def fisher_exact(successes_a: int, n_a: int, successes_b: int, n_b: int) -> float:
    """Two-sided p value of Fisher's exact test that two shares come from one rate:
    under the null, with both margins fixed, the first group's successes are
    hypergeometric; p sums the probabilities of every table no more probable than the
    observed one (scipy's rule, with the same 1e-7 relative tolerance for ties).

    Raises:
      ValueError: for counts outside 0 <= successes <= n.
    """
    for k, n in ((successes_a, n_a), (successes_b, n_b)):
        if not 0 <= k <= n:
            raise ValueError(f"successes must lie in [0, n], got successes={k}, n={n}")
    total, drawn = n_a + n_b, successes_a + successes_b
    low, high = max(0, drawn - n_b), min(drawn, n_a)
    log_p = {k: (math.lgamma(n_a + 1) - math.lgamma(k + 1) - math.lgamma(n_a - k + 1)
                 + math.lgamma(n_b + 1) - math.lgamma(drawn - k + 1) - math.lgamma(n_b - drawn + k + 1)
                 - math.lgamma(total + 1) + math.lgamma(drawn + 1) + math.lgamma(total - drawn + 1))
             for k in range(low, high + 1)}
    observed = log_p[successes_a]
    return min(1.0, sum(math.exp(v) for v in log_p.values() if v <= observed + 1e-7))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def paired_t_power(n: int, difference: float, sd: float, alpha: float = 0.05) -> float:
    """The power of a two-sided paired t test at level `alpha` with `n` pairs, when the
    true mean difference is `difference` and the pairs' differences have standard
    deviation `sd`: P(|T| > t_{1-alpha/2, n-1}) under the noncentral t with
    noncentrality difference / sd * sqrt(n), by quadrature over the chi-square of the
    sample variance.

    Raises:
      ValueError: for n < 2, sd <= 0 or alpha outside (0, 1).
    """
    if n < 2:
        raise ValueError(f"a paired t test needs n >= 2 pairs, got {n}")
    if not sd > 0:
        raise ValueError(f"sd must be > 0, got {sd}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    df = n - 1
    critical = t_quantile(1.0 - alpha / 2.0, df)
    shift = abs(difference) / sd * math.sqrt(n)
    # V ~ chi2(df); T = (Z + shift) / sqrt(V / df). Integrate over w = sqrt(V / df):
    # V / df is gamma(df/2, scale 2/df), and in w its density stays finite at 0 even at
    # df = 1; up to 1 + 12 sd of V / df (and more at small df) leaves < 1e-9 outside.
    top = math.sqrt(1.0 + 12.0 * math.sqrt(2.0 / df) + 10.0 / df)
    w = np.linspace(0.0, top, 4001)
    density = 2.0 * w ** (df - 1) * np.exp(-w * w * df / 2.0 + (df / 2.0) * math.log(df / 2.0) - math.lgamma(df / 2.0))
    reject = np.array([_normal_cdf(shift - critical * r) + _normal_cdf(-shift - critical * r) for r in w])
    return float(np.clip(np.trapezoid(density * reject, w), 0.0, 1.0))


def seeds_for_power(difference: float, sd: float, alpha: float = 0.05, power: float = 0.8,
                    most: int = 1000) -> int | None:
    """The fewest pairs (seeds) at which a two-sided paired t test at level `alpha`
    detects `difference` with at least `power` (`paired_t_power`); None past `most`."""
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    return next((n for n in range(2, most + 1) if paired_t_power(n, difference, sd, alpha) >= power), None)


def detectable_difference(n: int, sd: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided paired t test with `n` pairs at
    level `alpha` detects with `power` (bisection on `paired_t_power`)."""
    lo, hi = 0.0, sd
    while paired_t_power(n, hi, sd, alpha) < power:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if paired_t_power(n, mid, sd, alpha) < power else (lo, mid)
    return hi


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One seed-paired comparison of a family: `a - b` with its t interval, the paired
    t test's p value and the p value Holm-adjusted over the family."""

    name: str
    difference: Interval
    t: float
    p: float
    p_holm: float

    def format(self, digits: int = 3) -> str:
        """'m [lo, hi], p = …, Holm p = …' (p values to 3 significant digits)."""
        p = lambda x: "–" if not math.isfinite(x) else f"{x:.3g}"
        return f"{self.difference.format(digits)}, p = {p(self.p)}, Holm p = {p(self.p_holm)}"


def paired_comparisons(family: dict[str, tuple[Sequence[float | None], Sequence[float | None]]],
                       level: float = 0.95) -> dict[str, Comparison]:
    """Every comparison of a family at once: `{name: (a, b)}` -> `{name: Comparison}`,
    the Holm adjustment taken over all of them (the family is what one page reports).

    Raises:
      ValueError: if a pair's lengths differ.
    """
    tests = {name: (paired_difference(a, b, level), *paired_t_test(a, b)) for name, (a, b) in family.items()}
    adjusted = holm([p for _, _, p in tests.values()])
    return {name: Comparison(name, iv, t, p, adj) for (name, (iv, t, p)), adj in zip(tests.items(), adjusted)}


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's (1927) score interval for a share `successes / n`, e.g. of seeds that
    solve a task; unlike the normal approximation it stays inside [0, 1] and is not
    empty at 0 or n successes.

    Returns:
      `(low, high)`; `(NaN, NaN)` for n = 0.

    Raises:
      ValueError: for successes outside [0, n], n < 0 or level outside (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return float("nan"), float("nan")
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2.0)
    share, z2n = successes / n, z * z / n
    center = (share + z2n / 2.0) / (1.0 + z2n)
    half = z * math.sqrt(share * (1.0 - share) / n + z2n / (4.0 * n)) / (1.0 + z2n)
    # At 0 (n) successes the bound is exactly 0 (1); rounding would leave ~1e-17 there.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    return low, 1.0 if successes == n else min(1.0, center + half)
