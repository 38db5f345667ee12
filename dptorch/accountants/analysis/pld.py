"""Privacy-loss-distribution accounting of the Poisson-subsampled Gaussian mechanism: the
discretise-and-compose engine shared by the PLD and PRV accountants.

**Discretisation.** One step's privacy loss in the "remove" direction (:mod:`.sgm_loss`) is put on
the lattice ``{i·h}`` with the *connect-the-dots* rule (Doroshenko, Ghazi, Kamath, Kumar,
Manurangsi 2022): the P-mass of the loss in each cell ``(a, b] = (i·h, (i+1)·h]`` is split between
the two end points so that both the P-mass and the Q-mass ``E_P[e^{−loss}]`` of the cell are kept.
As a function of ``e^ε`` the privacy profile is convex and the discrete profile is its chord
through the lattice points, so the discrete pair ``(P', Q')`` *dominates* the true one for every
``ε ∈ ℝ`` (its profile is ≥ everywhere, equal on the lattice). Tails: P-mass above the upper cut
goes to a +∞ atom; P-mass at or below the lowest lattice point ``a`` is moved up to ``a`` (its
Q-mass only shrinks, the rest of ``Q`` sits at loss −∞); both moves only raise the profile.

**The "add" direction for free.** The add direction is the swapped pair ``(Q, P)``. Domination
for all ε is a Blackwell ordering, which is symmetric under swapping the pair, so ``(Q', P')``
dominates ``(Q, P)``: the add lattice is the remove lattice reflected, with masses
``p_t e^{−t}`` and an +∞ atom holding the Q-mass not on the lattice
(:meth:`.lattice.LatticeLoss.swapped`); no second discretisation. For ``q = 1`` both directions
have the same loss distribution, so one is composed.

**Composition** (:func:`.lattice.compose`): FFT exponentiation (one transform per phase, pointwise
power, one inverse) in float64 with exponential tilting, on a window sized by Chernoff bounds
whose wrap-around slack is added to δ. Domination survives composition, so every ε returned is a
rigorous upper bound of the exact ε (up to float round-off), whatever the spacing ``h``.

**Spacing, from the error budget.** The spacing only controls how *tight* the bound is. Per step
the connect-the-dots split is a random rounding of the loss with ``E[e^{−D}] = 1`` and variance
about ``h²/6``; after ``K`` steps the composed loss is, to first order, the true one plus an
independent ``N(Kh²/12, Kh²/6)``, which raises the mean loss ``μ`` by ``Kh²/12``. Hence the excess
is ``≈ (dε/dμ)·K·h²/12`` with ``dε/dμ`` taken from the Gaussian (μ-GDP) approximation of the
composed loss; ``h`` is the largest spacing whose predicted excess is ``eps_error/2`` (and
``h ≤ eps_error/2``, which bounds the excess of a single step). The prediction is then *checked*
by Richardson's rule: the excess at ``h`` is ``≈ (ε(2h) − ε(h))/3`` from a composition at ``2h``;
if it exceeds the budget, ``h`` is refined once. The ``2h`` compositions of both directions also
pick the dominating direction: the other direction is composed at ``h`` only if its (valid,
coarser) upper bound at ``2h`` exceeds the result. If the FFT would exceed
:data:`.lattice.MAX_FFT_SIZE` points, ``h`` is widened (the result stays an upper bound, only
looser) and a warning is logged.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from .gdp import eps_from_mu
from .lattice import MAX_FFT_SIZE, LatticeLoss, compose_and_invert, window_width
from .sgm_loss import SubsampledGaussianLoss

logger = logging.getLogger(__name__)

History = Sequence[tuple[float, float, int]]

#: fraction of δ spent on tail truncation: tiny, as a δ error moves a large ε a lot (where the
#: profile is flat in ε), and cheap, as the cut points grow only like √log(1/tail)
TAIL_FRACTION = 1e-7

#: lattice points of the rough discretisation used only to estimate the loss variance
_MOMENT_POINTS = 2048


@functools.lru_cache(maxsize=256)
def discretize_connect_the_dots(
    sample_rate: float, noise_multiplier: float, h: float, tail_mass: float
) -> tuple[LatticeLoss, LatticeLoss]:
    """Dominating connect-the-dots lattice PLDs of one step: ``(remove, add)``.

    ``tail_mass`` bounds the P-mass sent to the +∞ atom (see the module docstring).
    """
    loss = SubsampledGaussianLoss(sample_rate, noise_multiplier)
    lo, hi = loss.tail_points(tail_mass)
    i0, i1 = math.floor(lo / h), math.ceil(hi / h)
    if i1 <= i0:
        i1 = i0 + 1
    t = np.arange(i0, i1 + 1) * h
    edges = np.concatenate(([-np.inf], t, [np.inf]))
    p_mass, q_mass = loss.interval_masses(edges)
    cells_p, cells_q = p_mass[1:-1], q_mass[1:-1]
    # split each cell (a, b] so that mass and Q-mass are kept:
    # w_a + w_b = m, w_a e^{-a} + w_b e^{-b} = s  =>  w_a = (s e^{a} − m e^{-h}) / (1 − e^{-h})
    with np.errstate(over="ignore", invalid="ignore"):
        w_lo = (cells_q * np.exp(t[:-1]) - cells_p * math.exp(-h)) / -math.expm1(-h)
    w_lo = np.clip(np.nan_to_num(w_lo, nan=0.0, posinf=0.0, neginf=0.0), 0.0, cells_p)
    pmf = np.zeros(t.size)
    pmf[:-1] += w_lo
    pmf[1:] += cells_p - w_lo
    pmf[0] += p_mass[0]
    pmf.setflags(write=False)
    remove = LatticeLoss(h=h, start=i0, pmf=pmf, inf_mass=float(min(p_mass[-1], 1.0)))
    # Q-mass off the lattice: above the upper cut, and what the lower cut's move gave up
    with np.errstate(divide="ignore"):
        below = q_mass[0] - p_mass[0] * math.exp(-t[0]) if p_mass[0] > 0 else q_mass[0]
        log_outside = math.log(max(q_mass[-1] + max(below, 0.0), 0.0)) \
            if q_mass[-1] + max(below, 0.0) > 0 else -math.inf
    return remove, remove.swapped(log_outside)


def _active(history: History) -> list[tuple[float, float, int]]:
    """Phases that leak anything: q > 0 and at least one step."""
    return [(float(s), float(q), int(k)) for s, q, k in history if q > 0 and k > 0]


@functools.lru_cache(maxsize=256)
def _step_variance(sample_rate: float, noise_multiplier: float) -> float:
    """Variance of one step's remove loss, from a rough lattice (for choosing ``h`` only)."""
    lo, hi = SubsampledGaussianLoss(sample_rate, noise_multiplier).tail_points(1e-15)
    h = max(hi - lo, 1e-12) / _MOMENT_POINTS
    return discretize_connect_the_dots(sample_rate, noise_multiplier, h, 1e-15)[0].variance()


