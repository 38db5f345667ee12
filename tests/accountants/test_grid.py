"""PLD and PRV against dp-accounting's PLD on a grid, against the exact Gaussian mechanism
(q = 1), and against the exact one- and two-step ε by quadrature.

The grid (``data/dp_accounting_pld.json``, written by ``make_reference.py``, which documents
the choice of points and of the discretisation) covers q ∈ [1e-5, 1], σ ∈ [0.3, 50],
T ∈ [1, 10⁷], δ ∈ [1e-12, 1e-2] and both neighbouring relations. The reference at each point is
dp-accounting's PLD: its one-step pessimistic (upper) and optimistic (lower) PMFs composed in
long double, since dp-accounting's own float64 composition is dominated by FFT round-off at
δ = 1e-12 after ~100 steps (its accountant's ε there can be 8 % below the exact value, or twice
it; the file keeps those numbers too). At each point:

* **tight**: dptorch's ε ≤ max(1.005·upper, upper + 1e-3) (``upper``: the exact ε at q = 1);
* **never below the exact value**: dptorch's ε ≥ lower, up to round-off.

Where dp-accounting's own accountant is accurate (δ ≥ 1e-8, and it agrees with the long-double
composition), dptorch is also within the tolerance of it.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from acc_helpers import exact_gaussian_eps, single_step_exact, two_step_exact

from dptorch.accountants import GaussianEvent, PLDAccountant, PoissonSampledEvent, PRVAccountant
from dptorch.accountants.analysis.pld import compute_epsilon_pld

DATA = os.path.join(os.path.dirname(__file__), "data", "dp_accounting_pld.json")
with open(DATA) as _f:
    POINTS = json.load(_f)["points"]

REL_TOL, ABS_TOL = 0.005, 1e-3
ROUNDOFF = 1e-9


def ours(p: dict) -> float:
    return compute_epsilon_pld([(p["sigma"], p["q"], p["steps"])], p["delta"],
                               relation=p["relation"])


def test_grid_covers_the_parameter_box():
    assert len(POINTS) >= 200
    qs = {p["q"] for p in POINTS}
    sigmas = {p["sigma"] for p in POINTS}
    steps = {p["steps"] for p in POINTS}
    deltas = {p["delta"] for p in POINTS}
    assert {1, 2, 3, 1_000_000, 10_000_000} <= steps and 1.0 in qs and 1e-5 in qs
    assert {0.3, 50.0} <= sigmas and {1e-12, 1e-2} <= deltas
    assert {p["relation"] for p in POINTS} == {"add_remove", "replace_one"}


def _bounds(p: dict) -> tuple[float, float]:
    if "exact" in p:
        return p["exact"], p["exact"]
    return p["pld_pessimistic"], p["pld_optimistic"]


def within(eps: float, ref: float) -> bool:
    return eps <= max(ref * (1 + REL_TOL), ref + ABS_TOL)


def test_grid_against_dp_accounting():
    """Every point within tolerance, none below the exact value (the first offenders in the
    message)."""
    worst_gap, failures, below, vs_accountant = 0.0, [], [], 0
    start = time.perf_counter()
    for p in POINTS:
        eps = ours(p)
        upper, lower = _bounds(p)
        if eps - upper > ABS_TOL:
            worst_gap = max(worst_gap, (eps - upper) / upper)
        if not within(eps, upper):
            failures.append((p, eps))
        if eps < lower * (1 - ROUNDOFF) - 1e-12:
            below.append((p, eps))
        acc = p.get("dp_accounting_accountant")
        if acc is not None and p["delta"] >= 1e-8 and abs(acc - upper) <= 5e-4 * upper:
            vs_accountant += 1
            assert within(eps, acc) and eps >= p["pld_optimistic"], (p, eps)
    elapsed = time.perf_counter() - start
    assert not failures, f"above tolerance: {failures[:5]}"
    assert not below, f"below the exact value: {below[:5]}"
    assert worst_gap <= REL_TOL
    assert vs_accountant >= 100  # most points also checked against dp-accounting end to end
    assert elapsed < 40.0


@pytest.mark.parametrize("sigma,k,delta", [
    (1.0, 1, 1e-5), (0.5, 1, 1e-12), (2.0, 50, 1e-5), (0.3, 10, 1e-5), (20.0, 10**6, 1e-12),
    (50.0, 1, 1e-2), (0.3, 3, 1e-12), (5.0, 1000, 1e-8)])
@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_closed_form_gaussian(sigma, k, delta, relation):
    """q = 1 is the Gaussian mechanism (sensitivity 2 under replace-one): exact ε known."""
    exact = exact_gaussian_eps(sigma, k, delta, 2.0 if relation == "replace_one" else 1.0)
    acc = PLDAccountant(neighboring_relation=relation)
    acc.history = [(sigma, 1.0, k)]
    eps = acc.get_epsilon(delta)
    assert exact * (1 - ROUNDOFF) <= eps <= max(exact * (1 + 0.0025), exact + ABS_TOL)


@pytest.mark.parametrize("q,sigma,delta", [
    (256 / 60000, 1.0, 1e-5), (0.9, 0.8, 1e-5), (1e-3, 0.3, 1e-12), (1e-5, 0.6, 1e-12)])
@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_single_step_against_quadrature(q, sigma, delta, relation):
    """T = 1: the exact ε by quadrature of the privacy profile (both directions)."""
    exact = single_step_exact(q, sigma, delta, relation)
    acc = PRVAccountant(neighboring_relation=relation)
    eps = acc.compose(PoissonSampledEvent(q, GaussianEvent(sigma))).get_epsilon(delta)
    assert exact * (1 - ROUNDOFF) - 1e-12 <= eps <= max(exact * 1.0025, exact + 1e-4)


@pytest.mark.parametrize("q,sigma,delta,relation", [
    (1e-3, 0.6, 1e-12, "add_remove"), (0.05, 2.0, 1e-8, "replace_one")])
def test_two_steps_against_quadrature(q, sigma, delta, relation):
    """T = 2: one step integrated against the other's closed-form profile."""
    exact = two_step_exact(q, sigma, delta, relation)
    eps = compute_epsilon_pld([(sigma, q, 2)], delta, relation=relation)
    assert exact * (1 - ROUNDOFF) - 1e-12 <= eps <= max(exact * 1.0025, exact + 1e-4)


