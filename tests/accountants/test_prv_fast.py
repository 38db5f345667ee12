"""The shared PLD/PRV engine: upper bounds against independent references, the add direction
derived by swapping, the error budget, and fast noise calibration with the PRV accountant."""
import time

import pytest
from acc_helpers import exact_gaussian_eps, single_step_gap

from dptorch.accountants import (
    PLDAccountant,
    PRVAccountant,
    create_accountant,
    get_noise_multiplier,
)
from dptorch.accountants.analysis.lattice import compose_and_invert
from dptorch.accountants.analysis.pld import discretize_connect_the_dots


def make(cls, history):
    acc = cls()
    acc.history = list(history)
    return acc


@pytest.mark.parametrize("sigma,k,delta", [(0.3, 1000, 1e-5), (0.5, 2, 1e-12), (1.0, 3, 1e-5),
                                           (5.0, 100, 1e-12), (0.3, 1, 1e-5)])
@pytest.mark.parametrize("eps_error", [0.01, 0.05])
def test_prv_error_budget_q1(sigma, k, delta, eps_error):
    """At q = 1 the exact ε is known: the bound holds and its excess stays within the relative
    budget ``eps_error/4``."""
    exact = exact_gaussian_eps(sigma, k, delta)
    eps = make(PRVAccountant, [(sigma, 1.0, k)]).get_epsilon(delta, eps_error=eps_error)
    assert exact <= eps <= exact * (1 + eps_error / 4) + 1e-9


@pytest.mark.parametrize("q,sigma", [(0.01, 0.8), (0.3, 1.5), (0.9, 0.8)])
def test_single_step_both_directions_by_quadrature(q, sigma):
    h, delta = 1e-3, 1e-5
    remove, add = discretize_connect_the_dots(q, sigma, h, 1e-14)
    for lattice, direction in [(remove, "remove"), (add, "add")]:
        eps = compose_and_invert([(lattice, 1)], delta)
        # connect-the-dots is exact on the lattice: exact ≤ eps ≤ exact + h
        assert single_step_gap(eps + 1e-9, q, sigma, delta, direction) <= 0
        assert eps == 0.0 or single_step_gap(eps - h, q, sigma, delta, direction) > 0
    eps = make(PRVAccountant, [(sigma, q, 1)]).get_epsilon(delta)
    assert all(single_step_gap(eps + 1e-9, q, sigma, delta, d) <= 0 for d in ("remove", "add"))
    assert max(single_step_gap(eps * 0.995, q, sigma, delta, d) for d in ("remove", "add")) > 0


@pytest.mark.parametrize("history,opacus_interval", [
    # Opacus 1.6.0 PRV (eps_error=0.01, delta_error=1e-8) at delta=1e-5: (lower, upper) ends
    ([(1.1, 256 / 60000, 14062)], (2.37146, 2.39174)),
    ([(3.0, 256 / 60000, 10**4)], (0.50885, 0.52892)),
    ([(0.8, 0.05, 2000)], (26.56579, 26.58807)),
])
def test_within_opacus_error_interval_and_tighter(history, opacus_interval):
    """Above Opacus's lower end; within 0.25 % (the default relative target) of its upper end,
    and inside its interval once eps_error is small enough."""
    lo, hi = opacus_interval
    prv = make(PRVAccountant, history).get_epsilon(1e-5)
    pld = make(PLDAccountant, history).get_epsilon(1e-5)
    assert prv == pld and lo <= prv <= hi * 1.0025
    fine = make(PRVAccountant, history).get_epsilon(1e-5, eps_error=0.002)
    assert lo <= fine <= hi and fine <= prv <= fine * 1.003  # the excess shrinks with eps_error


def test_long_history_is_fast():
    acc = make(PRVAccountant, [(1.1, 256 / 60000, 10**6)])
    t = time.perf_counter()
    eps = acc.get_epsilon(1e-5)
    assert time.perf_counter() - t < 5.0  # ~0.3 s; generous for slow CI machines
    assert 31.5 < eps < 31.6  # Opacus 1.6.0 PRV: 31.598


@pytest.mark.parametrize("q,epochs,target", [(256 / 1437, 20, 3.0), (0.01, 5, 2.0)])
def test_get_noise_multiplier_prv_round_trip(q, epochs, target):
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=q,
                                 epochs=epochs, accountant="prv")
    steps = int(epochs / q)
    acc = create_accountant("prv")
    acc.history = [(sigma, q, steps)]
    eps = acc.get_epsilon(1e-5)
    assert eps <= target and target - eps <= 0.01
    acc.history = [(sigma - 0.01, q, steps)]
    assert acc.get_epsilon(1e-5) > target
    # the RDP calibration is an upper bound on the noise needed
    rdp = get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=q,
                               epochs=epochs, accountant="rdp")
    assert sigma <= rdp