def model_spacing(phases: list[tuple[float, float, int]], delta: float, excess: float) -> float:
    """Largest ``h`` whose predicted excess ``(dε/dμ)·K·h²/12`` is ``excess`` (module docstring)."""
    total = sum(k for _, _, k in phases)
    var = sum(k * _step_variance(q, s) for s, q, k in phases)
    m = math.sqrt(max(var, 1e-300))
    # dε/dμ of μ-GDP with loss mean m²/2: (dε/dm) / m, by a central difference
    dm = 1e-3 * m
    deriv = (eps_from_mu(mu=m + dm, delta=delta) - eps_from_mu(mu=max(m - dm, 0.0), delta=delta))
    slope = max(deriv / (2 * dm * m), 1.0) if math.isfinite(deriv) else 1.0
    h = math.sqrt(12.0 * excess / (slope * total))
    return min(h, excess)


def lattice_spacing(
    parts_at: Callable[[float], list[tuple[LatticeLoss, int]]], h: float, max_size: int
) -> tuple[float, list[tuple[LatticeLoss, int]], bool]:
    """Widen ``h`` until the composition window fits an FFT of ``max_size`` points.

    ``parts_at(h)`` discretises the history at spacing ``h``. Returns the spacing, the parts and
    whether ``h`` was widened.
    """
    widened = False
    for _ in range(10):
        parts = parts_at(h)
        width = window_width(parts, 1e-12)
        if width / h < 0.5 * max_size:
            return h, parts, widened
        h_new = 1.05 * width / (0.5 * max_size)
        logger.warning("widening the lattice spacing from %.3g to %.3g to fit the FFT; the "
                       "upper bound may exceed the exact epsilon by more than eps_error", h, h_new)
        h, widened = h_new, True
    return h, parts_at(h), widened


