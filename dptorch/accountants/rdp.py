"""Rényi-DP accountant (Mironov, Talwar, Zhang 2019)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

from .accountant import IAccountant
from .analysis import rdp as privacy_analysis


class RDPAccountant(IAccountant):
    """Composes per-step RDP of the Poisson-subsampled Gaussian and converts to (ε, δ)."""

    DEFAULT_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))

    def get_privacy_spent(
        self, *, delta: float, alphas: Optional[Sequence[Union[float, int]]] = None,
        conversion: str = "improved",
    ) -> tuple[float, float]:
        """(ε, best order α) spent so far; ``conversion`` is ``"improved"`` or ``"classic"``
        (see :func:`.analysis.rdp.get_privacy_spent`)."""
        if not self.history:
            return 0.0, 0.0
        if alphas is None:
            alphas = self.DEFAULT_ALPHAS
        rdp = sum(
            privacy_analysis.compute_rdp(q=q, noise_multiplier=s, steps=n, orders=alphas)
            for s, q, n in self.history
        )
        return privacy_analysis.get_privacy_spent(
            orders=alphas, rdp=rdp, delta=delta, conversion=conversion
        )

    def get_epsilon(
        self, delta: float, alphas: Optional[Sequence[Union[float, int]]] = None,
        conversion: str = "improved", **kwargs: Any,
    ) -> float:
        """ε spent so far at δ. ``conversion="classic"`` gives the bound
        ``min_α RDP(α) + log(1/δ)/(α − 1)``; the default ``"improved"`` one is tighter."""
        eps, _ = self.get_privacy_spent(delta=delta, alphas=alphas, conversion=conversion)
        return eps

    @classmethod
    def mechanism(cls) -> str:
        return "rdp"
