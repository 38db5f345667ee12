"""PRV accountant: numerical composition of privacy random variables (Gopi et al. 2021)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .accountant import IAccountant
from .analysis.pld import compute_delta_pld, compute_tradeoff_pld
from .analysis.prv import compute_epsilon_prv


class PRVAccountant(IAccountant):
    """A rigorous upper bound on ε over both add/remove directions (or the replace-one pair),
    aimed at no more than ``eps_error/4`` relative above the exact value (0.25 % by default).

    Handles any history of Gaussian events, large ε, tiny δ, ``q = 1`` and long runs (10⁶ steps
    in a fraction of a second); ε is monotone in the number of steps, σ and δ. Shares its engine
    with the PLD accountant; see :mod:`dptorch.accountants.analysis.prv` and
    :mod:`dptorch.accountants.analysis.pld`.

    Args:
        neighboring_relation: ``"add_remove"`` (default) or ``"replace_one"``.
    """

    def get_epsilon(
        self, delta: float, *, eps_error: float = 0.01, delta_error: Optional[float] = None,
        **kwargs: Any,
    ) -> float:
        """Upper bound on ε at δ, about ``eps_error/4`` relative or less above the exact ε
        (``delta_error``, the most δ spent on tail truncation, defaults to ``delta / 1000``)."""
        return compute_epsilon_prv(self._phases(), delta, eps_error=eps_error,
                                   delta_error=delta_error, relation=self.neighboring_relation)

    def get_delta(self, epsilon: float, *, eps_error: float = 0.01, **kwargs: Any) -> float:
        """Upper bound on δ at ε."""
        return compute_delta_pld(self._phases(), epsilon, eps_error=eps_error,
                                 relation=self.neighboring_relation)

    def get_tradeoff_curve(self, alpha: Any, *, eps_error: float = 0.01, **kwargs: Any) -> np.ndarray:
        """Lower bound on the f-DP trade-off curve β(α) (see :class:`.PLDAccountant`)."""
        return compute_tradeoff_pld(self._phases(), alpha, eps_error=eps_error,
                                    relation=self.neighboring_relation)

    @classmethod
    def mechanism(cls) -> str:
        return "prv"
