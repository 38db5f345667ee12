"""Gaussian-DP accountant (CLT approximation; may under-estimate ε)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy.special import ndtr, ndtri

from .accountant import IAccountant
from .analysis import gdp as privacy_analysis


class GaussianAccountant(IAccountant):
    """μ-GDP accounting by the central limit theorem; phases compose by adding μ².

    Under ``replace_one`` a Poisson-sampled step's CLT μ is ``2q·√(T·sinh(1/σ²))`` (the
    variance of the replace-one loss to second order in q)."""

    def __init__(self, *, neighboring_relation: str = "add_remove") -> None:
        warnings.warn(
            "GDP accounting is a CLT approximation and can under-estimate the privacy spent "
            "(see arXiv:2106.02848); use the 'prv', 'pld' or 'rdp' accountant for a guarantee.",
            stacklevel=2,
        )
        super().__init__(neighboring_relation=neighboring_relation)

    def get_mu(self, poisson: bool = True, **kwargs: Any) -> float:
        """μ of the history by the CLT (``poisson=False``: uniform sampling, add/remove)."""
        if self.neighboring_relation == "replace_one":
            def mu_fn(*, steps: int, noise_multiplier: float, sample_rate: float) -> float:
                if noise_multiplier == 0:
                    return math.inf
                return 2.0 * sample_rate * math.sqrt(steps * math.sinh(noise_multiplier ** -2))
        else:
            mu_fn = (privacy_analysis.compute_mu_poisson if poisson
                     else privacy_analysis.compute_mu_uniform)
        mu_sq = sum(mu_fn(steps=n, noise_multiplier=s, sample_rate=q) ** 2
                    for s, q, n in self._phases())
        return mu_sq ** 0.5

    def get_epsilon(self, delta: float, poisson: bool = True, **kwargs: Any) -> float:
        """Approximate ε at δ; ``poisson=False`` for uniform (fixed-size) batch sampling."""
        if not self._phases():
            return 0.0
        return privacy_analysis.eps_from_mu(mu=self.get_mu(poisson), delta=delta)

    def get_delta(self, epsilon: float, poisson: bool = True, **kwargs: Any) -> float:
        """Approximate δ at ε."""
        mu = self.get_mu(poisson)
        return 1.0 if math.isinf(mu) else privacy_analysis.delta_eps_mu(eps=epsilon, mu=mu)

    def get_tradeoff_curve(self, alpha: Any, poisson: bool = True, **kwargs: Any) -> np.ndarray:
        """``Φ(Φ⁻¹(1 − α) − μ)``, the μ-GDP curve (approximate)."""
        alpha = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
        mu = self.get_mu(poisson)
        if math.isinf(mu):
            return np.zeros_like(alpha)
        return ndtr(ndtri(1.0 - alpha) - mu)

    @classmethod
    def mechanism(cls) -> str:
        return "gdp"
