"""Privacy-loss distributions on a lattice: FFT composition, conversion to ε, δ and f-DP.

A :class:`LatticeLoss` is a sub-probability mass function on the points ``(start + i)·h + shift``
plus an atom at +∞ (infinite loss, always counted fully in δ). Composing many of them sums
independent losses, i.e. convolves their PMFs; :func:`compose` does it by raising the discrete
Fourier transforms to the number of repetitions, on a circular window of ``n`` points chosen
from Chernoff bounds on the composed sum ``S``:

* the mass of ``S`` above the window's top ``hi`` wraps around to low losses, where it counts
  less (or not at all) in δ; it is at most ``P[S > hi]``, bounded by Chernoff, and that bound is
  added to δ (:attr:`ComposedLoss.slack`);
* the mass below the window wraps around to high losses, which can only raise δ.

**Tilting.** Float64 FFTs have an absolute error of about ``1e-16`` per point (and raising a
coefficient to the K-th power multiplies its relative error by K), which swamps a δ of
``1e-12``. Exponential tilting (multiply the PMFs by ``e^{λt}`` before the transform, divide
after; it commutes with convolution) moves the relative precision to losses near the tilt's
centre. :func:`compose_and_invert` composes untilted first, which is exact to round-off for
ordinary δ; when the round-off estimate at the ε found is not negligible against δ, it tilts
(the smallest tilt that suffices, at most the one centring the sum at that ε: the Chernoff
exponent for *that* loss level, not for δ) and composes again; if a heavy right tail makes
tilting useless (small q and σ: the Chernoff bound is loose by orders of magnitude), it
composes in long double. The remaining round-off estimate is charged to δ. The window slack is
the Chernoff bound on the *untilted* mass above the window, ``tail·E[e^{λS}]·e^{−λ·hi}``, a
constant. (Centring at the Chernoff exponent of δ and charging ``tail·E[e^{λS}]·e^{−λε}`` at
every ε, as an earlier version did, over-charges by ``e^{λ(hi − ε)}``: at few steps, where the
loss has a heavy right tail and the Chernoff estimate of ε is far above the exact ε, that slack
alone exceeded δ: ε = 0.40 for one step at q = 256/60000, σ = 1, δ = 1e-5, whose exact ε is
0.068.) A single step needs no FFT: its lattice is the composition.

:func:`epsilon_for_delta` then inverts the exact privacy profile of the composed lattice
distribution, ``δ(ε) = slack + inf_mass + Σ_t p_t (1 − e^{ε − t})_+``, which is piecewise
linear in ``e^ε`` between lattice points, so the inversion is exact; :func:`tradeoff` gives the
f-DP trade-off curve of the composed lattice pair by Neyman–Pearson.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy.signal import lfilter

logger = logging.getLogger(__name__)

#: default maximal FFT length (about 64 MiB of complex spectrum)
MAX_FFT_SIZE = 1 << 22

#: unit round-off of float64
_U = 2.0 ** -53
#: a composition is accepted when its estimated round-off error in δ is below this fraction of δ
#: (the estimate is then charged to δ: the result stays an upper bound, ~1e-4 relative looser
#: at most)
_ROUNDOFF_FRACTION = 1e-3
#: window tails (mass of the composed sum left out on each side) as a fraction of δ
_WINDOW_TAIL_FRACTION = 1e-10


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
        a = np.multiply.outer(lambdas, t)
        a += logp
        top = a.max(axis=1)
        a -= top[:, None]
        np.exp(a, out=a)
        return top + np.log(a.sum(axis=1))

    @functools.cached_property
    def _untilted_moments(self) -> tuple[float, float]:
        return self._tilted_moments(0.0)

    def tilted_moments(self, lam: float) -> tuple[float, float]:
        """(mean, variance) of the finite part tilted by ``e^{λt}`` (normalised)."""
        if lam == 0.0:
            return self._untilted_moments
        return self._tilted_moments(lam)

    def _tilted_moments(self, lam: float) -> tuple[float, float]:
        t, logp = self._support
        a = logp + lam * t
        w = np.exp(a - a.max())
        w /= w.sum()
        mean = float((w * t).sum())
        return mean, float((w * (t - mean) ** 2).sum())

    def variance(self) -> float:
        """Variance of the normalised finite part."""
        return self.tilted_moments(0.0)[1]

    def mean(self) -> float:
        """Mean of the normalised finite part."""
        return self.tilted_moments(0.0)[0]

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


Parts = Sequence[tuple[LatticeLoss, int]]


@dataclass(frozen=True)
class ComposedLoss:
    """A composition result: ``pmf[i]`` is the mass at ``(start + i)·h + shift``.

    ``δ`` at any ε gets ``inf_mass`` plus ``slack`` (the mass that may have left the window)
    added. ``tilt`` is the exponent the composition used and ``log_error`` the log of its
    round-off scale at loss ``t``: ``log_error + tilt·(t_ref − t)`` with ``t_ref = 0``.
    """

    h: float
    start: int
    pmf: np.ndarray
    inf_mass: float
    shift: float
    slack: float
    tilt: float = 0.0
    log_error: float = -math.inf

    @functools.cached_property
    def points(self) -> np.ndarray:
        """The lattice points of ``pmf``."""
        return (self.start + np.arange(self.pmf.size)) * self.h + self.shift

    @functools.cached_property
    def suffix_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """``(D1, D2)`` with ``D1[i] = Σ_{j≥i} p_j`` and ``D2[i] = Σ_{j≥i} p_j e^{−(t_j − t_i)}``."""
        p = self.pmf
        d1 = np.cumsum(p[::-1])[::-1]
        d2 = lfilter([1.0], [1.0, -math.exp(-self.h)], p[::-1])[::-1]
        return d1, d2

    def roundoff(self, epsilon: float) -> float:
        """Estimated round-off error of δ(ε) (the FFT's absolute error, untilted)."""
        return math.exp(min(self.log_error - self.tilt * epsilon, 700.0))


class _SumCGF:
    """Cumulant generating function ``Λ(λ) = log E[e^{λS}]`` of the sum ``S`` of ``k_j`` copies
    of each part's finite PMF, with its first two derivatives (one pass over the supports)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = [(p._support, k) for p, k in parts]

    def __call__(self, lam: float) -> tuple[float, float, float]:
        cgf = mean = var = 0.0
        for (t, logp), k in self.parts:
            if t.size == 0:
                return -math.inf, 0.0, 0.0
            a = logp + lam * t
            top = float(a.max())
            w = np.exp(a - top)
            s0 = float(w.sum())
            m = float((w * t).sum()) / s0
            cgf += k * (top + math.log(s0))
            mean += k * m
            var += k * max(float((w * (t - m) ** 2).sum()) / s0, 0.0)
        return cgf, mean, var


def _chernoff_side(cgf: _SumCGF, lam0: float, log_tau: float, sign: float, guess: float) -> float:
    """The Chernoff bound on one side of the sum tilted by ``e^{λ0 S}``: the smallest
    ``(Λ(λ0 + sign·μ) − Λ(λ0) − log τ)/μ`` over μ > 0, times ``sign`` (an upper end for
    sign = +1, a lower end for sign = −1). The bound holds for any μ; μ is found by a
    safeguarded Newton iteration on the derivative's numerator, which increases in μ."""
    base = cgf(lam0)[0]

    def numerator(mu: float) -> tuple[float, float, float]:
        c, m, v = cgf(lam0 + sign * mu)
        c -= base
        # d/dμ of (c − log τ)/μ has the sign of N = μ·c'(μ) − c + log τ; N' = μ·c''(μ) ≥ 0
        return mu * sign * m - c + log_tau, mu * v, (c - log_tau) / mu

    lo, hi = 0.0, math.inf
    mu = guess
    best = math.inf
    for _ in range(30):
        n, dn, bound = numerator(mu)
        best = min(best, bound)
        if n < 0:
            lo = mu
        else:
            hi = mu
        if hi < math.inf and hi - lo <= 2e-2 * hi:
            break
        step = mu - n / dn if dn > 0 else math.nan
        if lo < step < hi and math.isfinite(step):
            if abs(step - mu) <= 1e-2 * mu:  # converged: the bound is flat near its minimum
                break
            mu = step
        elif hi < math.inf:
            mu = math.sqrt(lo * hi) if lo > 0 else hi / 8.0
        elif mu < 1e12:
            mu = 4.0 * mu
        else:
            break
    return sign * best


def _window(cgf: _SumCGF, log_tau: float, lam0: float = 0.0) -> tuple[float, float]:
    """Chernoff: (lo, hi) with P[S < lo], P[S > hi] ≤ e^{log_tau} for the sum tilted by λ0."""
    sd = max(math.sqrt(cgf(lam0)[2]), 1e-300)
    guess = math.sqrt(-2.0 * log_tau) / sd
    hi = _chernoff_side(cgf, lam0, log_tau, 1.0, guess)
    lo = _chernoff_side(cgf, lam0, log_tau, -1.0, guess)
    return lo, hi


def window_width(parts: Parts, tail_mass: float) -> float:
    """Width (in loss units) of a window holding all but ``tail_mass`` of the composed sum
    on each side (untilted)."""
    lo, hi = _window(_SumCGF(parts), math.log(tail_mass))
    return hi - lo


def tilt_for(parts: Parts, epsilon: float, lam_max: float = 1e8) -> float:
    """The λ ≥ 0 minimising ``log E[e^{λS}] − λ·ε`` (the tilt that centres the sum at ε):
    the root of ``Λ'(λ) = ε`` (Λ' increases), by safeguarded Newton."""
    cgf = _SumCGF(parts)
    _, m, v = cgf(0.0)
    if m >= epsilon:
        return 0.0
    lo, hi = 0.0, math.inf
    lam = (epsilon - m) / max(v, 1e-300)
    for _ in range(60):
        lam = min(lam, lam_max)
        _, m, v = cgf(lam)
        if m < epsilon:
            lo = lam
            if lam >= lam_max:
                return lam_max
        else:
            hi = lam
        if hi < math.inf and hi - lo <= 1e-4 * hi:
            break
        step = lam + (epsilon - m) / v if v > 0 else math.nan
        if lo < step < hi and math.isfinite(step):
            lam = step
        elif hi < math.inf:
            lam = 0.5 * (lo + hi)
        else:
            lam = 4.0 * max(lam, 1e-12)
    return lam


def _power(c: np.ndarray, k: int) -> np.ndarray:
    """``c**k`` for complex ``c`` in polar form (4× faster than numpy's complex power, with the
    same conditioning: the relative error of ``c`` times k)."""
    if k == 1:
        return c
    with np.errstate(divide="ignore"):
        mag = np.exp(k * np.log(np.abs(c)))
    phase = k * np.angle(c)
    return mag * np.cos(phase) + 1j * (mag * np.sin(phase))


def compose(
    parts: Parts, tail_mass: float, lam: float = 0.0, max_size: int = MAX_FFT_SIZE,
    center: float | None = None, extended: bool = False,
) -> ComposedLoss:
    """Distribution of the sum of ``k_j`` independent copies of each lattice loss ``j``, with the
    PMFs tilted by ``e^{λt}`` before the FFT (module docstring).

    All parts must share the spacing ``h``. The window holds all but ``τ`` of the *tilted* sum
    on each side; the untilted mass above it, at most ``τ · E[e^{λS}] · e^{−λ·hi}``, is the
    returned ``slack``. ``τ = tail_mass``, or, for a tilted sum centred at ``center`` (the ε
    sought), ``tail_mass · e^{λ·center − Λ(λ)}``: then the slack, and the tilted mass below the
    window that wraps around to losses above ``center``, stay below ``tail_mass`` untilted
    (a narrower window than ``τ = tail_mass`` would give, for the same guarantee).
    ``extended`` runs the FFT in long double (80-bit where the platform has it: 2048 times less
    round-off, several times slower), for heavy-tailed sums that tilting cannot help.
    """
    h = parts[0][0].h
    if any(p.h != h for p, _ in parts):
        raise ValueError("all lattice losses must share the same spacing h")
    parts = [(p, k) for p, k in parts if k > 0]
    log_finite = sum(k * math.log1p(-p.inf_mass) if p.inf_mass < 1 else -math.inf
                     for p, k in parts)
    inf_mass = -math.expm1(log_finite) if log_finite > -math.inf else 1.0
    shift = sum(k * p.shift for p, k in parts)
    cgf = _SumCGF(parts)
    base = cgf(lam)[0]  # at λ = 0: log of the finite mass (≤ 0)
    log_tau = math.log(tail_mass)
    if lam > 0 and center is not None:
        log_tau = min(log_tau + lam * center - base, math.log(1e-3))
    lo, hi = _window(cgf, log_tau, lam)
    i_lo = math.floor((lo - shift) / h) - 1
    i_hi = math.ceil((hi - shift) / h) + 1
    n = sfft.next_fast_len(i_hi - i_lo + 1, real=True)
    if n > 2 * max_size:  # callers size h for max_size / 2 on the untilted window
        raise ValueError(
            f"composition needs an FFT of {n} points (> {2 * max_size}); widen the lattice spacing"
        )
    real = np.longdouble if extended else np.float64
    spectrum = None
    for part, k in parts:
        t_part, logp_part = part._support  # the non-zero masses and their points
        i = np.rint((t_part - part.shift) / h).astype(np.int64)
        if lam == 0.0:
            weights = np.exp(logp_part - part.log_mgf(np.array([0.0]))[0])
        else:
            weights = np.exp(logp_part + lam * t_part - part.log_mgf(np.array([lam]))[0])
        folded = np.bincount(np.mod(i, n), weights=weights, minlength=n)
        if extended:
            folded = folded.astype(real)
        term = _power(sfft.rfft(folded), k)
        spectrum = term if spectrum is None else spectrum * term
    g = np.roll(sfft.irfft(spectrum, n=n), -(i_lo % n))
    # FFT round-off can make masses slightly negative: clip to 0 (raising δ) and cap at 1
    if lam == 0.0 and not extended:
        pmf = np.minimum(np.maximum(g, 0.0) * math.exp(base), 1.0)
    else:
        t = ((i_lo + np.arange(n)) * h + shift).astype(real)
        with np.errstate(divide="ignore"):
            log_pmf = np.log(np.maximum(g, 0)) + real(base) - real(lam) * t
        pmf = np.exp(np.minimum(log_pmf, 0)).astype(np.float64)
    slack = math.exp(min(log_tau + base - lam * hi, 0.0))
    # round-off of the tilted masses, summed over the points above ε: ~u·√n from the
    # transforms, and ~K·u from raising each coefficient to the K-th power (its relative error
    # u becomes K·u: low frequencies carry it everywhere in the window); measured against long
    # double, u·√n·(1 + K/300) was at most 3× the actual error over the grid, so 100× it is safe
    unit = float(np.finfo(real).eps) / 2.0
    steps = sum(k for _, k in parts)
    log_error = math.log(100.0 * unit * math.sqrt(n) * (1.0 + steps / 300.0)) + base
    return ComposedLoss(h=h, start=i_lo, pmf=pmf, inf_mass=inf_mass, shift=shift, slack=slack,
                        tilt=lam, log_error=log_error)


def _suffix_sums(composed: ComposedLoss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t, D1, D2) of :attr:`ComposedLoss.suffix_sums`."""
    return (composed.points, *composed.suffix_sums)


def delta_for_epsilon(composed: ComposedLoss, epsilon: float) -> float:
    """δ(ε) of the composed lattice distribution, with the ∞ atom and the window slack."""
    p = composed.pmf
    t = composed.points
    above = t > epsilon
    val = float(np.sum(p[above] * -np.expm1(epsilon - t[above])))
    return min(composed.slack + composed.inf_mass + val, 1.0)


def epsilon_for_delta(composed: ComposedLoss, delta: float) -> float:
    """Smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for the composed lattice distribution (``inf``
    when there is none)."""
    c = composed.slack + composed.inf_mass
    if delta <= c:
        return math.inf
    t, d1, d2 = _suffix_sums(composed)
    d1_next = np.append(d1[1:], 0.0)
    d2_next = np.append(d2[1:], 0.0)
    delta_grid = c + d1_next - math.exp(-composed.h) * d2_next  # δ at each lattice point
    ok = np.nonzero(delta_grid <= delta)[0]
    if ok.size == 0:
        return math.inf
    i = int(ok[0])
    # on [t_{i-1}, t_i] (or below t_0): δ(ε) = c + D1[i] − e^{ε − t_i} D2[i]
    num = c + d1[i] - delta
    if d2[i] <= 0.0 or num <= 0.0:
        return max(float(t[i - 1]) if i > 0 else float(t[0]), 0.0)
    eps = float(t[i]) + math.log(num / d2[i])
    if i > 0:
        eps = max(eps, float(t[i - 1]))
    return max(eps, 0.0)


def _enough_tilt(parts: Parts, eps: float, composed: ComposedLoss, delta: float) -> float:
    """The smallest λ in ``[0, λ*]`` (λ* centres the sum at ε) whose round-off estimate at ε,
    ``100·u·√n·e^{Λ(λ) − λε}``, is below ``_ROUNDOFF_FRACTION · δ / 4``, ``n`` the size of
    ``composed`` (λ* if none is): a milder tilt keeps a heavy right tail from widening the
    window more than the precision needs. ``Λ(λ) − λε`` decreases on ``[0, λ*]``."""
    lam_star = tilt_for(parts, eps)
    cgf = _SumCGF(parts)
    # round-off scale of ``composed`` without its tilt factor, then the goal for Λ(λ) − λε
    goal = math.log(_ROUNDOFF_FRACTION * delta / 4.0) - (
        composed.log_error - cgf(composed.tilt)[0])

    def gap(lam: float) -> float:
        return cgf(lam)[0] - lam * eps - goal

    if lam_star <= 0.0 or gap(lam_star) >= 0.0:
        return lam_star
    lo, hi = 0.0, lam_star
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if gap(mid) > 0.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-3 * hi:
            break
    return hi


def compose_and_invert(
    parts: Parts, delta: float, max_size: int = MAX_FFT_SIZE, max_passes: int = 4
) -> float:
    """ε(δ) of the composition of ``parts``: untilted first, then tilted at the ε found until
    the round-off estimate at that ε is below ``1e-6·δ`` (module docstring)."""
    live = [(p, k) for p, k in parts if k > 0]
    if len(live) == 1 and live[0][1] == 1:  # one step: its lattice is the composition
        one = live[0][0]
        return epsilon_for_delta(ComposedLoss(h=one.h, start=one.start, pmf=one.pmf,
                                              inf_mass=one.inf_mass, shift=one.shift, slack=0.0),
                                 delta)
    tail = delta * _WINDOW_TAIL_FRACTION
    composed = compose(parts, tail, 0.0, max_size=max_size)
    eps = epsilon_for_delta(composed, delta)
    composed, eps = _tilted(parts, delta, tail, composed, eps, max_size, max_passes)
    if math.isfinite(eps) and composed.roundoff(eps) > _ROUNDOFF_FRACTION * delta:
        # a heavy right tail: no tilt makes float64 precise enough: long double
        center = eps if composed.tilt > 0 else None
        composed = compose(parts, tail, composed.tilt, max_size=max_size, center=center,
                           extended=True)
        eps = epsilon_for_delta(composed, delta)
    if not math.isfinite(eps):
        return eps
    # the round-off estimate (conservative) is charged to δ; it decreases in ε, so taking it
    # at the ε of δ itself over-charges
    err = composed.roundoff(eps)
    return epsilon_for_delta(composed, delta - err) if err < 0.5 * delta else math.inf


def _tilted(parts, delta, tail, composed, eps, max_size, max_passes):
    """The tilted recompositions of :func:`compose_and_invert`: ``(composition, ε)``."""
    for _ in range(max_passes - 1):
        if not math.isfinite(eps) or composed.roundoff(eps) <= _ROUNDOFF_FRACTION * delta:
            break
        lam = _enough_tilt(parts, eps, composed, delta)
        if abs(lam - composed.tilt) <= 1e-2 * max(lam, composed.tilt):
            break  # already centred at this ε: no tilt does better
        # predicted round-off scale at ε with this tilt (same window size): skip a tilt that
        # does not gain a factor 2 (a heavy right tail makes the Chernoff bound loose)
        cgf = _SumCGF(parts)
        # log of the new round-off scale over the current one (same window size)
        predicted = cgf(lam)[0] - lam * eps - (cgf(composed.tilt)[0] - composed.tilt * eps)
        if predicted > -math.log(2.0):
            break
        tilted = compose(parts, tail, lam, max_size=max_size, center=eps)
        new_eps = epsilon_for_delta(tilted, delta)
        if tilted.roundoff(new_eps) >= composed.roundoff(eps):
            break
        composed, eps = tilted, new_eps
        logger.debug("tilted composition at lambda=%.4g: epsilon=%.6g", lam, eps)
    return composed, eps


def composed_untilted(parts: Parts, tail_mass: float = 1e-16,
                      max_size: int = MAX_FFT_SIZE) -> ComposedLoss:
    """The untilted composition (for δ(ε) at ordinary δ and for trade-off curves)."""
    return compose(parts, tail_mass, 0.0, max_size=max_size)


def tradeoff(first: ComposedLoss, second: ComposedLoss, alpha: np.ndarray) -> np.ndarray:
    """β(α) of the Neyman–Pearson test between a composed lattice pair ``(P', Q')``, given
    ``first``, the P'-law of the loss ``L = log dP'/dQ'``, and ``second``, the Q'-law of ``−L``
    (the composition of the swapped lattices). The test rejects the lowest losses first; Q'-mass
    off the lattice (``L = −∞``, and what may have left ``second``'s window) is rejected for
    free, P'-mass at +∞ last. Reading each law from its own composition keeps the absolute
    precision of both tails (``p_t e^{−t}`` from ``first`` alone would lose the Q'-mass where
    ``p_t`` is below round-off). ``P'`` dominates the true pair, so the curve lies below the
    true one."""
    if first.shift != 0.0 or second.shift != 0.0 or first.h != second.h:
        raise ValueError("tradeoff() needs two unshifted compositions on one lattice")
    k1 = first.start + np.arange(first.pmf.size)
    k2 = -(second.start + np.arange(second.pmf.size))
    lo = int(min(k1[0], k2[-1]))
    size = int(max(k1[-1], k2[0])) - lo + 1
    p = np.zeros(size)
    p[k1 - lo] = first.pmf
    q = np.zeros(size)
    q[k2 - lo] = second.pmf
    alpha_at = np.concatenate(([0.0], np.cumsum(p)))  # after rejecting points ≤ each index
    q_lattice = float(q.sum())
    beta_at = np.maximum(q_lattice - np.concatenate(([0.0], np.cumsum(q))), 0.0)
    alpha = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
    beta = np.interp(alpha, alpha_at, beta_at, right=0.0)
    return np.clip(beta, 0.0, 1.0)
