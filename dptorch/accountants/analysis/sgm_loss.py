"""Privacy loss of one step of the Poisson-subsampled Gaussian mechanism, for both neighbouring
relations.

Sensitivity 1 and noise multiplier σ; each record is in the batch with probability q.

* **add/remove** (Zhu, Dong, Wang 2022): two dominating pairs. "remove": ``(P, Q) = (μ, μ0)``
  with ``μ0 = N(0, σ²)`` and ``μ = (1 − q) N(0, σ²) + q N(1, σ²)``; privacy loss
  ``L(x) = log(1 − q + q e^{(2x − 1)/(2σ²)})``, increasing in x, with x ~ μ. "add" is the
  swapped pair ``(μ0, μ)``, whose loss distribution the PLD engine derives from the remove one
  (:meth:`.lattice.LatticeLoss.swapped`). Class :class:`SubsampledGaussianLoss`.
* **replace-one** (the convention of dp-accounting's PLD accountant): one record's contribution
  ``+1`` is replaced by ``−1`` (two vectors of norm ≤ 1 are at most 2 apart), so
  ``P = (1 − q) N(0, σ²) + q N(1, σ²)`` and ``Q = (1 − q) N(0, σ²) + q N(−1, σ²)``; the loss
  ``L(x) = log((1 − q) + q e^{(2x − 1)/(2σ²)}) − log((1 − q) + q e^{(−2x − 1)/(2σ²)})`` is
  increasing and odd, and the pair is symmetric (swapping P and Q is ``x → −x``), so one
  direction is all there is. At q = 1 it is the Gaussian mechanism with sensitivity 2. Class
  :class:`ReplaceOneGaussianLoss`.

The privacy profile is ``δ(ε) = E_P[(1 − e^{ε − L})_+]``, and a k-fold composition's profile is
the same expression for the sum of k independent losses. This module gives the P- and Q-masses
of loss intervals (differences of normal CDFs taken on the side that keeps relative precision in
the tails), tail cut points, and the mean and variance of the loss (by trapezoid quadrature,
which converges geometrically for these analytic integrands); the PLD engine builds its
discretisation on them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.special import ndtr, ndtri

__all__ = ["SubsampledGaussianLoss", "ReplaceOneGaussianLoss", "step_loss"]


def _normal_mass(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Φ(b) − Φ(a) for a ≤ b, computed on the tail side that keeps relative precision."""
    upper = a > 0
    return np.where(upper, ndtr(-a) - ndtr(-b), ndtr(b) - ndtr(a))


def _interval_normal_masses(z: np.ndarray) -> np.ndarray:
    """``Φ(z[i+1]) − Φ(z[i])`` for sorted ``z``, each on the tail side that keeps relative
    precision (two CDF evaluations per point instead of four per interval)."""
    lower, upper = ndtr(z), ndtr(-z)
    return np.where(z[:-1] > 0, upper[:-1] - upper[1:], lower[1:] - lower[:-1])


def _log_term(q: float, s: float, y: np.ndarray) -> np.ndarray:
    """``log(1 − q + q e^{y/(2σ²)})`` for an array ``y`` (= ``±2x − 1``)."""
    return np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + y / (2 * s * s))