def test_issue_16_mnist_single_step():
    """The reported case: q = 256/60000, σ = 1, δ = 1e-5, one step: exact ≈ 0.0678."""
    acc = PRVAccountant()
    acc.history = [(1.0, 256 / 60000, 1)]
    eps = acc.get_epsilon(1e-5)
    assert 0.0677 < eps < 0.0679
    step = PoissonSampledEvent(256 / 60000, GaussianEvent(1.0))
    values = [PLDAccountant().compose(step, t).get_epsilon(1e-5) for t in (1, 2, 5)]
    assert [round(v, 4) for v in values] == [0.0678, 0.0865, 0.1164]


def test_live_dp_accounting_on_cheap_points():
    """A few points straight from dp-accounting (a test extra), not from the data file."""
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.privacy_accountant import NeighboringRelation as Rel

    for q, sigma, t, delta, rel in [(256 / 60000, 1.0, 3, 1e-5, "add_remove"),
                                    (0.05, 2.0, 50, 1e-8, "add_remove"),
                                    (0.05, 2.0, 20, 1e-5, "replace_one")]:
        ref_acc = pld_privacy_accountant.PLDAccountant(
            Rel.REPLACE_ONE if rel == "replace_one" else Rel.ADD_OR_REMOVE_ONE, 1e-4)
        ref_acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), t)
        ref = ref_acc.get_epsilon(delta)
        eps = compute_epsilon_pld([(sigma, q, t)], delta, relation=rel)
        assert abs(eps - ref) <= max(REL_TOL * ref, ABS_TOL), (q, sigma, t, delta, rel, eps, ref)
