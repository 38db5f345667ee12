"""PLD and PRV against the exact Gaussian composition (q = 1) and against each other."""
import math

import pytest
from acc_helpers import exact_gaussian_eps

from dptorch.accountants import PLDAccountant, PRVAccountant, RDPAccountant


def make(cls, history):
    acc = cls()
    acc.history = list(history)
    return acc


@pytest.mark.parametrize("sigma,k,delta", [(1.0, 1, 1e-5), (0.5, 1, 1e-12), (2.0, 50, 1e-5),
                                           (0.3, 10, 1e-5), (20.0, 10**6, 1e-12)])
def test_pld_upper_bounds_exact(sigma, k, delta):
    exact = exact_gaussian_eps(sigma, k, delta)
    eps = make(PLDAccountant, [(sigma, 1.0, k)]).get_epsilon(delta)
    assert exact <= eps <= exact * 1.0025 + 1e-9  # eps_error = 0.01: 0.25 % relative


@pytest.mark.parametrize("sigma,k,delta", [(1.0, 1, 1e-5), (0.5, 1, 1e-12), (2.0, 20, 1e-5)])
def test_prv_upper_bounds_exact(sigma, k, delta):
    exact = exact_gaussian_eps(sigma, k, delta)
    eps = make(PRVAccountant, [(sigma, 1.0, k)]).get_epsilon(delta, eps_error=0.02)
    # eps_error = 0.02 aims at an excess of 0.5 % relative
    assert exact <= eps <= exact * 1.005


def test_mnist_setting_orders():
    hist = [(1.1, 256 / 60000, 14062)]
    pld = make(PLDAccountant, hist).get_epsilon(1e-5)
    prv = make(PRVAccountant, hist).get_epsilon(1e-5, eps_error=0.05)
    rdp = make(RDPAccountant, hist).get_epsilon(1e-5)
    assert abs(pld - prv) <= 0.06
    assert pld < rdp and prv < rdp
    assert 2.3 < pld < 2.45


def test_heterogeneous_history_and_large_eps():
    two = [(1.0, 0.05, 200), (3.0, 0.05, 300)]
    pld2 = make(PLDAccountant, two).get_epsilon(1e-6)
    prv2 = make(PRVAccountant, two).get_epsilon(1e-6, eps_error=0.05)
    assert abs(pld2 - prv2) < 0.06
    # composing the phases costs more than either phase alone
    assert pld2 > make(PLDAccountant, two[:1]).get_epsilon(1e-6)
    # huge epsilon (> 30) works and stays an upper bound of the full-batch value
    big = make(PLDAccountant, [(0.3, 1.0, 3)]).get_epsilon(1e-5)
    assert big >= exact_gaussian_eps(0.3, 3, 1e-5) > 30


def test_zero_noise_and_empty():
    assert make(PLDAccountant, []).get_epsilon(1e-5) == 0.0
    assert math.isinf(make(PLDAccountant, [(0.0, 0.5, 3)]).get_epsilon(1e-5))
    assert math.isinf(make(PRVAccountant, [(0.0, 0.5, 3)]).get_epsilon(1e-5))
