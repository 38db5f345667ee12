"""Rényi DP of the Poisson-subsampled Gaussian mechanism and its conversion to (ε, δ)-DP.

The mechanism adds ``N(0, σ²)`` noise to a sum of contributions of L2 sensitivity 1, each record
being included independently with probability ``q``. Its Rényi divergence of order ``α`` is
(Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism")

    RDP(α) = log(A_α) / (α − 1),
    A_α = E_{z ~ N(0, σ²)} [ (1 − q + q · exp((2z − 1) / (2σ²)))^α ],

which bounds both orders of the add/remove neighbouring relation. ``A_α`` is computed in log
space:

* integer ``α``: the exact binomial expansion
  ``A_α = Σ_i C(α, i) (1 − q)^(α − i) q^i exp((i² − i) / (2σ²))``;
* fractional ``α``: the integral itself, by the trapezoid rule in log space (``logsumexp`` over
  a uniform grid). The integrand is analytic in the strip ``|Im z| < πσ²``, so with a spacing
  ``min(σ/10, σ²/3)`` the rule converges geometrically (relative error below ~1e-20); tails are
  cut 12σ beyond both modes (``z = 0`` and ``z = α``), where the integrand is below e^-70 of
  its peak.

Special cases are exact: ``q = 0`` gives 0, ``q = 1`` gives ``α / (2σ²)``, ``σ = 0`` gives ∞.

**Replace-one** (``relation="replace_one"``): one record's contribution ``+1`` is replaced by
``−1`` (the convention of :mod:`.sgm_loss`), so the pair is ``P = (1 − q) N(0, σ²) + q N(1, σ²)``,
``Q = (1 − q) N(0, σ²) + q N(−1, σ²)``, symmetric under ``x → −x`` (one order is both). Its
Rényi divergence ``log ∫ P^α Q^{1−α} / (α − 1)`` has no binomial form; it is integrated by the
same log-space trapezoid rule (the integrand is analytic in the strip ``|Im x| < πσ²``; its mass
lies between ``x = 0`` and ``x = 2α − 1``, where the ``N(1)``/``N(−1)`` exponents balance, and the
range is cut 12σ beyond). At ``q = 1`` it is the Gaussian mechanism of sensitivity 2:
``2α/σ²``.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Union

import numpy as np
from scipy.special import gammaln

logger = logging.getLogger(__name__)

Orders = Union[Sequence[float], np.ndarray, float]

#: conversions from RDP to (ε, δ)-DP understood by :func:`get_privacy_spent`
CONVERSIONS = ("improved", "classic")

# cap on trapezoid nodes for one fractional order (reached only for σ < ~0.01, where ε is huge)
_MAX_NODES = 400_000


def _logsumexp(x: np.ndarray) -> float:
    """log Σ e^x (plain numpy; scipy's version has a large per-call overhead)."""
    m = float(np.max(x))
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.sum(np.exp(x - m))))


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_α for an integer order α ≥ 1 by the exact binomial sum (0 < q < 1, σ > 0)."""
    i = np.arange(alpha + 1, dtype=np.float64)
    log_binom = gammaln(alpha + 1.0) - gammaln(i + 1.0) - gammaln(alpha - i + 1.0)
    terms = log_binom + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
    return _logsumexp(terms)


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log A_α for any real order α > 1 by log-space trapezoid integration (0 < q < 1, σ > 0)."""
    step = min(sigma / 10.0, sigma * sigma / 3.0)
    lo = -12.0 * sigma - 1.0
    hi = alpha + 12.0 * sigma + 1.0
    n = int(math.ceil((hi - lo) / step)) + 1
    if n > _MAX_NODES:
        n = _MAX_NODES
        logger.debug("RDP integral for sigma=%g, alpha=%g capped at %d nodes", sigma, alpha, n)
    z = np.linspace(lo, hi, n)
    dz = z[1] - z[0]
    log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2.0 * z - 1.0) / (2.0 * sigma**2))
    log_f = alpha * log_ratio - z * z / (2.0 * sigma**2) - math.log(sigma * math.sqrt(2.0 * math.pi))
    return _logsumexp(log_f) + math.log(dz)


def _log_a_replace_one(q: float, sigma: float, alpha: float) -> float:
    """log ∫ P^α Q^{1−α} for the replace-one pair (0 < q < 1, σ > 0, α > 1)."""
    step = min(sigma / 10.0, sigma * sigma / 3.0)
    lo = -12.0 * sigma - 1.0
    hi = 2.0 * alpha + 12.0 * sigma
    n = min(int(math.ceil((hi - lo) / step)) + 1, _MAX_NODES)
    z = np.linspace(lo, hi, n)
    dz = z[1] - z[0]
    s2 = 2.0 * sigma**2
    base = -z * z / s2 - math.log(sigma * math.sqrt(2.0 * math.pi))
    log_p = np.logaddexp(math.log1p(-q), math.log(q) + (2.0 * z - 1.0) / s2)
    log_q = np.logaddexp(math.log1p(-q), math.log(q) + (-2.0 * z - 1.0) / s2)
    return _logsumexp(base + alpha * log_p + (1.0 - alpha) * log_q) + math.log(dz)


