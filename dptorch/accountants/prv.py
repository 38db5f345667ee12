"""PRV accountant: numerical composition of privacy random variables (Gopi et al. 2021)."""

from __future__ import annotations

from typing import Any, Optional

from .accountant import IAccountant
from .analysis.prv import compute_epsilon_prv


class PRVAccountant(IAccountant):
    """Returns the upper end of the PRV error interval, over both add/remove directions.

    Handles heterogeneous histories, large ε, tiny δ, ``q = 1`` and long runs.
    See :mod:`dptorch.accountants.analysis.prv` for the error analysis.
    """

    def get_epsilon(
        self, delta: float, *, eps_error: float = 0.01, delta_error: Optional[float] = None,
        **kwargs: Any,
    ) -> float:
        """Upper bound on ε at δ, at most ``eps_error`` above the discretised estimate
        (``delta_error`` defaults to ``delta / 1000``)."""
        return compute_epsilon_prv(self.history, delta, eps_error=eps_error, delta_error=delta_error)

    @classmethod
    def mechanism(cls) -> str:
        return "prv"
