"""The audit statistics: Clopper–Pearson bounds, (ε, δ) and μ from error rates, the accountant's
trade-off curve, and the one-run bound of Steinke, Nasr and Jagielski (2023)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dptorch.auditing.stats import (
    TradeoffCurve,
    clopper_pearson_lower,
    clopper_pearson_upper,
    epsilon_from_rates,
    error_counts,
    gdp_epsilon,
    gdp_tradeoff,
    mu_from_rates,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)


def test_clopper_pearson_closed_forms():
    # k = 0: P[Bin(n, p) = 0] = (1 - p)^n = alpha; k = n: p^n = alpha
    n, a = 100, 0.05
    assert clopper_pearson_upper(0, n, a) == pytest.approx(1 - a ** (1 / n), rel=1e-9)
    assert clopper_pearson_lower(n, n, a) == pytest.approx(a ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(n, n, a) == 1.0
    assert clopper_pearson_lower(0, n, a) == 0.0
    # the defining equation for an inner k
    ub = float(clopper_pearson_upper(7, n, a))
    assert stats.binom.cdf(7, n, ub) == pytest.approx(a, rel=1e-6)
    lb = float(clopper_pearson_lower(7, n, a))
    assert stats.binom.sf(6, n, lb) == pytest.approx(a, rel=1e-6)


def test_clopper_pearson_coverage():
    """The one-sided bounds cover the true rate at least at their level (seeded draws)."""
    rng = np.random.default_rng(0)
    n, a = 200, 0.05
    for p in (0.01, 0.2, 0.5):
        k = rng.binomial(n, p, size=4000)
        assert np.mean(clopper_pearson_upper(k, n, a) >= p) >= 1 - a
        assert np.mean(clopper_pearson_lower(k, n, a) <= p) >= 1 - a


def test_epsilon_and_mu_from_rates_on_a_gdp_curve():
    """Every test of a μ-GDP mechanism rules out no ε above the GDP conversion, and the best
    test on a fine grid reaches it; the μ read from any point of its curve is μ."""
    mu, delta = 1.3, 1e-3
    alpha = np.logspace(-9, -1e-9, 20000)
    beta = gdp_tradeoff(alpha, mu)
    assert np.allclose(mu_from_rates(alpha[100:-100], beta[100:-100]), mu, atol=1e-6)
    eps = epsilon_from_rates(alpha, beta, delta)
    assert eps.max() <= gdp_epsilon(mu, delta) + 1e-9
    assert eps.max() == pytest.approx(gdp_epsilon(mu, delta), abs=5e-3)


def test_epsilon_from_rates_edges():
    assert float(epsilon_from_rates(0.5, 0.5, 0.0)) == 0.0
    assert float(epsilon_from_rates(0.1, 0.2, 0.0)) == pytest.approx(math.log(0.8 / 0.1))
    assert math.isinf(float(epsilon_from_rates(0.0, 0.2, 1e-5)))
    # both orientations count: (a, b) and (b, a) give the same ε
    assert float(epsilon_from_rates(0.3, 0.01, 1e-5)) == float(epsilon_from_rates(0.01, 0.3, 1e-5))


def test_error_counts_threshold_semantics():
    out, into = np.array([0.0, 1.0, 2.0]), np.array([1.0, 3.0])
    fp, fn = error_counts(out, into, np.array([-1.0, 1.0, 5.0]))
    assert fp.tolist() == [3, 1, 0]  # D scores > t
    assert fn.tolist() == [0, 1, 2]  # D' scores <= t


def test_tradeoff_curve_from_a_gdp_profile():
    mu = 1.0
    curve = TradeoffCurve.from_epsilon_fn(
        lambda d: gdp_epsilon(mu, d), np.logspace(-10, math.log10(0.9), 200)
    )
    a = np.linspace(1e-4, 0.9, 500)
    f = curve(a)
    assert np.all(f <= gdp_tradeoff(a, mu) + 1e-12)  # finitely many points: below the curve
    assert np.max(gdp_tradeoff(a, mu) - f) < 0.01
    below = (0.1, float(gdp_tradeoff(0.1, mu + 0.2)))
    above = (0.1, float(gdp_tradeoff(0.1, mu - 0.2)))
    assert curve.violated_by(*below)[0]
    assert not curve.violated_by(*above)[0]


def test_one_run_p_value_pure_dp_is_the_binomial_tail():
    m, r, v, eps = 1000, 100, 70, 0.5
    p = math.exp(eps) / (1 + math.exp(eps))
    assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(stats.binom.sf(v - 1, r, p))
    # δ only adds; the bound grows with ε
    assert one_run_p_value(m, r, v, eps, 1e-5) > one_run_p_value(m, r, v, eps, 0.0)
    ps = [one_run_p_value(m, r, v, e, 1e-5) for e in np.linspace(0, 3, 31)]
    assert all(x <= y + 1e-15 for x, y in zip(ps, ps[1:]))
    with pytest.raises(ValueError):
        one_run_p_value(10, 20, 5, 1.0, 0.0)


def test_one_run_p_value_is_valid_for_randomized_response():
    """For an ε-DP guesser (each guess right with probability e^ε/(1+e^ε), independently), the
    p-value of "ε-DP" is at most 0.05 in at most about 5% of runs (seeded)."""
    rng = np.random.default_rng(1)
    m = r = 400
    eps = 1.0
    right = rng.binomial(r, math.exp(eps) / (1 + math.exp(eps)), size=2000)
    rejected = np.mean([one_run_p_value(m, r, int(v), eps, 0.0) <= 0.05 for v in right])
    assert 0.02 <= rejected <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)


def test_one_run_epsilon_lower_bound():
    m, r = 1000, 100
    assert one_run_epsilon_lower_bound(m, r, 50, 1e-5) == 0.0
    # all r right, δ = 0: p^r = 0.05 exactly
    p = 0.05 ** (1 / r)
    assert one_run_epsilon_lower_bound(m, r, r, 0.0) == pytest.approx(math.log(p / (1 - p)), abs=1e-6)
    lb = one_run_epsilon_lower_bound(m, r, 80, 1e-5)
    assert 0 < lb < one_run_epsilon_lower_bound(m, r, 90, 1e-5)
    assert one_run_p_value(m, r, 80, lb * 0.999, 1e-5) <= 0.05 < one_run_p_value(m, r, 80, lb * 1.01, 1e-5)