def _compute_rdp_single(q: float, sigma: float, alpha: float, relation: str = "add_remove") -> float:
    """RDP at order α of one step of the Poisson-subsampled Gaussian mechanism."""
    if q == 0:
        return 0.0
    if sigma == 0 or math.isinf(alpha):
        return math.inf
    if relation == "replace_one":
        if q == 1.0:
            return 2.0 * alpha / sigma**2
        return max(_log_a_replace_one(q, sigma, float(alpha)), 0.0) / (alpha - 1.0)
    if q == 1.0:
        return alpha / (2.0 * sigma**2)
    if float(alpha).is_integer():
        log_a = _log_a_integer(q, sigma, int(alpha))
    else:
        log_a = _log_a_fractional(q, sigma, float(alpha))
    # A_α ≥ 1 mathematically (Jensen); clip tiny negative round-off
    return max(log_a, 0.0) / (alpha - 1.0)


def _validate(q: float, noise_multiplier: float, steps: int, orders: np.ndarray) -> None:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q (sample rate) must lie in [0, 1], got {q}.")
    if noise_multiplier < 0 or math.isnan(noise_multiplier):
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    if np.any(~(orders > 1.0)):
        raise ValueError(f"RDP orders must all be > 1, got {orders.tolist()}.")


def compute_rdp(
    *, q: float, noise_multiplier: float, steps: int, orders: Orders,
    relation: str = "add_remove",
) -> Union[np.ndarray, float]:
    """Rényi DP of ``steps`` compositions of the Poisson-subsampled Gaussian mechanism.

    Args:
        q: sampling rate (probability that a record is in a batch), in [0, 1].
        noise_multiplier: σ, the noise standard deviation divided by the L2 sensitivity.
        steps: number of compositions.
        orders: one order α > 1 or a sequence of them.
        relation: ``"add_remove"`` (default) or ``"replace_one"`` (module docstring).

    Returns:
        ``steps · RDP(α)`` for each order (a float for a scalar order, else an array);
        ``inf`` where unbounded (σ = 0).
    """
    scalar = np.ndim(orders) == 0
    orders_arr = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    _validate(q, noise_multiplier, steps, orders_arr)
    if relation not in ("add_remove", "replace_one"):
        raise ValueError(f"relation must be 'add_remove' or 'replace_one', got {relation!r}.")
    rdp = np.array([_compute_rdp_single(q, noise_multiplier, a, relation) for a in orders_arr])
    # 0 * inf would be nan: zero steps cost nothing
    rdp = np.where(steps == 0, 0.0, rdp * steps)
    return float(rdp[0]) if scalar else rdp


def get_privacy_spent(
    *, orders: Orders, rdp: Union[Sequence[float], np.ndarray, float], delta: float,
    conversion: str = "improved",
) -> tuple[float, float]:
    """Converts RDP guarantees at several orders into the best (ε, δ)-DP guarantee.

    Args:
        orders: the RDP orders α (each > 1).
        rdp: the RDP value at each order.
        delta: target δ in (0, 1).
        conversion: ``"improved"`` (default) uses Balle et al. 2020, "Hypothesis testing
            interpretations and Rényi differential privacy", Theorem 21:
            ``ε = RDP(α) + log((α − 1)/α) − (log δ + log α)/(α − 1)``;
            ``"classic"`` uses Mironov 2017, Proposition 3: ``ε = RDP(α) + log(1/δ)/(α − 1)``.
            Both are valid upper bounds; the improved one is never larger.

    Returns:
        ``(ε, α*)``, the smallest ε over the orders and the order attaining it
        (``(inf, nan)`` when every order is unbounded). ε is clipped at 0.
    """
    orders_vec = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    rdp_vec = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if orders_vec.shape != rdp_vec.shape:
        raise ValueError(
            f"orders and rdp must have the same length, got {orders_vec.size} and {rdp_vec.size}."
        )
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}.")
    if conversion == "improved":
        eps = (
            rdp_vec
            + np.log1p(-1.0 / orders_vec)
            - (math.log(delta) + np.log(orders_vec)) / (orders_vec - 1.0)
        )
    elif conversion == "classic":
        eps = rdp_vec - math.log(delta) / (orders_vec - 1.0)
    else:
        raise ValueError(f"conversion must be one of {CONVERSIONS}, got {conversion!r}.")
    eps = np.where(np.isnan(eps), np.inf, eps)
    if np.all(np.isinf(eps)):
        return math.inf, math.nan
    idx = int(np.argmin(eps))
    if orders_vec.size > 1 and idx in (0, orders_vec.size - 1):
        side = "smallest" if idx == 0 else "largest"
        warnings.warn(
            f"The optimal RDP order is the {side} one supplied ({orders_vec[idx]}); "
            "extend the range of orders (alphas) for a tighter epsilon.",
            stacklevel=2,
        )
    return max(float(eps[idx]), 0.0), float(orders_vec[idx])
