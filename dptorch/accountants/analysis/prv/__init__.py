"""Numerical composition of privacy random variables (PRVs), after Gopi, Lee, Wutschitz 2021,
"Numerical Composition of Differential Privacy", for the Poisson-subsampled Gaussian.

For each direction of the add/remove relation, every step's PRV ``Y`` is truncated and
discretised with the mean-preserving rule (:mod:`.discretization`), the steps are composed by
FFT (:func:`..lattice.compose`) and the composed profile is inverted. Error analysis (our own
bookkeeping of the paper's argument): with ``K`` steps,

* conditioning on no step falling outside its truncation costs at most ``Σ p_out`` in δ;
* the rounding errors ``Ỹ_i − Y_i`` are independent, mean zero and each within an interval of
  length ``h``, so by Hoeffding ``Σ(Y_i − Ỹ_i) ≥ η`` with probability at most
  ``exp(−2η²/(K h²))``; on the complement ``δ_Y(ε) ≤ δ_Ỹ(ε − η)``;
* FFT wrap-around is bounded by the window slack.

With ``η = eps_error`` and failure probability ``delta_error/2`` the spacing is
``h = eps_error·sqrt(2 / (K·log(2/delta_error)))``, and the returned upper bound is
``ε_Ỹ(δ − delta_error/2 − Σ p_out) + eps_error`` (truncation uses ``delta_error/4`` in total).
The true ε lies within ``[ε_Ỹ(δ + delta_error) − eps_error, upper]`` (the estimate's error interval).
If the FFT would be too large, ``h`` is widened and ``η`` grows accordingly (logged).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ..lattice import MAX_FFT_SIZE, LatticeLoss, compose_and_invert
from ..pld import lattice_spacing
from ..sgm_loss import DIRECTIONS
from .discretization import discretize_mean_preserving

logger = logging.getLogger(__name__)

__all__ = ["compute_epsilon_prv", "discretize_mean_preserving"]

History = Sequence[tuple[float, float, int]]


def _epsilon_one_direction(
    phases: list[tuple[float, float, int]], direction: str, delta: float,
    eps_error: float, delta_error: float, max_size: int,
) -> float:
    total = sum(k for _, _, k in phases)
    tail_mass = delta_error / (8.0 * total)  # per side, per step
    log_fail = math.log(2.0 / delta_error)
    h0 = eps_error * math.sqrt(2.0 / (total * log_fail))
    outs: list[float] = []

    def parts_at(h: float) -> list[tuple[LatticeLoss, int]]:
        parts = []
        outs.clear()
        for s, q, k in phases:
            lat, p_out = discretize_mean_preserving(q, s, direction, h, tail_mass)
            parts.append((lat, k))
            outs.append(k * p_out)
        return parts

    h, parts = lattice_spacing(parts_at, h0, max_size)
    eta = h * math.sqrt(total * log_fail / 2.0)
    target = delta - delta_error / 2.0 - sum(outs)
    if target <= 0:
        return math.inf
    return compose_and_invert(parts, target, max_size=max_size) + eta


def compute_epsilon_prv(
    history: History, delta: float, eps_error: float = 0.01, delta_error: float | None = None,
    max_size: int = MAX_FFT_SIZE,
) -> float:
    """Upper end of the PRV error interval for ε(δ) of ``[(σ, q, steps), ...]``.

    Args:
        history: phases ``(noise_multiplier, sample_rate, num_steps)``.
        delta: target δ in (0, 1).
        eps_error: additive error η on ε (default 0.01).
        delta_error: error budget on δ (default ``delta / 1000``); must be < ``delta``.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}.")
    if delta_error is None:
        delta_error = delta / 1000.0
    if not 0.0 < delta_error < delta:
        raise ValueError(f"delta_error must lie in (0, delta={delta}), got {delta_error}.")
    if not eps_error > 0:
        raise ValueError(f"eps_error must be > 0, got {eps_error}.")
    phases = [(float(s), float(q), int(k)) for s, q, k in history if q > 0 and k > 0]
    if not phases:
        return 0.0
    if any(s == 0.0 for s, _, _ in phases):
        return math.inf
    return max(
        _epsilon_one_direction(phases, d, delta, eps_error, delta_error, max_size)
        for d in DIRECTIONS
    )