@dataclass(frozen=True)
class _GaussianMixtureLoss:
    """Shared parts: x ~ P = (1 − q) N(0, σ²) + q N(1, σ²), loss increasing in x."""

    sample_rate: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {self.sample_rate}.")
        if not (self.noise_multiplier > 0.0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise_multiplier must be finite and > 0, got {self.noise_multiplier}.")

    #: mean of the component of Q that is not N(0, σ²) (None: Q = N(0, σ²))
    _q_shift: ClassVar[float | None] = None

    def base_loss(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def base_inverse(self, t: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _p_mass(self, xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
        q, s = self.sample_rate, self.noise_multiplier
        m = q * _normal_mass((xa - 1.0) / s, (xb - 1.0) / s)
        if q < 1:
            m = m + (1.0 - q) * _normal_mass(xa / s, xb / s)
        return m

    def _q_mass(self, xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
        q, s = self.sample_rate, self.noise_multiplier
        if self._q_shift is None:
            return _normal_mass(xa / s, xb / s)
        c = self._q_shift
        m = q * _normal_mass((xa - c) / s, (xb - c) / s)
        if q < 1:
            m = m + (1.0 - q) * _normal_mass(xa / s, xb / s)
        return m

    def interval_masses(self, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """P- and Q-probabilities that the loss falls in each interval between sorted ``edges``.

        Interval i is ``(edges[i], edges[i+1]]``; ``±inf`` edges are allowed. Returns two arrays
        of length ``len(edges) − 1`` (P-mass, Q-mass).
        """
        x = self.base_inverse(np.asarray(edges, dtype=np.float64))
        q, s = self.sample_rate, self.noise_multiplier
        base = _interval_normal_masses(x / s) if q < 1 else None
        p = q * _interval_normal_masses((x - 1.0) / s)
        if base is not None:
            p = p + (1.0 - q) * base
        if self._q_shift is None:
            qm = base if base is not None else _interval_normal_masses(x / s)
        else:
            qm = q * _interval_normal_masses((x - self._q_shift) / s)
            if base is not None:
                qm = qm + (1.0 - q) * base
        return p, qm

    def tail_points(self, tail_mass: float) -> tuple[float, float]:
        """Losses (lo, hi) with P[loss < lo] ≤ tail_mass and P[loss > hi] ≤ tail_mass."""
        s = self.noise_multiplier
        z = float(-ndtri(max(tail_mass, 1e-300)))
        # x ~ mixture of N(0, σ²) and N(1, σ²); the loss is increasing in x
        lo, hi = (float(v) for v in self.base_loss(np.array([-s * z, 1.0 + s * z])))
        return lo, hi

    def moments(self) -> tuple[float, float]:
        """(mean, variance) of the loss under P, by trapezoid quadrature in x."""
        return _moments(type(self), self.sample_rate, self.noise_multiplier)[:2]

    def kl_divergences(self) -> tuple[float, float]:
        """``(KL(P‖Q), KL(Q‖P))``: the mean loss of the pair and of its swap."""
        mean_p, _, mean_q = _moments(type(self), self.sample_rate, self.noise_multiplier)
        return mean_p, -mean_q


@functools.lru_cache(maxsize=1024)
def _moments(cls: type, q: float, s: float) -> tuple[float, float, float]:
    """(E_P[L], Var_P[L], E_Q[L]) by the trapezoid rule (geometric convergence: the integrands
    are analytic in a strip of half-width ~πσ² around the real axis)."""
    loss = cls(q, s)
    step = min(s / 8.0, s * s / 4.0)
    lo, hi = -13.0 * s - 1.0, 1.0 + 13.0 * s
    n = int(math.ceil((hi - lo) / step)) + 1
    x = np.linspace(lo, hi, n)
    base = np.exp(-0.5 * (x / s) ** 2)
    w = q * np.exp(-0.5 * ((x - 1.0) / s) ** 2)
    if q < 1:
        w = w + (1.0 - q) * base
    w /= w.sum()
    if loss._q_shift is None:
        wq = base
    else:
        wq = q * np.exp(-0.5 * ((x - loss._q_shift) / s) ** 2)
        if q < 1:
            wq = wq + (1.0 - q) * base
    wq = wq / wq.sum()
    t = loss.base_loss(x)
    mean = float((w * t).sum())
    var = float((w * (t - mean) ** 2).sum())
    return mean, var, float((wq * t).sum())


class SubsampledGaussianLoss(_GaussianMixtureLoss):
    """The privacy loss of one step (sensitivity 1) in the remove direction of the add/remove
    relation (see the module docstring).

    Attributes:
        sample_rate: q in (0, 1].
        noise_multiplier: σ > 0.
    """

    def base_loss(self, x: np.ndarray) -> np.ndarray:
        """L(x) = log(1 − q + q e^{(2x − 1)/(2σ²)}) (the remove-direction loss)."""
        q, s = self.sample_rate, self.noise_multiplier
        x = np.asarray(x, dtype=np.float64)
        if q < 1:  # log1p/expm1 keep the tiny losses of small q precise
            return np.where(x < 0.5 + 10 * s * s,
                            np.log1p(q * np.expm1(np.minimum((2 * x - 1) / (2 * s * s), 700.0))),
                            _log_term(q, s, 2 * x - 1))
        return _log_term(q, s, 2 * x - 1)

    def base_inverse(self, t: np.ndarray) -> np.ndarray:
        """The x with L(x) = t; −∞ where t ≤ log(1 − q) (below the range of L)."""
        q, s = self.sample_rate, self.noise_multiplier
        t = np.asarray(t, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            # log(e^t − (1 − q)), split to avoid cancellation on either side of t = 0
            pos = t + np.log1p(-(1.0 - q) * np.exp(-np.maximum(t, 0.0)))
            neg = np.log(q + np.expm1(np.minimum(t, 0.0)))
            log_num = np.where(t > 0, pos, neg)
        log_num = np.where(np.isnan(log_num), -np.inf, log_num)
        return s * s * (log_num - math.log(q)) + 0.5


class ReplaceOneGaussianLoss(_GaussianMixtureLoss):
    """The privacy loss of one step under the replace-one relation (see the module docstring):
    ``P = (1 − q) N(0, σ²) + q N(1, σ²)``, ``Q = (1 − q) N(0, σ²) + q N(−1, σ²)``."""

    _q_shift: ClassVar[float | None] = -1.0

    def base_loss(self, x: np.ndarray) -> np.ndarray:
        """L(x) = log((1 − q) + q e^{(2x − 1)/(2σ²)}) − log((1 − q) + q e^{(−2x − 1)/(2σ²)})."""
        q, s = self.sample_rate, self.noise_multiplier
        x = np.asarray(x, dtype=np.float64)
        return _log_term(q, s, 2 * x - 1) - _log_term(q, s, -2 * x - 1)

    def base_inverse(self, t: np.ndarray) -> np.ndarray:
        """The x with L(x) = t (L maps ℝ onto ℝ; ±∞ map to ±∞).

        With ``y = e^{x/σ²}`` and ``c = e^{−1/(2σ²)}``, ``L = t`` is the quadratic
        ``qc·y² − (1 − q)(e^t − 1)·y − e^t qc = 0``; its positive root is taken in the form
        that avoids cancellation, in log space."""
        q, s = self.sample_rate, self.noise_multiplier
        t = np.asarray(t, dtype=np.float64)
        log_qc = math.log(q) - 1.0 / (2 * s * s)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            a = np.abs(t)
            one_minus = -np.expm1(-a)  # 1 − e^{−|t|} in [0, 1)
            # sqrt((1 − q)²(1 − e^{−|t|})² + 4 q²c² e^{−|t|}), without overflow
            disc = np.sqrt(((1.0 - q) * one_minus) ** 2 + 4.0 * np.exp(2 * log_qc - a))
            log_den = np.log(disc + (1.0 - q) * one_minus)  # > 0 part, no cancellation
            # t ≥ 0: log y = t + log((1 − q)(1 − e^{−t}) + disc) − log(2qc)
            # t < 0: log y = log(2qc) + t − log((1 − q)(1 − e^{t}) + disc)
            log_y = np.where(t >= 0, t + log_den - math.log(2.0) - log_qc,
                             math.log(2.0) + log_qc + t - log_den)
        x = s * s * log_y
        x = np.where(np.isposinf(t), np.inf, np.where(np.isneginf(t), -np.inf, x))
        return x


def step_loss(sample_rate: float, noise_multiplier: float, relation: str) -> _GaussianMixtureLoss:
    """The loss model of one Poisson-sampled Gaussian step under ``relation``."""
    if relation == "replace_one":
        return ReplaceOneGaussianLoss(sample_rate, noise_multiplier)
    return SubsampledGaussianLoss(sample_rate, noise_multiplier)
