"""The statistics of privacy audits: confidence bounds on error rates, the (ε, δ) and Gaussian-DP
parameters that a pair of error rates rules out, the trade-off curve an accountant certifies,
and the one-run bound of Steinke, Nasr and Jagielski (2023).

Vocabulary. An audit runs a mechanism on two neighbouring datasets, ``D`` (without the canary)
and ``D'`` (with it), many times, and tests "the canary is in" on a score of each output. A
threshold test has a false-positive rate ``α`` (says "in" on a ``D`` run) and a
false-negative rate ``β`` (says "out" on a ``D'`` run). An ``(ε, δ)``-DP mechanism allows only
tests with ``α + e^ε β ≥ 1 − δ`` and ``β + e^ε α ≥ 1 − δ``; a ``μ``-GDP mechanism only tests with
``β ≥ Φ(Φ⁻¹(1 − α) − μ)``. Upper confidence bounds on ``α`` and ``β`` therefore give lower
bounds on ``ε`` and ``μ`` that hold with the bounds' confidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

__all__ = [
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "epsilon_from_rates",
    "mu_from_rates",
    "gdp_tradeoff",
    "gdp_epsilon",
    "error_counts",
    "TradeoffCurve",
    "one_run_p_value",
    "one_run_epsilon_lower_bound",
]


# --------------------------------------------------------------------------- error rates
def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper–Pearson upper bound on a Bernoulli rate: the ``p`` with
    ``P[Binomial(n, p) ≤ k] = alpha``, so that ``rate ≤ bound`` with probability ``≥ 1 − alpha``.

    ``k``: successes, any shape, integers in ``[0, n]``. Returns floats of ``k``'s shape (1 where
    ``k == n``)."""
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        out = stats.beta.ppf(1.0 - alpha, k + 1.0, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, out)


