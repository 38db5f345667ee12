"""ε is monotone: non-decreasing in the number of steps, non-increasing in σ and in δ (property
tests with hypothesis, over the parameter box of issue 16 with T kept affordable).

PLD and PRV are monotone by construction (the lattice spacing depends on neither T nor δ and
only gets finer, on nested lattices, as σ grows; see dptorch.accountants.analysis.pld), so
the comparisons allow only float round-off."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dptorch.accountants import PLDAccountant, PRVAccountant, RDPAccountant

#: round-off allowance: relative and absolute
REL, ABS = 1e-9, 1e-12

qs = st.one_of(st.sampled_from([1.0, 256 / 60000]), st.floats(1e-5, 1.0))
sigmas = st.floats(0.3, 50.0)
deltas = st.floats(1e-12, 1e-2)
steps = st.integers(1, 3000)
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def eps(cls, sigma, q, t, delta):
    acc = cls()
    acc.history = [(sigma, q, t)]
    return acc.get_epsilon(delta)


def le(a, b):
    return a <= b * (1 + REL) + ABS


@pytest.mark.parametrize("cls", [PLDAccountant, PRVAccountant])
@SETTINGS
@given(q=qs, sigma=sigmas, delta=deltas, t=steps, more=st.integers(1, 3000))
def test_monotone_in_steps(cls, q, sigma, delta, t, more):
    assert le(eps(cls, sigma, q, t, delta), eps(cls, sigma, q, t + more, delta))
    assert le(eps(cls, sigma, q, t, delta), eps(cls, sigma, q, t + 1, delta))


@pytest.mark.parametrize("cls", [PLDAccountant, PRVAccountant])
@SETTINGS
@given(q=qs, sigma=sigmas, delta=deltas, t=steps, factor=st.floats(1.0, 1.5))
def test_monotone_in_sigma(cls, q, sigma, delta, t, factor):
    assert le(eps(cls, sigma * factor, q, t, delta), eps(cls, sigma, q, t, delta))


@pytest.mark.parametrize("cls", [PLDAccountant, PRVAccountant])
@SETTINGS
@given(q=qs, sigma=sigmas, delta=deltas, t=steps, factor=st.floats(1.0, 100.0))
def test_monotone_in_delta(cls, q, sigma, delta, t, factor):
    assert le(eps(cls, sigma, q, t, min(delta * factor, 0.5)), eps(cls, sigma, q, t, delta))


@settings(max_examples=20, deadline=None)
@given(q=qs, sigma=sigmas, delta=deltas, t=steps, more=st.integers(1, 1000),
       factor=st.floats(1.0, 1.5))
def test_rdp_monotone(q, sigma, delta, t, more, factor):
    base = eps(RDPAccountant, sigma, q, t, delta)
    assert le(base, eps(RDPAccountant, sigma, q, t + more, delta))
    assert le(eps(RDPAccountant, sigma * factor, q, t, delta), base)
    assert le(eps(RDPAccountant, sigma, q, t, min(1.5 * delta, 0.5)), base)


@pytest.mark.parametrize("sigma,q", [(1.0, 256 / 60000), (0.3, 1e-3), (50.0, 0.05), (1.0, 1.0)])
def test_short_horizon_is_monotone(sigma, q):
    """Every T from 1 to 60 (the looseness at small T of issue 16 made T = 1 the largest)."""
    values = [eps(PLDAccountant, sigma, q, t, 1e-5) for t in range(1, 61)]
    assert all(le(a, b) for a, b in zip(values, values[1:]))
