"""PLD accountant: pessimistic (dominating) privacy-loss-distribution accounting."""

from __future__ import annotations

from typing import Any

import numpy as np

from .accountant import IAccountant
from .analysis.pld import compute_delta_pld, compute_epsilon_pld, compute_tradeoff_pld


class PLDAccountant(IAccountant):
    """Upper bound on ε by connect-the-dots PLD discretisation and FFT composition of any
    history of Gaussian events (Poisson-sampled or not, fixed-size batches under replace-one),
    taking the maximum over both directions of the add/remove relation (replace-one: one
    symmetric pair). ε is monotone in the number of steps, σ and δ by construction. See
    :mod:`dptorch.accountants.analysis.pld`.

    Args:
        neighboring_relation: ``"add_remove"`` (default) or ``"replace_one"``.
    """

    def get_epsilon(self, delta: float, *, eps_error: float = 0.01, **kwargs: Any) -> float:
        """Upper bound on ε at δ, at most about ``eps_error/4`` relative above the exact value
        (0.25 % at the default)."""
        return compute_epsilon_pld(self._phases(), delta, eps_error=eps_error,
                                   relation=self.neighboring_relation)

    def get_delta(self, epsilon: float, *, eps_error: float = 0.01, **kwargs: Any) -> float:
        """Upper bound on δ at ε."""
        return compute_delta_pld(self._phases(), epsilon, eps_error=eps_error,
                                 relation=self.neighboring_relation)

    def get_tradeoff_curve(self, alpha: Any, *, eps_error: float = 0.01, **kwargs: Any) -> np.ndarray:
        """Lower bound on the f-DP trade-off curve β(α): the Neyman–Pearson curve of the
        composed dominating lattice pair, minimum over both orders of the neighbouring pair."""
        return compute_tradeoff_pld(self._phases(), alpha, eps_error=eps_error,
                                    relation=self.neighboring_relation)

    @classmethod
    def mechanism(cls) -> str:
        return "pld"
