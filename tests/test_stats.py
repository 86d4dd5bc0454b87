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
