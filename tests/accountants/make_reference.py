"""Generates ``data/dp_accounting_pld.json``: dp-accounting's PLD ε for the accountant grid.

Run (about ten minutes on 2 cores; needs ``pip install dp-accounting``, the test extra):

    .venv/bin/python tests/accountants/make_reference.py [--jobs 2]

For every point ``(q, σ, T, δ, relation)`` of :func:`grid` it stores, at the discretisation
interval ``h`` stored beside them (:func:`interval`: fine enough that dp-accounting's own
discretisation error is well inside the tolerance, coarse enough that its arrays stay small):

* ``pld_pessimistic`` / ``pld_optimistic``: dp-accounting's one-step PLD (its connect-the-dots
  pessimistic PMF, an upper bound, and its privacy-buckets optimistic PMF, a lower bound, for
  each direction) composed ``T`` times by FFT in 80-bit long double (:func:`compose_ld`) and
  inverted exactly. dp-accounting composes in float64 without tilting, so its own accountant's
  ε is dominated by FFT round-off at δ = 1e-12 after ~100 steps (its pessimistic ε moves by
  ±8 % with ``h``, its optimistic one can exceed it); in long double the round-off is ~1e-19.
* ``dp_accounting_accountant``: dp-accounting's ``PLDAccountant`` end to end, for comparison.

At ``q = 1`` the exact ε of the Gaussian mechanism (μ = √T/σ, or 2√T/σ under replace-one) is
stored instead. Nothing in the file is typed by hand; ``test_grid.py`` reads it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "data", "dp_accounting_pld.json")

MNIST_Q = 256 / 60000


def grid() -> list[dict]:
    """The points: a seeded random sample of a factorial design, plus every combination the
    issue names (T = 1, 2, 3; q = 1; δ = 1e-12; σ = 0.3 and 50), plus the MNIST short-horizon
    table of docs/privacy.md and replace-one points."""
    qs = [1e-5, 1e-3, MNIST_Q, 0.05, 0.3, 1.0]
    sigmas = [0.3, 0.6, 1.0, 2.0, 5.0, 50.0]
    ts = [1, 2, 3, 10, 100, 1000, 10_000, 100_000]
    deltas = [1e-12, 1e-8, 1e-5, 1e-2]
    full = [(q, s, t, d) for q in qs for s in sigmas for t in ts for d in deltas]
    rng = np.random.default_rng(20240611)
    pick = set(int(i) for i in rng.choice(len(full), size=170, replace=False))
    points = [full[i] for i in sorted(pick)]
    # the named corners, each with the others drawn from the grid
    for t in (1, 2, 3):
        for s in (0.3, 1.0, 50.0):
            points.append((MNIST_Q, s, t, 1e-5))
            points.append((1e-3, s, t, 1e-12))
    for s in (0.3, 50.0):
        for q in (1e-5, 0.05, 1.0):
            points.append((q, s, 1000, 1e-12))
            points.append((q, s, 10, 1e-2))
    for t in (1, 10, 10_000, 1_000_000):
        points.append((1.0, 1.0, t, 1e-5))
        points.append((1.0, 0.3, t, 1e-12))
    points += [(MNIST_Q, 1.1, 14_062, 1e-5), (MNIST_Q, 1.1, 1_000_000, 1e-5),
               (0.01, 2.0, 1_000_000, 1e-8), (1e-5, 5.0, 10_000_000, 1e-5)]
    points += [(MNIST_Q, 1.0, t, 1e-5) for t in range(1, 11)]  # the docs table
    out = [dict(q=q, sigma=s, steps=t, delta=d, relation="add_remove") for q, s, t, d in points]
    for q, s, t, d in [(MNIST_Q, 1.0, 1, 1e-5), (MNIST_Q, 1.0, 3, 1e-5), (MNIST_Q, 1.0, 1000, 1e-5),
                       (0.05, 0.6, 10, 1e-8), (0.05, 2.0, 1000, 1e-12), (1e-3, 0.3, 100, 1e-5),
                       (0.3, 1.0, 100, 1e-2), (1.0, 1.0, 10, 1e-5), (1.0, 2.0, 1, 1e-12),
                       (1e-5, 5.0, 100_000, 1e-8), (0.01, 1.0, 10_000, 1e-5),
                       (MNIST_Q, 0.6, 2, 1e-12)]:
        out.append(dict(q=q, sigma=s, steps=t, delta=d, relation="replace_one"))
    seen, unique = set(), []
    for p in out:
        key = tuple(sorted(p.items()))
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def step_sd(q: float, sigma: float) -> float:
    """sd of one step's loss (add/remove remove direction), by quadrature."""
    s = sigma
    x = np.linspace(-13 * s, 1 + 13 * s, 4001)
    w = q * np.exp(-0.5 * ((x - 1) / s) ** 2) + (1 - q) * np.exp(-0.5 * (x / s) ** 2)
    w /= w.sum()
    loss = np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + (2 * x - 1) / (2 * s * s))
    m = float((w * loss).sum())
    return math.sqrt(float((w * (loss - m) ** 2).sum()))


