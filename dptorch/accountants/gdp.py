"""Gaussian-DP accountant (CLT approximation; may under-estimate ε)."""

from __future__ import annotations

import warnings
from typing import Any

from .accountant import IAccountant
from .analysis import gdp as privacy_analysis


class GaussianAccountant(IAccountant):
    """μ-GDP accounting by the central limit theorem; phases compose by adding μ²."""

    def __init__(self) -> None:
        warnings.warn(
            "GDP accounting is a CLT approximation and can under-estimate the privacy spent "
            "(see arXiv:2106.02848); use the 'prv', 'pld' or 'rdp' accountant for a guarantee.",
            stacklevel=2,
        )
        super().__init__()

    def get_epsilon(self, delta: float, poisson: bool = True, **kwargs: Any) -> float:
        """Approximate ε at δ; ``poisson=False`` for uniform (fixed-size) batch sampling."""
        if not self.history:
            return 0.0
        mu_fn = privacy_analysis.compute_mu_poisson if poisson else privacy_analysis.compute_mu_uniform
        mu_sq = sum(
            mu_fn(steps=n, noise_multiplier=s, sample_rate=q) ** 2 for s, q, n in self.history
        )
        return privacy_analysis.eps_from_mu(mu=mu_sq ** 0.5, delta=delta)

    @classmethod
    def mechanism(cls) -> str:
        return "gdp"
