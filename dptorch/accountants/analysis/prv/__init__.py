"""PRV accounting (Gopi, Lee, Wutschitz 2021, "Numerical Composition of Differential Privacy") of
Poisson-subsampled Gaussian steps, on the shared discretise-and-compose engine of :mod:`..pld`.

Gopi et al. discretise each privacy random variable with a mean-preserving rounding and bound
the rounding error of the sum by Hoeffding, which needs a spacing ``h ∝ eps_error/√(K log(1/δ))``
(millions of lattice points after 10⁶ steps). Here each step is discretised with the
*dominating* connect-the-dots rule instead, so the composed lattice distribution dominates the
true one and its ε is an upper bound for *any* spacing; the spacing only sets how tight the bound
is, and that excess shrinks like ``K·h²`` (second order) rather than ``h·√K``, so a far coarser
lattice meets the same accuracy. See :mod:`..pld` for the construction and error control.

The interface keeps the PRV accountant's parameters: ``eps_error`` (the returned upper bound is
aimed at no more than ``eps_error/4`` *relative* above the exact ε: a relative target keeps ε
monotone in the number of steps, σ and δ) and ``delta_error``, the most δ spent on truncating
the tails of the steps (the truncated mass is counted as infinite privacy loss, so it can only
raise ε; at most ``1e-8·δ`` is used, since at large ε a δ error of ``delta_error`` would move ε
far more).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..lattice import MAX_FFT_SIZE
from ..pld import compute_epsilon_pld

__all__ = ["compute_epsilon_prv"]

History = Sequence[tuple[float, float, int]]


def compute_epsilon_prv(
    history: History, delta: float, eps_error: float = 0.01, delta_error: float | None = None,
    max_size: int = MAX_FFT_SIZE, relation: str = "add_remove",
) -> float:
    """Upper bound on ε(δ) of ``[(σ, q, steps), ...]`` over both add/remove directions (or the
    replace-one pair).

    Args:
        history: phases ``(noise_multiplier, sample_rate, num_steps)``.
        delta: target δ in (0, 1).
        eps_error: accuracy: the bound exceeds the exact ε by about ``eps_error/4`` relative or
            less (default 0.01: 0.25 %).
        delta_error: δ budget for tail truncation (default ``delta / 1000``); must be < ``delta``.
        relation: ``"add_remove"`` or ``"replace_one"``.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}.")
    if delta_error is None:
        delta_error = delta / 1000.0
    if not 0.0 < delta_error < delta:
        raise ValueError(f"delta_error must lie in (0, delta={delta}), got {delta_error}.")
    return compute_epsilon_pld(history, delta, eps_error, delta_error, max_size=max_size,
                               relation=relation)