def interval(q: float, sigma: float, steps: int) -> float:
    """The discretisation interval of dp-accounting's PLD: at most 1e-4 and 2 % of a step's loss
    sd (its connect-the-dots excess is then ~1e-4 relative), but coarse enough that one step's
    PMF (up to the 1e-22 tail, dp-accounting's truncation) has at most 2e5 points and the
    composed PMF (about 20 sd of the sum wide) at most 4e6."""
    sd = step_sd(q, sigma)
    h = min(1e-4, 0.02 * sd)
    x_hi = 1 + 9.8 * sigma
    top = math.log(1 - q + q * math.exp((2 * x_hi - 1) / (2 * sigma * sigma)))
    return max(h, top / 2e5, 20 * sd * math.sqrt(steps) / 4e6, 1e-9)


# ---------------------------------------------------------------------------- composition
LD = np.longdouble
TAIL = 1e-30  # mass of the composed sum left out of the window on each side (Chernoff)


def _dense(pmf):
    d = pmf.to_dense_pmf()
    return d._discretization, int(d._lower_loss), np.asarray(d._probs, dtype=np.float64), float(
        d._infinity_mass)


def _window(t: np.ndarray, p: np.ndarray, steps: int) -> tuple[float, float]:
    """Chernoff bounds: the sum of ``steps`` copies is outside [lo, hi] with mass ≤ TAIL."""
    nz = p > 0
    t, logp = t[nz], np.log(p[nz])

    def cgf(lam: float) -> float:
        a = logp + lam * t
        top = a.max()
        return steps * float(top + np.log(np.exp(a - top).sum()))

    lams = np.geomspace(1e-4, 1e4, 81)
    hi = min((cgf(lam) - math.log(TAIL)) / lam for lam in lams)
    lo = max(-(cgf(-lam) - math.log(TAIL)) / lam for lam in lams)
    return lo, hi


def compose_ld(pmf, steps: int):
    """dp-accounting's one-step PMF composed ``steps`` times by FFT in 80-bit long double
    (round-off ~1e-19, so δ = 1e-12 keeps ~7 digits; dp-accounting's own float64 composition
    does not, see test_grid.py). Returns (losses, masses, infinity mass); the mass left out of
    the window (≤ 2·TAIL) is negligible."""
    from scipy import fft as sfft

    h, lower, p, inf = _dense(pmf)
    t = (lower + np.arange(p.size)) * h
    lo, hi = _window(t, p, steps)
    i_lo, i_hi = math.floor(lo / h) - 1, math.ceil(hi / h) + 1
    n = sfft.next_fast_len(i_hi - i_lo + 1, real=True)
    if n > 1 << 24:
        raise ValueError(f"window of {n} points")
    idx = lower + np.arange(p.size)
    folded = np.bincount(np.mod(idx, n), weights=p, minlength=n).astype(LD)
    spec = sfft.rfft(folded) ** steps
    g = np.roll(sfft.irfft(spec, n=n), -(i_lo % n))
    losses = ((i_lo + np.arange(n)) * h).astype(LD)
    inf_total = 1 - (1 - LD(inf)) ** steps
    return losses, g, inf_total