def epsilon_upper_bound(
    phases: list[tuple[float, float, int]], delta: float, eps_error: float, tail_delta: float,
    max_size: int = MAX_FFT_SIZE,
) -> float:
    """Upper bound on ε(δ) over both add/remove directions, aiming at ``eps_error/2`` excess.

    ``phases`` are active ``(σ > 0, q > 0, k > 0)``; ``tail_delta`` bounds the total P-mass put at
    infinite loss by truncation (it enters δ, so any value keeps the bound valid).
    """
    total = sum(k for _, _, k in phases)
    tail_mass = tail_delta / total
    budget = 0.5 * eps_error
    directions = (0,) if all(q == 1.0 for _, q, _ in phases) else (0, 1)

    def parts_at(h: float, d: int = 0) -> list[tuple[LatticeLoss, int]]:
        return [(discretize_connect_the_dots(q, s, h, tail_mass)[d], k) for s, q, k in phases]

    def eps_at(h: float, d: int) -> float:
        return compose_and_invert(parts_at(h, d), delta, max_size=max_size)

    h, _, widened = lattice_spacing(parts_at, model_spacing(phases, delta, budget), max_size)
    coarse = {d: eps_at(2.0 * h, d) for d in directions}
    main = max(directions, key=lambda d: coarse[d])
    eps = eps_at(h, main)
    excess = (coarse[main] - eps) / 3.0  # Richardson: the excess scales as h²
    if not widened and math.isfinite(excess) and excess > 1.5 * budget:
        h *= 0.95 * math.sqrt(budget / excess)
        logger.debug("refining the lattice spacing to %.3g (estimated excess %.3g)", h, excess)
        eps = eps_at(h, main)
    for d in directions:
        if d != main and coarse[d] > eps:
            eps = max(eps, eps_at(h, d))
    return eps


def compute_epsilon_pld(
    history: History,
    delta: float,
    eps_error: float = 0.01,
    tail_delta: float | None = None,
    max_size: int = MAX_FFT_SIZE,
) -> float:
    """Upper bound on ε(δ) of a history ``[(noise_multiplier, sample_rate, steps), ...]``.

    The bound is the maximum over both directions of the add/remove relation and exceeds the
    exact ε by about ``eps_error/2`` or less (see the module docstring). ``tail_delta`` is the δ
    spent on truncating the steps' tails (default ``delta · TAIL_FRACTION``); results at the
    default ``max_size`` are cached per history.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}.")
    if not eps_error > 0:
        raise ValueError(f"eps_error must be > 0, got {eps_error}.")
    phases = _active(history)
    if not phases:
        return 0.0
    if any(s == 0.0 for s, _, _ in phases):
        return math.inf
    tail_delta = delta * TAIL_FRACTION if tail_delta is None else tail_delta
    if max_size != MAX_FFT_SIZE:
        return epsilon_upper_bound(phases, delta, eps_error, tail_delta, max_size=max_size)
    return _cached_upper_bound(tuple(phases), delta, eps_error, tail_delta)


def _cached_upper_bound(
    phases: tuple[tuple[float, float, int], ...], delta: float, eps_error: float, tail_delta: float
) -> float:
    return epsilon_upper_bound(list(phases), delta, eps_error, tail_delta)
