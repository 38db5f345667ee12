"""Privacy-loss distributions on a lattice: FFT composition and conversion to ε.

A :class:`LatticeLoss` is a sub-probability mass function on the points ``(start + i)·h + shift``
plus an atom at +∞ (infinite loss, always counted fully in δ). Composing many of them sums
independent losses, i.e. convolves their PMFs; :func:`compose` does it by raising the discrete
Fourier transforms to the number of repetitions (exponentiation in the Fourier domain), on a
circular window of ``N`` points chosen from Chernoff bounds on the composed sum:

* mass of the sum above the window (at most ``tail_mass``, by Chernoff) would wrap around to
  low losses and could lower δ, so that bound is returned as ``delta_slack`` and added to δ;
* mass below the window wraps around to high losses, which can only raise δ.

:func:`epsilon_for_delta` then inverts the exact privacy profile of the composed lattice
distribution, ``δ(ε) = slack + inf_mass + Σ_t p_t (1 − e^{ε − t})_+``, which is piecewise
linear in ``e^ε`` between lattice points, so the inversion is exact.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy.signal import lfilter

logger = logging.getLogger(__name__)

#: default maximal FFT length (about 64 MiB of complex spectrum)
MAX_FFT_SIZE = 1 << 22

# Chernoff exponents tried, relative to a Gaussian-approximation guess
_LAMBDA_FACTORS = np.geomspace(1.0 / 32.0, 32.0, 21)


@dataclass(frozen=True)
class LatticeLoss:
    """A privacy-loss distribution on ``(start + i)·h + shift`` plus an atom at +∞."""

    h: float
    start: int
    pmf: np.ndarray
    inf_mass: float = 0.0
    shift: float = 0.0

    @functools.cached_property
    def _support(self) -> tuple[np.ndarray, np.ndarray]:
        """(points, log-masses) of the non-zero part of the PMF (computed once)."""
        nz = np.nonzero(self.pmf > 0)[0]
        t = (self.start + nz) * self.h + self.shift
        return t, np.log(self.pmf[nz])

    def log_mgf(self, lambdas: np.ndarray) -> np.ndarray:
        """``log Σ_t p_t e^{λ t}`` of the finite part, for each λ."""
        t, logp = self._support
        lambdas = np.atleast_1d(np.asarray(lambdas, dtype=np.float64))
        if t.size == 0:
            return np.full(lambdas.shape, -np.inf)
        a = logp[None, :] + lambdas[:, None] * t[None, :]
        top = a.max(axis=1)
        return top + np.log(np.exp(a - top[:, None]).sum(axis=1))

    @functools.cached_property
    def _moments(self) -> tuple[float, float]:
        t, logp = self._support
        p = np.exp(logp)
        m = p.sum()
        mean = float(np.dot(p, t)) / m
        return mean, float(np.dot(p, (t - mean) ** 2)) / m

    def variance(self) -> float:
        """Variance of the normalised finite part."""
        return self._moments[1]

    def mean(self) -> float:
        """Mean of the normalised finite part."""
        return self._moments[0]

    def swapped(self, log_q_mass_outside: float = -math.inf) -> LatticeLoss:
        """The loss distribution of the swapped pair ``(Q, P)``.

        ``self`` is the distribution under ``P`` of ``log dP/dQ`` with ``Q = e^{−t}P`` on the
        lattice; the swapped loss is ``−t`` with mass ``p_t e^{−t}`` (computed in log space).
        ``log_q_mass_outside`` is the log Q-mass not carried by the lattice (where P = 0 or
        outside the truncation): it is infinite loss for the swapped pair.
        """
        t = (self.start + np.arange(self.pmf.size)) * self.h + self.shift
        with np.errstate(divide="ignore"):
            pmf = np.exp(np.log(self.pmf) - t)[::-1].copy()
        pmf.setflags(write=False)
        return LatticeLoss(h=self.h, start=-(self.start + self.pmf.size - 1), pmf=pmf,
                           inf_mass=float(min(math.exp(log_q_mass_outside), 1.0)),
                           shift=-self.shift)


@dataclass(frozen=True)
class ComposedLoss:
    """A composition result: ``pmf[i]`` is the mass at ``(start + i)·h + shift``.

    ``δ`` at ``ε`` gets ``inf_mass`` plus the window slack ``exp(log_slack - tilt·ε)`` added.
    """

    h: float
    start: int
    pmf: np.ndarray
    inf_mass: float
    shift: float
    log_slack: float
    tilt: float = 0.0

    def slack(self, epsilon: np.ndarray | float) -> np.ndarray | float:
        """Bound on the δ error caused by mass wrapping around the circular FFT window."""
        return np.exp(self.log_slack - self.tilt * np.asarray(epsilon))


def _window(
    log_mgf: Callable[[np.ndarray], np.ndarray], log_tau: float, sd: float
) -> tuple[float, float]:
    """Chernoff: (lo, hi) with P[S < lo], P[S > hi] ≤ e^{log_tau}, given S's log-MGF.

    Any λ gives a valid bound; a log-spaced set around the Gaussian guess ``√(2 log 1/τ)/sd``
    is tried and the best kept.
    """
    lambdas = _LAMBDA_FACTORS * math.sqrt(-2.0 * log_tau) / sd
    hi = float(np.min((log_mgf(lambdas) - log_tau) / lambdas))
    lo = float(np.max(-(log_mgf(-lambdas) - log_tau) / lambdas))
    return lo, hi


def _total_log_mgf(parts: Sequence[tuple[LatticeLoss, int]]) -> Callable[[np.ndarray], np.ndarray]:
    def f(lam: np.ndarray) -> np.ndarray:
        return sum(k * p.log_mgf(lam) for p, k in parts)

    return f


def _total_sd(parts: Sequence[tuple[LatticeLoss, int]]) -> float:
    h = parts[0][0].h
    return max(math.sqrt(sum(k * p.variance() for p, k in parts)), h)


def window_width(parts: Sequence[tuple[LatticeLoss, int]], tail_mass: float) -> float:
    """Width (in loss units) of a window holding all but ``tail_mass`` of the composed sum
    on each side; used to choose the lattice spacing before composing."""
    lo, hi = _window(_total_log_mgf(parts), math.log(tail_mass), _total_sd(parts))
    return hi - lo


def compose(
    parts: Sequence[tuple[LatticeLoss, int]],
    delta: float,
    tail_mass: float = 1e-12,
    max_size: int = MAX_FFT_SIZE,
    tilt: bool = True,
) -> ComposedLoss:
    """Distribution of the sum of ``k_j`` independent copies of each lattice loss ``j``.

    All parts must share the spacing ``h``. To keep the relative precision of the far tail
    that determines a tiny ``delta``, the PMFs are exponentially tilted by ``e^{λ t}`` before
    the FFT (tilting commutes with convolution) and untilted after; λ is the Chernoff-optimal
    exponent for the level ``delta``, so the tilted sum is centred near ε(δ). The circular
    window holds all but ``tail_mass`` of the *tilted* sum on each side; the wrap-around of
    its upper tail can raise the recovered mass at loss ``t`` by at most
    ``tail_mass · E[e^{λS}] · e^{−λt}``, which is returned as the slack added to δ. The lower
    tail wraps to higher losses and can only raise δ.
    """
    h = parts[0][0].h
    if any(p.h != h for p, _ in parts):
        raise ValueError("all lattice losses must share the same spacing h")
    parts = [(p, k) for p, k in parts if k > 0]
    log_finite = sum(k * math.log1p(-p.inf_mass) if p.inf_mass < 1 else -math.inf
                     for p, k in parts)
    inf_mass = -math.expm1(log_finite) if log_finite > -math.inf else 1.0
    shift = sum(k * p.shift for p, k in parts)
    total = _total_log_mgf(parts)
    sd = _total_sd(parts)
    lam = 0.0
    if tilt:
        lambdas = _LAMBDA_FACTORS * math.sqrt(-2.0 * math.log(delta)) / sd
        bounds = (total(lambdas) - math.log(delta)) / lambdas
        lam = float(lambdas[int(np.argmin(bounds))])
    base = total(np.array([lam]))[0]

    def tilted(mu: np.ndarray) -> np.ndarray:
        return total(lam + mu) - base

    lo, hi = _window(tilted, math.log(tail_mass), sd)
    i_lo = math.floor((lo - shift) / h) - 1
    i_hi = math.ceil((hi - shift) / h) + 1
    n = sfft.next_fast_len(i_hi - i_lo + 1, real=True)
    if n > 2 * max_size:  # callers size h for max_size / 2 on the untilted window
        raise ValueError(
            f"composition needs an FFT of {n} points (> {2 * max_size}); widen the lattice spacing"
        )
    spectrum = np.ones(n // 2 + 1, dtype=np.complex128)
    for part, k in parts:
        i = part.start + np.arange(part.pmf.size)
        with np.errstate(divide="ignore"):
            logp = np.log(part.pmf) + lam * (i * h + part.shift) - part.log_mgf(np.array([lam]))[0]
        folded = np.bincount(np.mod(i, n), weights=np.exp(logp), minlength=n)
        spectrum *= sfft.rfft(folded) ** k
    g = np.roll(sfft.irfft(spectrum, n=n), -(i_lo % n))
    t = (i_lo + np.arange(n)) * h + shift
    with np.errstate(divide="ignore"):
        # FFT round-off can make masses slightly negative: clip to 0 (raising δ) and cap at 1
        log_pmf = np.log(np.maximum(g, 0.0)) + base - lam * t
    pmf = np.exp(np.minimum(log_pmf, 0.0))
    return ComposedLoss(h=h, start=i_lo, pmf=pmf, inf_mass=inf_mass, shift=shift,
                        log_slack=math.log(tail_mass) + base, tilt=lam)


def _suffix_sums(composed: ComposedLoss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t, D1, D2) with ``D1[i] = Σ_{j≥i} p_j`` and ``D2[i] = Σ_{j≥i} p_j e^{−(t_j − t_i)}``."""
    p = composed.pmf
    t = (composed.start + np.arange(p.size)) * composed.h + composed.shift
    d1 = np.cumsum(p[::-1])[::-1]
    d2 = lfilter([1.0], [1.0, -math.exp(-composed.h)], p[::-1])[::-1]
    return t, d1, d2


