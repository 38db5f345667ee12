"""Accountants charge the truncation of fixed-shape batches themselves: every ε and δ they report
(get_epsilon, get_delta, RDP's get_privacy_spent) pays ``(1 + e^ε)·τ``, checked against the same
accountant without truncation and the closed form of the coupling bound."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from scipy.stats import binom

from dptorch.accountants import create_accountant
from dptorch.accountants.truncation import Truncation
from dptorch.sampling import check_truncation

N, M, Q, STEPS, SIGMA = 60, 17, 0.1, 25, 1.0


def _accountants(name: str):
    acc = create_accountant(name)
    for _ in range(STEPS):
        acc.step(noise_multiplier=SIGMA, sample_rate=Q)
    poisson = copy.deepcopy(acc)
    acc.truncation = Truncation(N, M)
    return acc, poisson


@pytest.mark.parametrize("name", ["rdp", "prv", "pld", "gdp"])
def test_epsilon_is_the_fixed_point_of_the_coupling_bound(name):
    acc, poisson = _accountants(name)
    tau = STEPS * binom.sf(M, N + 1, Q)
    assert acc.truncation_tau() == pytest.approx(tau, rel=1e-12)
    delta = 1e-2
    eps = acc.get_epsilon(delta)
    assert eps == acc.get_epsilon(delta=delta)  # positional and keyword alike
    assert poisson.get_epsilon(delta - (1 + math.exp(eps)) * tau) <= eps + 1e-12
    assert poisson.get_epsilon(delta - (1 + math.exp(eps - 1e-6)) * tau) > eps - 1e-6
    assert eps > poisson.get_epsilon(delta)


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_delta_adds_the_truncation_cost(name):
    acc, poisson = _accountants(name)
    tau = acc.truncation_tau()
    for eps in (0.5, 2.0):
        assert acc.get_delta(eps) == pytest.approx(
            min(1.0, poisson.get_delta(eps) + (1 + math.exp(eps)) * tau), rel=1e-9)


def test_rdp_privacy_spent_and_epsilon_agree():
    acc, _ = _accountants("rdp")
    eps, order = acc.get_privacy_spent(delta=1e-2)
    assert eps == acc.get_epsilon(1e-2) and order > 1


def test_without_truncation_nothing_changes():
    acc, poisson = _accountants("rdp")
    acc.truncation = None
    assert acc.get_epsilon(1e-5) == poisson.get_epsilon(1e-5)


def test_state_dict_keeps_the_truncation():
    acc, _ = _accountants("prv")
    buf = io.BytesIO()
    torch.save(acc.state_dict(), buf)
    buf.seek(0)
    fresh = create_accountant("prv")
    fresh.load_state_dict(torch.load(buf, weights_only=False))
    assert fresh.truncation == acc.truncation
    assert fresh.get_epsilon(1e-2) == acc.get_epsilon(1e-2)


def test_one_accountant_charges_one_truncation():
    acc, _ = _accountants("rdp")
    check_truncation(acc, Truncation(N, M))
    for other in (None, Truncation(N, M + 1)):
        with pytest.raises(ValueError, match="one\naccountant|one accountant"):
            check_truncation(acc, other)
    check_truncation(create_accountant("rdp"), None)  # no steps yet: anything goes