def epsilon_ld(composed, delta: float) -> float:
    """Smallest ε ≥ 0 with Σ_t g_t (1 − e^{ε−t})_+ + inf ≤ δ (bisection on the exact profile)."""
    losses, g, inf = composed
    if inf >= delta:
        return math.inf

    def dlt(eps):
        m = losses > eps
        return inf + (g[m] * -np.expm1(LD(eps) - losses[m])).sum()

    if dlt(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while dlt(hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if dlt(mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
    return float(hi)


def exact_gaussian(mu: float, delta: float) -> float:
    from scipy.optimize import brentq
    from scipy.stats import norm

    def gap(e):
        return norm.cdf(-e / mu + mu / 2) - math.exp(e + norm.logcdf(-e / mu - mu / 2)) - delta

    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0:
        hi *= 2
    return brentq(gap, 0.0, hi, xtol=1e-13, rtol=1e-15)


def reference(p: dict) -> dict:
    logging.disable(logging.WARNING)
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant as pld_acc
    from dp_accounting.pld import privacy_loss_distribution as pldm
    from dp_accounting.privacy_accountant import NeighboringRelation as Rel

    q, s, t, d = p["q"], p["sigma"], p["steps"], p["delta"]
    replace = p["relation"] == "replace_one"
    out = dict(p)
    start = time.time()
    if q == 1.0:
        out["exact"] = exact_gaussian((2.0 if replace else 1.0) * math.sqrt(t) / s, d)
        out["seconds"] = round(time.time() - start, 2)
        return out
    rel = Rel.REPLACE_ONE if replace else Rel.ADD_OR_REMOVE_ONE
    h = interval(q, s, t)
    while True:
        try:
            values = {}
            for key, pess in (("pessimistic", True), ("optimistic", False)):
                pld = pldm.from_gaussian_mechanism(
                    standard_deviation=s, sampling_prob=q, value_discretization_interval=h,
                    pessimistic_estimate=pess, use_connect_dots=pess, neighboring_relation=rel)
                pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
                values[key] = max(epsilon_ld(compose_ld(pmf, t), d) for pmf in pmfs)
            break
        except ValueError:
            h *= 2
    out["pld_pessimistic"] = values["pessimistic"]
    out["pld_optimistic"] = values["optimistic"]
    out["interval"] = h
    # dp-accounting's own accountant, end to end (float64 composition), for comparison
    acc = pld_acc.PLDAccountant(neighboring_relation=rel, value_discretization_interval=h)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), t)
    out["dp_accounting_accountant"] = float(acc.get_epsilon(d))
    out["seconds"] = round(time.time() - start, 2)
    return out


CACHE = OUT + ".partial.jsonl"  # results of an interrupted run (deleted when the run ends)


def _key(p: dict) -> tuple:
    return (p["q"], p["sigma"], p["steps"], p["delta"], p["relation"])


def _load_cache() -> dict:
    out = {}
    if os.path.exists(CACHE):
        with open(CACHE) as f:
            for line in f:
                r = json.loads(line)
                out[_key(r)] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    import dp_accounting

    points = grid()
    t0 = time.time()
    cache = _load_cache()
    todo = [p for p in points if _key(p) not in cache]
    with ProcessPoolExecutor(args.jobs) as ex, open(CACHE, "a") as log:
        for r in ex.map(reference, todo):  # in order; each result is kept as soon as it is done
            cache[_key(r)] = r
            log.write(json.dumps(r) + "\n")
            log.flush()
            print(f"{len(cache)}/{len(points)} {_key(r)} {r['seconds']} s", flush=True)
    results = [cache[_key(p)] for p in points]
    payload = {
        "generator": "tests/accountants/make_reference.py",
        "dp_accounting_version": getattr(dp_accounting, "__version__", "0.6"),
        "python": sys.version.split()[0],
        "points": results,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(payload, f, indent=1)
    os.remove(CACHE)
    print(f"{len(results)} points in {time.time() - t0:.0f} s -> {OUT}")


if __name__ == "__main__":
    main()
