"""Rényi-DP accountant (Mironov, Talwar, Zhang 2019)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from .accountant import IAccountant
from .analysis import rdp as privacy_analysis


class RDPAccountant(IAccountant):
    """Composes the per-step RDP of every Gaussian event (Poisson-sampled or not; fixed-size
    batches under replace-one) and converts to (ε, δ).

    Args:
        neighboring_relation: ``"add_remove"`` (default) or ``"replace_one"``
            (:mod:`.analysis.rdp`).
    """

    DEFAULT_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))

    def _rdp(self, alphas: Sequence[Union[float, int]]) -> np.ndarray:
        rel = self.neighboring_relation
        return sum(
            (privacy_analysis.compute_rdp(q=q, noise_multiplier=s, steps=n, orders=alphas,
                                          relation=rel)
             for s, q, n in self._phases()),
            np.zeros(len(alphas)),
        )

    def get_privacy_spent(
        self, *, delta: float, alphas: Optional[Sequence[Union[float, int]]] = None,
        conversion: str = "improved",
    ) -> tuple[float, float]:
        """(ε, best order α) spent so far; ``conversion`` is ``"improved"`` or ``"classic"``
        (see :func:`.analysis.rdp.get_privacy_spent`)."""
        if not self._phases():
            return 0.0, 0.0
        if alphas is None:
            alphas = self.DEFAULT_ALPHAS
        return privacy_analysis.get_privacy_spent(
            orders=alphas, rdp=self._rdp(alphas), delta=delta, conversion=conversion
        )

    def get_epsilon(
        self, delta: float, alphas: Optional[Sequence[Union[float, int]]] = None,
        conversion: str = "improved", **kwargs: Any,
    ) -> float:
        """ε spent so far at δ. ``conversion="classic"`` gives the bound
        ``min_α RDP(α) + log(1/δ)/(α − 1)``; the default ``"improved"`` one is tighter."""
        eps, _ = self.get_privacy_spent(delta=delta, alphas=alphas, conversion=conversion)
        return eps

    def get_delta(
        self, epsilon: float, alphas: Optional[Sequence[Union[float, int]]] = None, **kwargs: Any
    ) -> float:
        """δ at ε by the improved conversion, ``min_α exp((α − 1)(RDP(α) − ε + log(1 − 1/α)))/α``
        (Balle et al. 2020, Theorem 21, solved for δ)."""
        if not self._phases():
            return 0.0
        a = np.asarray(self.DEFAULT_ALPHAS if alphas is None else alphas, dtype=np.float64)
        rdp = self._rdp(list(a))
        with np.errstate(over="ignore", invalid="ignore"):
            log_d = (a - 1.0) * (rdp - epsilon + np.log1p(-1.0 / a)) - np.log(a)
        log_d = np.where(np.isnan(log_d), np.inf, log_d)
        return float(min(math.exp(min(float(np.min(log_d)), 0.0)), 1.0))

    def get_tradeoff_curve(self, alpha: Any, **kwargs: Any) -> np.ndarray:
        """A lower bound on the f-DP trade-off curve from the RDP privacy profile (the default
        conversion of :class:`.IAccountant`)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # boundary-order warnings while scanning
            return super().get_tradeoff_curve(alpha, **kwargs)

    @classmethod
    def mechanism(cls) -> str:
        return "rdp"
