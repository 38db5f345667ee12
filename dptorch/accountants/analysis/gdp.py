"""Gaussian DP (μ-GDP) of DP-SGD via the central limit theorem (Dong, Roth, Su 2019; Bu et al.
2020). The CLT approximation can *under*-estimate ε, notably for few steps or large q.

For ``T`` steps at rate ``q`` and noise σ, the composed mechanism is approximately μ-GDP with
``μ = q·sqrt(T·(e^{1/σ²} − 1))`` (Poisson sampling) or
``μ = q·sqrt(2T·(e^{1/σ²}Φ(1.5/σ) + 3Φ(−0.5/σ) − 2))`` (uniform sampling). Phases compose by
adding ``μ²``. A μ-GDP mechanism is (ε, δ(ε))-DP with
``δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize
from scipy.special import log_ndtr, ndtr


def compute_mu_poisson(*, steps: int, noise_multiplier: float, sample_rate: float) -> float:
    """μ of ``steps`` Poisson-subsampled Gaussian steps by the CLT."""
    if noise_multiplier == 0:
        return math.inf
    return sample_rate * math.sqrt(steps * math.expm1(noise_multiplier ** -2))


def compute_mu_uniform(*, steps: int, noise_multiplier: float, sample_rate: float) -> float:
    """μ of ``steps`` uniformly (without replacement) subsampled Gaussian steps by the CLT."""
    if noise_multiplier == 0:
        return math.inf
    s = noise_multiplier
    inner = math.exp(s ** -2) * ndtr(1.5 / s) + 3 * ndtr(-0.5 / s) - 2
    return math.sqrt(2.0) * sample_rate * math.sqrt(steps * max(inner, 0.0))


def delta_eps_mu(*, eps: float, mu: float) -> float:
    """δ(ε) of μ-GDP, computed in log space for large ε."""
    if mu == 0:
        return 0.0
    return float(ndtr(-eps / mu + mu / 2) - np.exp(eps + log_ndtr(-eps / mu - mu / 2)))


def eps_from_mu(*, mu: float, delta: float) -> float:
    """Smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for μ-GDP."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}.")
    if math.isinf(mu):
        return math.inf
    if mu == 0 or delta_eps_mu(eps=0.0, mu=mu) <= delta:
        return 0.0
    hi = 1.0
    while delta_eps_mu(eps=hi, mu=mu) > delta:
        hi *= 2.0
    return optimize.brentq(lambda e: delta_eps_mu(eps=e, mu=mu) - delta, 0.0, hi, xtol=1e-12)


def compute_eps_poisson(
    *, steps: int, noise_multiplier: float, sample_rate: float, delta: float
) -> float:
    """ε of ``steps`` Poisson-subsampled Gaussian steps under the CLT approximation."""
    mu = compute_mu_poisson(steps=steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return eps_from_mu(mu=mu, delta=delta)


def compute_eps_uniform(
    *, steps: int, noise_multiplier: float, sample_rate: float, delta: float
) -> float:
    """ε of ``steps`` uniformly subsampled Gaussian steps under the CLT approximation."""
    mu = compute_mu_uniform(steps=steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return eps_from_mu(mu=mu, delta=delta)
