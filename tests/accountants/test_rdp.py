import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.stats import norm

from dptorch.accountants import RDPAccountant
from dptorch.accountants.analysis.rdp import compute_rdp, get_privacy_spent

N, B = 60000, 256
Q = B / N


def rdp_by_quad(q, sigma, alpha):
    """Rényi divergence of order alpha between the SGM mixture and N(0, sigma^2), by quad."""
    def f(z):
        ratio = 1 - q + q * math.exp((2 * z - 1) / (2 * sigma**2))
        return ratio**alpha * norm.pdf(z, scale=sigma)
    val, _ = integrate.quad(f, -20 * sigma, alpha + 20 * sigma, limit=500, epsabs=0, epsrel=1e-12,
                            points=[0.0, alpha])
    return math.log(val) / (alpha - 1)


@pytest.mark.parametrize("sigma,alpha", [(0.8, 1.5), (1.1, 3.3), (2.0, 7.7), (1.1, 4), (0.7, 12)])
@pytest.mark.parametrize("q", [0.01, 0.2])
def test_rdp_matches_quadrature(q, sigma, alpha):
    got = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=alpha)
    assert got == pytest.approx(rdp_by_quad(q, sigma, alpha), rel=1e-7)


@pytest.mark.parametrize("sigma", [0.5, 1.3, 7.0])
def test_rdp_full_batch_closed_form(sigma):
    orders = [1.5, 2, 10.5, 63]
    got = compute_rdp(q=1.0, noise_multiplier=sigma, steps=7, orders=orders)
    np.testing.assert_allclose(got, [7 * a / (2 * sigma**2) for a in orders], rtol=1e-14)


def test_rdp_degenerate():
    assert math.isinf(compute_rdp(q=0.1, noise_multiplier=0.0, steps=1, orders=2))
    assert compute_rdp(q=0.0, noise_multiplier=1.0, steps=10, orders=2) == 0.0
    acc = RDPAccountant()
    acc.step(noise_multiplier=0.0, sample_rate=0.1)
    assert math.isinf(acc.get_epsilon(1e-5))


@pytest.mark.parametrize("sigma,epochs,expected", [(1.1, 60, 3.01), (1.3, 15, 1.19), (0.7, 45, 7.10)])
def test_tf_privacy_published_figures(sigma, epochs, expected):
    acc = RDPAccountant()
    acc.history = [(sigma, Q, int(epochs * N / B))]
    assert round(acc.get_epsilon(1e-5, conversion="classic"), 2) == expected
    assert acc.get_epsilon(1e-5) < expected - 0.2  # improved conversion is tighter


def test_conversions_known_values():
    orders, rdp = np.array([2.0, 5.0]), np.array([0.5, 2.0])
    eps, a = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5, conversion="classic")
    assert eps == pytest.approx(min(0.5 + math.log(1e5), 2.0 + math.log(1e5) / 4)) and a == 5.0
    eps_i, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert eps_i == pytest.approx(2.0 + math.log(4 / 5) - (math.log(1e-5) + math.log(5)) / 4)
    with pytest.raises(ValueError, match="conversion"):
        get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5, conversion="bad")


@settings(max_examples=15, deadline=None)
@given(q=st.floats(0.001, 0.9), sigma=st.floats(0.5, 5.0), steps=st.integers(1, 1000),
       factor=st.floats(1.01, 2.0))
def test_rdp_monotone(q, sigma, steps, factor):
    orders = [1.5, 2.0, 8.0, 32.0]
    base = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    more_steps = compute_rdp(q=q, noise_multiplier=sigma, steps=steps + 1, orders=orders)
    more_noise = compute_rdp(q=q, noise_multiplier=sigma * factor, steps=steps, orders=orders)
    more_q = compute_rdp(q=min(q * factor, 1.0), noise_multiplier=sigma, steps=steps, orders=orders)
    assert np.all(more_steps > base)
    assert np.all(more_noise < base)
    assert np.all(more_q > base)
