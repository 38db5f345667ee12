"""Calibration of the noise multiplier to a privacy budget."""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

from .registry import create_accountant

MAX_SIGMA = 1e6


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
    **kwargs: Any,
) -> float:
    """Smallest noise multiplier σ (within ``epsilon_tolerance``) with ε(σ) ≤ ``target_epsilon``.

    Runs ``steps`` (or ``int(epochs / sample_rate)``) steps at ``sample_rate``. σ is bracketed by
    doubling, then bisected until the bracket is narrower than ``epsilon_tolerance`` *and*
    ``target_epsilon − ε(σ) ≤ epsilon_tolerance``; so the result ``σ`` satisfies
    ``ε(σ) ≤ target`` and ``ε(σ − epsilon_tolerance) > target``. ``kwargs`` go to
    ``get_epsilon`` (e.g. ``eps_error``).

    Raises:
        ValueError: on out-of-range arguments, or when the target needs σ > 1e6.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("pass exactly one of epochs and steps to get_noise_multiplier.")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}.")
    if not 0.0 < target_delta < 1.0:
        raise ValueError(f"target_delta must lie in (0, 1), got {target_delta}.")
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}.")
    if not epsilon_tolerance > 0:
        raise ValueError(f"epsilon_tolerance must be > 0, got {epsilon_tolerance}.")
    if steps is None:
        if not epochs > 0:
            raise ValueError(f"epochs must be > 0, got {epochs}.")
        steps = int(epochs / sample_rate)
    if steps < 1:
        raise ValueError(f"the number of steps must be >= 1, got {steps}; raise epochs or steps.")

    acc = create_accountant(accountant)

    def eps_at(sigma: float) -> float:
        acc.history = [(sigma, sample_rate, steps)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RDP boundary-order warnings during the search
            return acc.get_epsilon(delta=target_delta, **kwargs)

    sigma_low, sigma_high = 0.0, 1.0
    eps_high = eps_at(sigma_high)
    while eps_high > target_epsilon:
        sigma_low, sigma_high = sigma_high, 2.0 * sigma_high
        if sigma_high > MAX_SIGMA:
            raise ValueError(
                f"target_epsilon={target_epsilon} is unreachable (needs noise_multiplier > "
                f"{MAX_SIGMA:g}); raise target_epsilon or target_delta, or take fewer steps."
            )
        eps_high = eps_at(sigma_high)
    while (sigma_high - sigma_low > epsilon_tolerance
           or target_epsilon - eps_high > epsilon_tolerance):
        if sigma_high - sigma_low < 1e-12:
            break
        sigma = 0.5 * (sigma_low + sigma_high)
        eps = eps_at(sigma)
        if eps <= target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high
