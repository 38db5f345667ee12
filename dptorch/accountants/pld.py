"""PLD accountant: pessimistic (dominating) privacy-loss-distribution accounting."""

from __future__ import annotations

from typing import Any

from .accountant import IAccountant
from .analysis.pld import compute_epsilon_pld


class PLDAccountant(IAccountant):
    """Upper bound on ε by connect-the-dots PLD discretisation and FFT composition, taking the
    maximum over the add and remove directions. See :mod:`dptorch.accountants.analysis.pld`."""

    def get_epsilon(self, delta: float, *, eps_error: float = 0.01, **kwargs: Any) -> float:
        """Upper bound on ε at δ; exceeds the exact value by about ``eps_error / 2`` at most."""
        return compute_epsilon_pld(self.history, delta, eps_error=eps_error)

    @classmethod
    def mechanism(cls) -> str:
        return "pld"
