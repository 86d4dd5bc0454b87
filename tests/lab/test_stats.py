"""Seed statistics: sample std, t quantiles against tabulated values, intervals, paired differences."""

import math

import numpy as np
import pytest

from jax_mha.lab import stats

# Two-sided 95 % critical values t_{0.975, df} from standard tables (e.g. NIST/SEMATECH
# e-Handbook, Table 1.4.2.7.2); df = 1e6 approaches the normal 1.959964.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 30: 2.042, 1_000_000: 1.960}


@pytest.mark.parametrize("df,expected", sorted(T_975.items()))
def test_t_quantile_matches_tables(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)


def test_t_quantile_other_levels_and_symmetry():
    assert stats.t_quantile(0.995, 2) == pytest.approx(9.925, abs=1e-3)  # 99 % two-sided, df 2
    assert stats.t_quantile(0.95, 4) == pytest.approx(2.132, abs=1e-3)
    assert stats.t_quantile(0.025, 3) == pytest.approx(-stats.t_quantile(0.975, 3))
    assert stats.t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-9)
    # df = 1 is the Cauchy distribution: quantile tan(pi (p - 1/2)), in closed form.
    for p in (0.6, 0.9, 0.999):
        assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)


def test_t_quantile_rejects_bad_arguments():
    with pytest.raises(ValueError, match="p must be in"):
        stats.t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df must be"):
        stats.t_cdf(1.0, 0)


def test_sample_std_is_ddof_1_and_ignores_none():
    values = [1.0, 2.0, 4.0, None, float("nan")]
    assert stats.sample_std(values) == pytest.approx(np.std([1.0, 2.0, 4.0], ddof=1))
    mean, std = stats.mean_std(values)
    assert mean == pytest.approx(7 / 3) and std == pytest.approx(math.sqrt(7 / 3))
    assert math.isnan(stats.sample_std([3.0]))
    assert all(math.isnan(x) for x in stats.mean_std([]))


def test_t_interval_by_hand():
    values = [2.0, 4.0, 9.0]  # mean 5, sample std sqrt(13)
    iv = stats.t_interval(values)
    half = 4.302653 * math.sqrt(13) / math.sqrt(3)
    assert iv.mean == pytest.approx(5.0) and iv.n == 3
    assert (iv.low, iv.high) == pytest.approx((5 - half, 5 + half), rel=1e-6)
    assert iv.excludes(-20.0) and not iv.excludes(5.0)
    assert "[" in iv.format() and "n=1" in stats.t_interval([1.0]).format()


def test_paired_difference_removes_the_shared_seed_offset():
    # Each seed shifts both configurations by the same amount; b is always 0.1 below a.
    seed_offset = np.array([0.0, 1.0, -2.0])
    a = 3.0 + seed_offset + np.array([0.10, 0.11, 0.09])
    b = 3.0 + seed_offset
    paired = stats.paired_difference(a, b)
    unpaired_a, unpaired_b = stats.t_interval(a), stats.t_interval(b)
    assert paired.mean == pytest.approx(0.1)
    assert paired.excludes(0.0)  # the paired interval sees the difference ...
    assert unpaired_a.low < unpaired_b.high  # ... the two separate intervals overlap
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        stats.paired_difference([1.0, 2.0], [1.0])


# ----------------------------------------------------------------- families of comparisons, shares of seeds


def test_holm_by_hand():
    # Sorted: 0.005 (x4), 0.01 (x3), 0.03 (x2), 0.04 (x1) -> 0.02, 0.03, 0.06, then max(0.04, 0.06).
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.3, 0.6]) == pytest.approx([0.6, 0.6])  # capped at 1 and monotone
    assert stats.holm([0.9, 0.5, 0.7]) == pytest.approx([1.0, 1.0, 1.0])
    got = stats.holm([0.02, None, float("nan"), 0.01])  # no test: NaN, and m counts 2 tests
    assert got[0] == pytest.approx(0.02) and got[3] == pytest.approx(0.02)
    assert math.isnan(got[1]) and math.isnan(got[2])
    with pytest.raises(ValueError, match=r"\[0, 1\], got \[1.5\]"):
        stats.holm([1.5])


def test_paired_t_test_against_closed_forms():
    # Differences 1, 2, 3: mean 2, sd 1, t = 2 sqrt(3), df 2, where the two-sided
    # p value has the closed form 1 - t / sqrt(2 + t^2).
    t, p = stats.paired_t_test([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert t == pytest.approx(2 * math.sqrt(3))
    assert p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    # df 1 (two pairs) is Cauchy: p = 1 - (2 / pi) atan(|t|); differences 1 and 3: t = 2.
    t, p = stats.paired_t_test([5.0, 9.0], [4.0, 6.0])
    assert t == pytest.approx(2.0) and p == pytest.approx(1 - 2 / math.pi * math.atan(2.0), rel=1e-9)
    assert stats.paired_t_test([1.0, 2.0, None], [0.0, 1.5, 0.0])[0] == pytest.approx(3.0)  # a missing seed is dropped
    assert all(math.isnan(x) for x in stats.paired_t_test([1.0], [0.0]))
    assert stats.paired_t_test([2.0, 3.0], [1.0, 2.0]) == (math.inf, 0.0)  # no spread, non-zero mean


def test_paired_t_test_agrees_with_scipy_when_installed():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    for n in (3, 5, 11):
        a, b = rng.normal(size=n), rng.normal(size=n) + 0.4
        t, p = stats.paired_t_test(a, b)
        ref = scipy_stats.ttest_rel(a, b)
        assert (t, p) == pytest.approx((ref.statistic, ref.pvalue), rel=1e-7)


def test_paired_comparisons_adjust_over_the_family():
    family = {"h=2": ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]), "h=4": ([5.0, 9.0, 1.0], [4.0, 6.0, 1.5])}
    out = stats.paired_comparisons(family)
    raw = [stats.paired_t_test(*family[k])[1] for k in family]
    assert [out[k].p for k in family] == pytest.approx(raw)
    assert [out[k].p_holm for k in family] == pytest.approx(stats.holm(raw))
    assert out["h=2"].difference.mean == pytest.approx(2.0) and "Holm p = " in out["h=2"].format()


