"""Privacy loss of one step of the Poisson-subsampled Gaussian mechanism.

With sensitivity 1 and noise multiplier σ, one step releases ``x ~ μ0 = N(0, σ²)`` on a dataset
without the record and ``x ~ μ = (1 − q) N(0, σ²) + q N(1, σ²)`` with it. The add/remove
relation has two dominating pairs (Zhu, Dong, Wang 2022): "remove", (P, Q) = (μ, μ0), with
privacy loss ``L(x) = log(1 − q + q e^{(2x − 1)/(2σ²)})``, increasing in x, with x ~ μ; and
"add", the swapped pair (μ0, μ), whose loss distribution the PLD accountant derives from the
remove one (``LatticeLoss.swapped``), so only the remove direction is implemented here.

The privacy profile is ``δ(ε) = P[ℓ > ε] − e^ε Q[ℓ > ε] = E_P[(1 − e^{ε − ℓ})_+]``, and a
k-fold composition's profile is the same expression for the sum of k independent losses. This
module gives the P- and Q-masses of loss intervals (differences of normal CDFs taken on the
side that keeps relative precision in the tails) and tail cut points; the PLD accountant builds
its discretisation on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri


def _normal_mass(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Φ(b) − Φ(a) for a ≤ b, computed on the tail side that keeps relative precision."""
    upper = a > 0
    return np.where(upper, ndtr(-a) - ndtr(-b), ndtr(b) - ndtr(a))


@dataclass(frozen=True)
class SubsampledGaussianLoss:
    """The privacy loss of one step (sensitivity 1) in the remove direction of the add/remove
    relation (see the module docstring).

    Attributes:
        sample_rate: q in (0, 1].
        noise_multiplier: σ > 0.
    """

    sample_rate: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {self.sample_rate}.")
        if not self.noise_multiplier > 0.0:
            raise ValueError(f"noise_multiplier must be > 0, got {self.noise_multiplier}.")

    # ---- the monotone map between x and L(x) -------------------------------------------------
    def base_loss(self, x: np.ndarray) -> np.ndarray:
        """L(x) = log(1 − q + q e^{(2x − 1)/(2σ²)}) (the remove-direction loss)."""
        q, s = self.sample_rate, self.noise_multiplier
        return np.logaddexp(math.log1p(-q) if q < 1 else -np.inf,
                            math.log(q) + (2.0 * np.asarray(x, dtype=np.float64) - 1.0) / (2 * s * s))

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

    # ---- masses ------------------------------------------------------------------------------
    def _mixture_mass(self, xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
        q, s = self.sample_rate, self.noise_multiplier
        m = q * _normal_mass((xa - 1.0) / s, (xb - 1.0) / s)
        if q < 1:
            m = m + (1.0 - q) * _normal_mass(xa / s, xb / s)
        return m

    def _base_mass(self, xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
        s = self.noise_multiplier
        return _normal_mass(xa / s, xb / s)

    def interval_masses(self, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """P- and Q-probabilities that the loss falls in each interval between sorted ``edges``.

        Interval i is ``(edges[i], edges[i+1]]``; ``±inf`` edges are allowed. Returns two arrays
        of length ``len(edges) − 1`` (P-mass, Q-mass).
        """
        x = self.base_inverse(np.asarray(edges, dtype=np.float64))
        xa, xb = x[:-1], x[1:]
        return self._mixture_mass(xa, xb), self._base_mass(xa, xb)

    def tail_points(self, tail_mass: float) -> tuple[float, float]:
        """Losses (lo, hi) with P[loss < lo] ≤ tail_mass and P[loss > hi] ≤ tail_mass."""
        s = self.noise_multiplier
        z = float(-ndtri(max(tail_mass, 1e-300)))
        # x ~ mixture of N(0, σ²) and N(1, σ²); the loss is increasing in x
        lo, hi = (float(v) for v in self.base_loss(np.array([-s * z, 1.0 + s * z])))
        return lo, hi
