"""PRV accountant: numerical composition of privacy random variables (Gopi et al. 2021)."""

from __future__ import annotations

from typing import Any, Optional

from .accountant import IAccountant
from .analysis.prv import compute_epsilon_prv


class PRVAccountant(IAccountant):
    """A rigorous upper bound on ε over both add/remove directions, aimed at no more than
    ``eps_error/2`` above the exact value (so at or below Opacus's PRV upper bound).

    Handles heterogeneous histories, large ε, tiny δ, ``q = 1`` and long runs (10⁶ steps in
    well under a second). Shares its engine with the PLD accountant; see
    :mod:`dptorch.accountants.analysis.prv` and :mod:`dptorch.accountants.analysis.pld`.
    """

    def get_epsilon(
        self, delta: float, *, eps_error: float = 0.01, delta_error: Optional[float] = None,
        **kwargs: Any,
    ) -> float:
        """Upper bound on ε at δ, about ``eps_error/2`` or less above the exact ε
        (``delta_error``, the δ budget for tail truncation, defaults to ``delta / 1000``)."""
        return compute_epsilon_prv(self.history, delta, eps_error=eps_error, delta_error=delta_error)

    @classmethod
    def mechanism(cls) -> str:
        return "prv"