def test_wilson_interval_by_hand():
    # 3 of 10 at 95 %: centre (0.3 + z^2/20) / (1 + z^2/10), half-width z sqrt(0.021 + z^2/400) / (1 + z^2/10).
    z = 1.959963984540054
    centre, half = (0.3 + z * z / 20) / (1 + z * z / 10), z * math.sqrt(0.021 + z * z / 400) / (1 + z * z / 10)
    assert stats.wilson_interval(3, 10) == pytest.approx((centre - half, centre + half), rel=1e-12)
    assert stats.wilson_interval(3, 10) == pytest.approx((0.1078, 0.6032), abs=1e-4)  # the usual table value
    low, high = stats.wilson_interval(0, 5)
    assert low == 0.0 and high == pytest.approx(z * z / 5 / (1 + z * z / 5))  # closed form at 0 successes
    assert stats.wilson_interval(5, 5)[1] == 1.0
    assert all(math.isnan(x) for x in stats.wilson_interval(0, 0))
    with pytest.raises(ValueError, match="successes=4, n=3"):
        stats.wilson_interval(4, 3)


def test_missing_values_in_pairs_and_formats():
    iv = stats.paired_difference([1.0, None, 3.0], [0.0, 1.0, 1.0])
    assert iv.n == 2 and iv.mean == pytest.approx(1.5)
    assert stats.t_interval([]).format() == "–"


def test_paired_t_power_against_tables_and_simulation():
    # Cohen's one-sample t tables (G*Power agrees): d = 1 with 10 pairs, d = 0.3 with 100, at 5 % two-sided.
    assert stats.paired_t_power(10, 1.0, 1.0) == pytest.approx(0.8031, abs=2e-4)
    assert stats.paired_t_power(100, 0.3, 1.0) == pytest.approx(0.8439, abs=2e-4)
    assert stats.paired_t_power(7, 0.0, 0.5, alpha=0.01) == pytest.approx(0.01, abs=1e-6)  # no effect: the level
    # An independent check: simulated paired t tests (binomial standard error ~2e-4 at 2e6 draws).
    rng = np.random.default_rng(11)
    for n, effect, sd, alpha in ((2, 0.5, 1.0, 0.05), (5, 0.02, 0.013, 0.05 / 7), (13, 0.01, 0.03, 0.05)):
        d = rng.normal(effect, sd, size=(2_000_000 // n, n))
        t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
        simulated = np.mean(np.abs(t) > stats.t_quantile(1 - alpha / 2, n - 1))
        assert stats.paired_t_power(n, effect, sd, alpha) == pytest.approx(simulated, abs=5 * math.sqrt(simulated / len(d)) + 1e-4)


def test_seeds_for_power_and_detectable_difference_invert_the_power():
    n = stats.seeds_for_power(0.02, 0.0133, alpha=0.05 / 7)
    assert stats.paired_t_power(n, 0.02, 0.0133, 0.05 / 7) >= 0.8 > stats.paired_t_power(n - 1, 0.02, 0.0133, 0.05 / 7)
    assert stats.seeds_for_power(1.0, 1.0) == 10  # the table's d = 1 row
    assert stats.seeds_for_power(1e-3, 1.0, most=50) is None
    mdd = stats.detectable_difference(10, 0.04, alpha=0.01)
    assert stats.paired_t_power(10, mdd, 0.04, 0.01) == pytest.approx(0.8, abs=1e-6)
    for bad in (dict(n=1, difference=0.1, sd=1.0), dict(n=5, difference=0.1, sd=0.0), dict(n=5, difference=0.1, sd=1.0, alpha=1.5)):
        with pytest.raises(ValueError, match="n >= 2|sd must|alpha must"):
            stats.paired_t_power(**bad)


def test_fisher_exact_by_hand_and_against_scipy():
    # 0/10 against 5/10: the tables as or less likely are k = 0 and k = 5 of the 5 successes in group a,
    # each C(10, 0) C(10, 5) / C(20, 5) = 252 / 15504.
    assert stats.fisher_exact(0, 10, 5, 10) == pytest.approx(2 * 252 / 15504, rel=1e-12)
    assert stats.fisher_exact(2, 5, 2, 5) == 1.0 and stats.fisher_exact(0, 4, 0, 9) == 1.0
    with pytest.raises(ValueError, match="successes=6, n=5"):
        stats.fisher_exact(6, 5, 1, 5)
    scipy_stats = pytest.importorskip("scipy.stats")
    for a, n, b, m in ((3, 10, 8, 10), (1, 7, 6, 9), (10, 10, 0, 10), (4, 11, 9, 13)):
        assert stats.fisher_exact(a, n, b, m) == pytest.approx(scipy_stats.fisher_exact([[a, n - a], [b, m - b]]).pvalue, rel=1e-9)