def clopper_pearson_lower(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper–Pearson lower bound on a Bernoulli rate (``rate ≥ bound`` with
    probability ``≥ 1 − alpha``); 0 where ``k == 0``. Shapes as :func:`clopper_pearson_upper`."""
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        out = stats.beta.ppf(alpha, np.maximum(k, 1e-300), n - k + 1.0)
    return np.where(k <= 0, 0.0, out)


def epsilon_from_rates(
    fpr: np.ndarray | float, fnr: np.ndarray | float, delta: np.ndarray | float
) -> np.ndarray:
    """The largest ``ε`` that a test with false-positive rate ``fpr`` and false-negative rate
    ``fnr`` rules out at ``δ``: ``max(0, log((1 − δ − fnr)/fpr), log((1 − δ − fpr)/fnr))``.

    An ``(ε, δ)``-DP mechanism has no such test for any larger ``ε``. Elementwise; ``+inf`` where
    a rate is 0 and the other below ``1 − δ``; the arguments broadcast."""
    a = np.asarray(fpr, dtype=np.float64)
    b = np.asarray(fnr, dtype=np.float64)
    delta = np.asarray(delta, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log(np.maximum(1.0 - delta - b, 0.0)) - np.log(a)
        e2 = np.log(np.maximum(1.0 - delta - a, 0.0)) - np.log(b)
    e = np.fmax(e1, e2)
    return np.where(np.isnan(e), 0.0, np.maximum(e, 0.0))


def mu_from_rates(fpr: np.ndarray | float, fnr: np.ndarray | float) -> np.ndarray:
    """The Gaussian-DP ``μ`` whose trade-off curve passes through ``(fpr, fnr)``:
    ``Φ⁻¹(1 − fpr) − Φ⁻¹(fnr)`` (symmetric in the two rates; may be negative).

    A ``μ'``-GDP mechanism with ``μ' < μ`` has no test with these rates. Rates are clipped to
    ``[1e-300, 1 − 1e-16]``, so a rate of 0 gives a large finite value."""
    a = np.clip(np.asarray(fpr, dtype=np.float64), 1e-300, 1 - 1e-16)
    b = np.clip(np.asarray(fnr, dtype=np.float64), 1e-300, 1 - 1e-16)
    return -special.ndtri(a) - special.ndtri(b)


def gdp_tradeoff(alpha: np.ndarray | float, mu: float) -> np.ndarray:
    """The trade-off curve of ``μ``-GDP: the smallest false-negative rate of a test with
    false-positive rate ``alpha``, ``Φ(Φ⁻¹(1 − α) − μ)``."""
    a = np.asarray(alpha, dtype=np.float64)
    return special.ndtr(special.ndtri(1.0 - a) - mu)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ``ε`` such that ``μ``-GDP implies ``(ε, δ)``-DP: the root in ``ε`` of
    ``Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) = δ`` (0 if ``δ`` already exceeds the ``ε = 0`` value)."""
    if mu <= 0:
        return 0.0

    def delta_at(eps: float) -> float:
        return float(
            special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2)
        )

    if delta_at(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_at(hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if delta_at(mid) > delta else (lo, mid)
    return hi


def error_counts(
    scores_out: np.ndarray, scores_in: np.ndarray, thresholds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Errors of the tests "the canary is in iff score > t", one per threshold.

    Args:
        scores_out: ``(n0,)`` scores of runs without the canary (``D``).
        scores_in: ``(n1,)`` scores of runs with it (``D'``).
        thresholds: ``(k,)`` thresholds ``t``.

    Returns ``(false positives, false negatives)``, two ``(k,)`` integer arrays: the number of
    ``D`` scores ``> t`` and of ``D'`` scores ``≤ t``."""
    s0 = np.sort(np.asarray(scores_out, dtype=np.float64))
    s1 = np.sort(np.asarray(scores_in, dtype=np.float64))
    fp = len(s0) - np.searchsorted(s0, thresholds, side="right")
    fn = np.searchsorted(s1, thresholds, side="right")
    return fp.astype(np.int64), fn.astype(np.int64)


# --------------------------------------------------------------------------- the claim
@dataclass(frozen=True)
class TradeoffCurve:
    """The trade-off curve implied by a privacy profile: ``(ε_j, δ_j)``-DP for every ``j``.

    ``f(α) = max_j max(0, 1 − δ_j − e^{ε_j} α, e^{−ε_j} (1 − δ_j − α))`` is the smallest
    false-negative rate that the profile allows at false-positive rate ``α``. Built from
    finitely many points it lies below the curve of the whole profile, so a test found below
    it contradicts one of the certified ``(ε_j, δ_j)`` pairs.

    Attributes:
        epsilons: ``(J,)`` the ``ε_j``.
        deltas: ``(J,)`` the matching ``δ_j``.
    """

    epsilons: np.ndarray
    deltas: np.ndarray

    @classmethod
    def from_epsilon_fn(
        cls, epsilon_at: Callable[[float], float], deltas: Sequence[float]
    ) -> TradeoffCurve:
        """The curve of ``(epsilon_at(δ), δ)`` for each ``δ`` in ``deltas`` (an accountant's
        ``get_epsilon``)."""
        d = np.asarray(sorted(set(float(x) for x in deltas)), dtype=np.float64)
        e = np.array([max(0.0, float(epsilon_at(float(x)))) for x in d])
        return cls(epsilons=e, deltas=d)

    def __call__(self, alpha: np.ndarray | float) -> np.ndarray:
        """``f(α)``, elementwise over ``alpha``."""
        a = np.asarray(alpha, dtype=np.float64)[..., None]
        e, d = self.epsilons, self.deltas
        lines = np.maximum(1.0 - d - np.exp(e) * a, np.exp(-e) * (1.0 - d - a))
        return np.maximum(lines.max(-1), 0.0)

    def violated_by(self, fpr: float, fnr: float) -> tuple[bool, float, float, float]:
        """Whether a test with rates ``(fpr, fnr)`` contradicts some ``(ε_j, δ_j)``.

        Returns ``(violated, δ_j, ε_lb(δ_j), ε_j)`` at the ``j`` with the largest
        ``ε_lb(δ_j) − ε_j``, ``ε_lb`` being :func:`epsilon_from_rates`."""
        lb = epsilon_from_rates(fpr, fnr, self.deltas)
        gap = lb - self.epsilons
        j = int(np.argmax(gap))
        return bool(gap[j] > 0), float(self.deltas[j]), float(lb[j]), float(self.epsilons[j])


# --------------------------------------------------------------------------- one run
def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The p-value of "the mechanism is ``(ε, δ)``-DP" after ``v`` correct guesses out of ``r``
    in a one-run audit with ``m`` canaries (Steinke, Nasr, Jagielski 2023, Theorem 3.1).

    Each canary is included independently with probability ½ and the auditor guesses the
    inclusion of ``r`` of them (a number fixed before looking). For an ``(ε, δ)``-DP mechanism
    the number ``W`` of correct guesses satisfies, with ``p = e^ε / (1 + e^ε)`` and
    ``W' ~ Binomial(r, p)``::

        P[W ≥ v] ≤ P[W' ≥ v] + 2 m δ · max_{1 ≤ i ≤ m} P[v − i ≤ W' < v] / i.

    The right-hand side is returned (capped at 1); it increases with ``ε``.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if v == 0:
        return 1.0
    p = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))
    # P[v − i ≤ W' < v] = Σ_{j=1..i} pmf(v − j); beyond i = v the sum stops growing, so the
    # maximum of the running mean over i ≤ m is reached for some i ≤ v.
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)
    running_mean = np.cumsum(below) / np.arange(1, v + 1)
    return min(1.0, tail + 2.0 * m * delta * float(running_mean.max()))


def one_run_epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest ``ε`` rejected at level ``1 − confidence`` by :func:`one_run_p_value`: with
    probability ``≥ confidence`` over the canaries' inclusion, the mechanism is not
    ``(ε', δ)``-DP for any ``ε' <`` the returned value. 0 when nothing is rejected."""
    level = 1.0 - confidence
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) > level:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= level:
        lo, hi = hi, 2 * hi
        if hi > 200:
            return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) <= level else (lo, mid)
    return lo
