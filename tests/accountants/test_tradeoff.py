"""f-DP trade-off curves and μ: below the exact curve, close to it, consistent with ε."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.special import ndtr, ndtri

from dptorch.accountants import (
    GaussianAccountant,
    GaussianEvent,
    PLDAccountant,
    PoissonSampledEvent,
    PRVAccountant,
    RDPAccountant,
)

ALPHA = np.concatenate((np.logspace(-9, -1, 33), np.linspace(0.1, 1.0, 37)))


def gdp_curve(alpha, mu):
    return ndtr(ndtri(1 - alpha) - mu)


@pytest.mark.parametrize("cls", [PLDAccountant, PRVAccountant])
@pytest.mark.parametrize("sigma,t,relation", [(1.0, 1, "add_remove"), (2.0, 100, "add_remove"),
                                              (3.0, 10, "replace_one")])
def test_full_batch_curve_is_a_tight_lower_bound(cls, sigma, t, relation):
    mu = (2.0 if relation == "replace_one" else 1.0) * math.sqrt(t) / sigma
    acc = cls(neighboring_relation=relation).compose(GaussianEvent(sigma), t)
    beta = acc.get_tradeoff_curve(ALPHA)
    exact = gdp_curve(ALPHA, mu)
    assert np.all(beta <= exact + 1e-12)
    assert np.max(exact - beta) < 5e-3
    got = acc.get_mu()
    assert mu * (1 - 1e-9) <= got <= mu * 1.01


def test_curve_is_consistent_with_epsilon():
    """The accounted curve lies above f_{ε,δ}: the training is (ε(δ), δ)-DP for each δ."""
    acc = PRVAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 1000)
    beta = acc.get_tradeoff_curve(ALPHA)
    for delta in (1e-8, 1e-5, 1e-3):
        eps = acc.get_epsilon(delta) * 1.001
        f = np.maximum.reduce([np.zeros_like(ALPHA), 1 - delta - math.exp(eps) * ALPHA,
                               math.exp(-eps) * (1 - delta - ALPHA)])
        assert np.all(beta >= f - 1e-9)
    assert np.all(np.diff(beta) <= 1e-15) and beta[-1] == 0.0  # decreasing, β(1) = 0


def test_mu_many_steps_matches_the_clt_and_warns_when_not_gaussian():
    acc = PRVAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 10_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mu = acc.get_mu()
    clt = 0.01 * math.sqrt(10_000 * math.expm1(1.0))
    assert clt < mu < 1.1 * clt
    one = PRVAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1.0)))
    with pytest.warns(UserWarning, match="not Gaussian-like"):
        one.get_mu()


def test_rdp_and_gdp_curves():
    event = PoissonSampledEvent(0.02, GaussianEvent(1.2))
    pld = PLDAccountant().compose(event, 500).get_tradeoff_curve(ALPHA)
    rdp = RDPAccountant().compose(event, 500).get_tradeoff_curve(ALPHA)
    assert np.all(rdp <= pld + 1e-9)  # RDP is looser: its curve lies lower
    assert np.mean(pld - rdp) < 0.05
    with pytest.warns(UserWarning, match="CLT"):
        gdp = GaussianAccountant()
    gdp.compose(event, 500)
    np.testing.assert_allclose(gdp.get_tradeoff_curve(ALPHA), gdp_curve(ALPHA, gdp.get_mu()))
    assert gdp.get_delta(1.0) == pytest.approx(
        ndtr(-1 / gdp.get_mu() + gdp.get_mu() / 2)
        - math.exp(1.0) * ndtr(-1 / gdp.get_mu() - gdp.get_mu() / 2))


def test_get_delta_inverts_get_epsilon():
    acc = PLDAccountant().compose(PoissonSampledEvent(256 / 60000, GaussianEvent(1.1)), 14_062)
    eps = acc.get_epsilon(1e-5)
    assert acc.get_delta(eps) == pytest.approx(1e-5, rel=1e-3)
    rdp = RDPAccountant().compose(PoissonSampledEvent(256 / 60000, GaussianEvent(1.1)), 14_062)
    assert rdp.get_delta(rdp.get_epsilon(1e-5)) == pytest.approx(1e-5, rel=1e-6)
