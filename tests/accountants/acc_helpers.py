"""Independent references for the accountant tests: the exact ε of the Gaussian mechanism and
the single-step privacy profile of the Poisson-subsampled Gaussian by quadrature."""

from __future__ import annotations

import math

from scipy import integrate
from scipy.optimize import brentq
from scipy.stats import norm


def gaussian_delta(mu: float, eps: float) -> float:
    """δ(ε) of the Gaussian mechanism with μ = sensitivity/σ (Balle & Wang 2018)."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps + norm.logcdf(-eps / mu - mu / 2))


def exact_gaussian_eps(sigma: float, k: int, delta: float, sensitivity: float = 1.0) -> float:
    """ε(δ) of k Gaussian steps = one Gaussian with μ = sensitivity·√k/σ."""
    mu = sensitivity * math.sqrt(k) / sigma
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(mu, hi) > delta:
        hi *= 2
    return brentq(lambda e: gaussian_delta(mu, e) - delta, 0.0, hi, xtol=1e-13, rtol=1e-15)


def single_step_gap(eps: float, q: float, sigma: float, delta: float, direction: str) -> float:
    """δ(ε) − δ of one Poisson-subsampled Gaussian step, by quadrature of its privacy profile
    (> 0 iff the exact ε(δ) exceeds ``eps``). ``direction``: "remove", "add" (add/remove) or
    "replace" (replace-one: the record's +1 replaced by −1)."""
    def log_ratio(x, shift):  # log(mixture with N(shift) / N(0)) density ratio
        return math.log1p(q * math.expm1((2 * shift * x - 1) / (2 * sigma**2)))

    if direction == "remove":  # x ~ mixture, loss L(x)
        def f(x):
            dens = (1 - q) * norm.pdf(x, 0, sigma) + q * norm.pdf(x, 1, sigma)
            return max(0.0, -math.expm1(eps - log_ratio(x, 1))) * dens
    elif direction == "add":  # x ~ N(0, sigma^2), loss -L(x)
        def f(x):
            return max(0.0, -math.expm1(eps + log_ratio(x, 1))) * norm.pdf(x, 0, sigma)
    else:
        def f(x):
            dens = (1 - q) * norm.pdf(x, 0, sigma) + q * norm.pdf(x, 1, sigma)
            loss = log_ratio(x, 1) - log_ratio(x, -1)
            return max(0.0, -math.expm1(eps - loss)) * dens
    val, _ = integrate.quad(f, -12 * sigma - 1, 1 + 12 * sigma, limit=500, epsabs=1e-16,
                            epsrel=1e-11, points=[0.0, 0.5])
    return val - delta


def single_step_exact(q: float, sigma: float, delta: float, relation: str = "add_remove") -> float:
    """The exact ε(δ) of one step (both directions for add/remove), by root finding on the
    quadrature profile."""
    dirs = ("remove", "add") if relation == "add_remove" else ("replace",)
    best = 0.0
    for d in dirs:
        if single_step_gap(0.0, q, sigma, delta, d) <= 0:
            continue
        hi = 1.0
        while single_step_gap(hi, q, sigma, delta, d) > 0:
            hi *= 2
        best = max(best, brentq(single_step_gap, 0.0, hi, args=(q, sigma, delta, d),
                                xtol=1e-12))
    return best


def _one_step_profile(q: float, sigma: float, direction: str):
    """(δ_1(e) for any real e, density of the first component, loss L(x)) of one step, in
    closed form: δ_1(e) = P[L > e] − e^e Q[L > e] (remove, replace) or, for add, the same with
    the roles of P and Q swapped and the loss −L. The loss is increasing in x."""
    from scipy.special import ndtr

    s = sigma
    shift_q = -1.0 if direction == "replace" else 0.0

    def loss(x):
        lp = math.log1p(q * math.expm1((2 * x - 1) / (2 * s * s)))
        if direction == "replace":
            lp -= math.log1p(q * math.expm1((-2 * x - 1) / (2 * s * s)))
        return lp

    def p_above(a):
        return (1 - q) * ndtr(-a / s) + q * ndtr(-(a - 1) / s)

    def q_above(a):
        return (1 - q) * ndtr(-a / s) + q * ndtr(-(a - shift_q) / s) if shift_q else ndtr(-a / s)

    def x_of(e):  # L(x) = e, by bisection on the increasing loss
        lo, hi = -60 * s - 5, 60 * s + 5
        if e <= loss(lo):
            return -math.inf
        if e >= loss(hi):
            return math.inf
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            if loss(mid) > e:
                hi = mid
            else:
                lo = mid
        return 0.5 * (lo + hi)

    def p_dens(x):
        return (1 - q) * norm.pdf(x, 0, s) + q * norm.pdf(x, 1, s)

    def q_dens(x):
        return (1 - q) * norm.pdf(x, 0, s) + q * norm.pdf(x, shift_q, s) if shift_q else norm.pdf(x, 0, s)

    if direction == "add":  # pair (Q, P), loss −L under Q: −L > e  ⇔  x < x(−e)
        def delta1(e):
            a = x_of(-e)
            return max((1 - q_above(a)) - math.exp(e) * (1 - p_above(a)), 0.0)
        return delta1, q_dens, lambda x: -loss(x)

    def delta1(e):
        a = x_of(e)
        return max(p_above(a) - math.exp(e) * q_above(a), 0.0)
    return delta1, p_dens, loss


def two_step_gap(eps: float, q: float, sigma: float, delta: float, direction: str) -> float:
    """δ_2(ε) − δ for two steps: ``∫ p(x) δ_1(ε − L(x)) dx`` (one step integrated, the other
    in closed form)."""
    delta1, dens, loss = _one_step_profile(q, sigma, direction)
    val, _ = integrate.quad(lambda x: dens(x) * delta1(eps - loss(x)), -14 * sigma - 1,
                            2 + 14 * sigma, limit=400, epsabs=1e-17, epsrel=1e-9,
                            points=[0.0, 0.5, 1.0])
    return val - delta


def two_step_exact(q: float, sigma: float, delta: float, relation: str = "add_remove") -> float:
    """The exact ε(δ) of two steps, by root finding on :func:`two_step_gap`."""
    dirs = ("remove", "add") if relation == "add_remove" else ("replace",)
    best = 0.0
    for d in dirs:
        if two_step_gap(0.0, q, sigma, delta, d) <= 0:
            continue
        hi = 1.0
        while two_step_gap(hi, q, sigma, delta, d) > 0:
            hi *= 2
        best = max(best, brentq(two_step_gap, 0.0, hi, args=(q, sigma, delta, d), xtol=1e-11))
    return best