def delta_for_epsilon(composed: ComposedLoss, epsilon: float) -> float:
    """δ(ε) of the composed lattice distribution, with the ∞ atom and the window slack."""
    p = composed.pmf
    t = (composed.start + np.arange(p.size)) * composed.h + composed.shift
    above = t > epsilon
    val = float(np.sum(p[above] * -np.expm1(epsilon - t[above])))
    return float(composed.slack(epsilon)) + composed.inf_mass + val


def epsilon_for_delta(composed: ComposedLoss, delta: float) -> float:
    """Smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for the composed lattice distribution.

    Returns ``inf`` when no ε qualifies and ``nan`` when ε falls below the composition window
    (the caller then recomposes without tilting).
    """
    if delta <= composed.inf_mass:
        return math.inf
    t, d1, d2 = _suffix_sums(composed)
    d1_next = np.append(d1[1:], 0.0)
    d2_next = np.append(d2[1:], 0.0)
    slack = composed.slack(t)
    delta_grid = slack + composed.inf_mass + d1_next - math.exp(-composed.h) * d2_next
    ok = np.nonzero(delta_grid <= delta)[0]
    if ok.size == 0:
        return math.inf
    i = int(ok[0])
    if i == 0:
        return math.nan if composed.tilt > 0 and d1[0] > 0 else 0.0
    # on [t_{i-1}, t_i]: δ(ε) ≤ c + D1[i] − e^{ε − t_i} D2[i], c taken at the left end
    c = float(slack[i - 1]) + composed.inf_mass
    num = c + d1[i] - delta
    if d2[i] <= 0.0 or num <= 0.0:
        return max(float(t[i - 1]), 0.0)
    eps = float(t[i]) + math.log(num / d2[i])
    return max(eps, float(t[i - 1]), 0.0)


def compose_and_invert(
    parts: Sequence[tuple[LatticeLoss, int]], delta: float, max_size: int = MAX_FFT_SIZE
) -> float:
    """ε(δ) of the composition of ``parts`` (tilted FFT, untilted fallback)."""
    eps = epsilon_for_delta(compose(parts, delta, max_size=max_size), delta)
    if math.isnan(eps):
        logger.debug("epsilon below the tilted window; recomposing without tilt")
        eps = epsilon_for_delta(compose(parts, delta, max_size=max_size, tilt=False), delta)
    return 0.0 if math.isnan(eps) else eps
