"""Privacy-loss-distribution accounting of Poisson-subsampled Gaussian steps: the
discretise-and-compose engine shared by the PLD and PRV accountants.

The input is a list of phases ``(σ, q, steps)`` (:func:`..events.gaussian_phases`; ``q = 1`` is
an unsampled Gaussian) and a neighbouring relation, ``"add_remove"`` or ``"replace_one"``
(:mod:`.sgm_loss`).

**Discretisation.** One step's privacy loss is put on the lattice ``{i·h}`` with the
*connect-the-dots* rule (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022): the P-mass of the
loss in each cell ``(a, b] = (i·h, (i+1)·h]`` is split between the two end points so that both
the P-mass and the Q-mass ``E_P[e^{−loss}]`` of the cell are kept. As a function of ``e^ε`` the
privacy profile is convex and the discrete profile is its chord through the lattice points, so
the discrete pair ``(P', Q')`` *dominates* the true one for every ``ε ∈ ℝ`` (its profile is ≥
everywhere, equal on the lattice). Tails: P-mass above the upper cut goes to a +∞ atom; P-mass at
or below the lowest lattice point is moved up to it; both moves only raise the profile. The cuts
leave out ``1e-30`` of P-mass per step (less when δ is tiny).

**The "add" direction for free.** Under add/remove the add direction is the swapped pair
``(Q, P)``. Domination for all ε is a Blackwell ordering, which is symmetric under swapping the
pair, so ``(Q', P')`` dominates ``(Q, P)``: the add lattice is the remove lattice reflected, with
masses ``p_t e^{−t}`` and an +∞ atom holding the Q-mass not on the lattice
(:meth:`.lattice.LatticeLoss.swapped`). The replace-one pair is symmetric: one direction.

**Composition** (:func:`.lattice.compose_and_invert`): FFT exponentiation (one transform per
phase, pointwise power, one inverse) in float64, tilted when δ is too small for the untilted
round-off, on a window sized by Chernoff bounds whose wrap-around slack is added to δ.
Domination survives composition, so every ε returned is a rigorous upper bound of the exact ε
(up to float round-off), whatever the spacing ``h``.

**Spacing: tight, and monotone by construction.** The spacing only controls how *tight* the
bound is. Per step the connect-the-dots split is a random rounding of the loss with
``E[e^{−D}] = 1`` and variance at most about ``h²/6``; after ``K`` steps the composed loss is, to
first order, the true one plus an independent ``N(Kh²/12, Kh²/6)``: a Gaussian mechanism of
``μ_D² = Kh²/6`` composed with the true one. Where the composed loss is Gaussian-like
(``μ² = Kv``, ``v`` the per-step loss variance) the excess is ``(dε/dμ)·μ_D²/(2μ)``, which is at
most ``h²/(6v)·ε`` for every K and δ; at a single step the chord's excess is about
``h²/(8v)·ε``; where ε is dominated by the mean loss ``m`` (large q, small σ: ``m`` well below
``v/2``) the ``Kh²/12`` shift gives ``h²/(12m)·ε``. Hence the spacing is
``h = κ·√(r·min(6v, 12m))`` (:func:`step_scale`), ``r`` the relative excess aimed at
(``eps_error/4``: 0.25 % by default, measured at most 0.15 % over the test grid), rounded *down*
to a power of two. It depends on neither the number of steps nor δ, does not increase with σ,
and the lattices are nested, so:

* more steps on the same lattice compose one more dominating pair: ε cannot decrease;
* a larger δ inverts the same profile: ε cannot increase;
* a larger σ gives a dominated pair (the pair at σ is a post-processing of the pair at a
  smaller σ), on the same or a finer lattice (the connect-the-dots pair on a lattice dominates
  the one on any finer nested lattice, which has the same profile on the coarse points): ε
  cannot increase.

So ε is monotone in T, σ and δ exactly, up to float round-off (whose estimate is charged to δ,
see :func:`.lattice.compose_and_invert`). In the Gaussian-like regime the FFT has about
``15·√(K/r)`` points whatever q and σ (4.5e4 at 14k steps). Far from 0 the cells of a step's
lattice widen (:func:`band_edges`: the far tails carry little mass), which keeps heavy-tailed
steps (small q and σ: a tiny bulk variance, losses up to tens) to ~1e5 evaluated points. With
several phases the smallest spacing is used. If the FFT would exceed
:data:`.lattice.MAX_FFT_SIZE` points, ``h`` is doubled (the result stays an upper bound, only
looser) and a warning is logged.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import numpy as np

from ..events import check_relation
from .lattice import (
    MAX_FFT_SIZE,
    ComposedLoss,
    LatticeLoss,
    compose,
    compose_and_invert,
    delta_for_epsilon,
    tradeoff,
)
from .sgm_loss import step_loss

logger = logging.getLogger(__name__)

History = Sequence[tuple[float, float, int]]

#: P-mass per step left out of the lattice by the tail cuts (sent to the +∞ atom, or moved up
#: to the lowest lattice point)
TAIL_MASS = 1e-24

#: fraction of δ that the tail cuts of all the steps together may spend (used when δ is tiny)
TAIL_FRACTION = 1e-8

#: the relative excess aimed at is ``eps_error · RELATIVE_PER_EPS_ERROR`` (0.25 % by default)
RELATIVE_PER_EPS_ERROR = 0.25

#: safety factor on the spacing model h = √(6·r·v)
_KAPPA = 0.8

#: steps up to which ``K·tail`` stays negligible next to δ·TAIL_FRACTION for every δ ≥ 1e-16
_MAX_WIDENINGS = 12


#: cells of one lattice step up to this many steps from 0; beyond, cell widths double every
#: time the distance to 0 doubles (the far tails carry little mass: their rounding adds little)
BAND_CELLS = 1 << 14


def _band_side(n: int, a: int = BAND_CELLS) -> np.ndarray:
    """Non-negative cell edges (lattice indices) up to ``n``: step 1 up to ``a``, then step
    ``2^j`` on ``(a·2^j, a·2^{j+1}]``; ``n`` itself is the last edge."""
    pieces = [np.arange(0, min(n, a) + 1)]
    j = 0
    while a << j < n:
        step = 1 << j
        pieces.append(np.arange((a << j) + step, min(a << (j + 1), n) + 1, step))
        j += 1
    e = np.concatenate(pieces)
    return e if e[-1] == n else np.append(e, n)


def band_edges(i0: int, i1: int) -> np.ndarray:
    """The cell edges (lattice indices) from ``i0`` to ``i1``: every lattice point within
    :data:`BAND_CELLS` of 0, then cells doubling in width with the distance to 0. The edges
    scale with ``h`` (they are a set of multiples of ``h`` fixed in units of ``h``), so the
    partition at ``h`` refines the one at ``2h``: the nesting that keeps ε monotone in σ."""
    if -BAND_CELLS <= i0 and i1 <= BAND_CELLS:
        return np.arange(i0, i1 + 1, dtype=np.int64)
    parts = []
    if i0 < 0:
        parts.append(-_band_side(-i0)[::-1])
    if i1 > 0:
        parts.append(_band_side(i1))
    e = np.unique(np.concatenate(parts)) if parts else np.array([], dtype=np.int64)
    e = e[(e >= i0) & (e <= i1)]
    if e.size == 0 or e[0] != i0:
        e = np.concatenate(([i0], e))
    if e[-1] != i1:
        e = np.append(e, i1)
    return e.astype(np.int64)


@functools.lru_cache(maxsize=32)  # a lattice can hold millions of points (heavy tails)
def discretize_connect_the_dots(
    sample_rate: float, noise_multiplier: float, h: float, tail_mass: float,
    relation: str = "add_remove",
) -> tuple[LatticeLoss, ...]:
    """Dominating connect-the-dots lattice PLDs of one step: the pair ``(P', Q')`` and its
    swap ``(Q', P')`` (under add/remove: the remove and add directions; under replace-one the
    pair is symmetric and the swap only serves trade-off curves).

    ``tail_mass`` bounds the P-mass cut from each tail (see the module docstring).
    """
    loss = step_loss(sample_rate, noise_multiplier, relation)
    lo, hi = loss.tail_points(tail_mass)
    i0, i1 = math.floor(lo / h), math.ceil(hi / h)
    if i1 <= i0:
        i1 = i0 + 1
    idx = band_edges(i0, i1)
    t = idx * h
    edges = np.concatenate(([-np.inf], t, [np.inf]))
    p_mass, q_mass = loss.interval_masses(edges)
    cells_p, cells_q = p_mass[1:-1], q_mass[1:-1]
    # split each cell (a, b] so that mass and Q-mass are kept, with d = b − a:
    # w_a + w_b = m, w_a e^{-a} + w_b e^{-b} = s  =>  w_a = (s e^{a} − m e^{-d}) / (1 − e^{-d})
    d = np.diff(t)
    with np.errstate(over="ignore", invalid="ignore"):
        w_lo = (cells_q * np.exp(t[:-1]) - cells_p * np.exp(-d)) / -np.expm1(-d)
    w_lo = np.clip(np.nan_to_num(w_lo, nan=0.0, posinf=0.0, neginf=0.0), 0.0, cells_p)
    pmf = np.zeros(i1 - i0 + 1)
    np.add.at(pmf, idx[:-1] - i0, w_lo)
    np.add.at(pmf, idx[1:] - i0, cells_p - w_lo)
    pmf[0] += p_mass[0]
    pmf.setflags(write=False)
    first = LatticeLoss(h=h, start=i0, pmf=pmf, inf_mass=float(min(p_mass[-1], 1.0)))
    # Q-mass off the lattice: above the upper cut, and what the lower cut's move gave up
    below = q_mass[0] - p_mass[0] * math.exp(-t[0]) if p_mass[0] > 0 else q_mass[0]
    outside = q_mass[-1] + max(below, 0.0)
    log_outside = math.log(outside) if outside > 0 else -math.inf
    return first, first.swapped(log_outside)


@functools.lru_cache(maxsize=1024)
def step_variance(sample_rate: float, noise_multiplier: float, relation: str = "add_remove") -> float:
    """Variance of one step's loss, made non-decreasing in q (``min(v(q), v(1))``: under
    add/remove at small σ it peaks below q = 1); non-increasing in σ."""
    v = step_loss(sample_rate, noise_multiplier, relation).moments()[1]
    if sample_rate < 1.0:
        v = min(v, step_loss(1.0, noise_multiplier, relation).moments()[1])
    return v


@functools.lru_cache(maxsize=1024)
def step_scale(sample_rate: float, noise_multiplier: float, relation: str = "add_remove") -> float:
    """``min(6v, 12m)``: ``v`` the loss variance (:func:`step_variance`), ``m`` the smaller of
    ``KL(P‖Q)`` and ``KL(Q‖P)``. The rounding of a step adds a mean of about ``h²/12`` to the
    loss; where ε is dominated by the mean loss (large q, small σ: ``m`` well below ``v/2``)
    the relative excess is ``h²/(12m)``, else ``h²/(6v)`` (equal for a Gaussian, ``m = v/2``).
    Both are non-increasing in σ and non-decreasing in q (KL by data processing)."""
    m = min(step_loss(sample_rate, noise_multiplier, relation).kl_divergences())
    return min(6.0 * step_variance(sample_rate, noise_multiplier, relation), 12.0 * max(m, 0.0))


def model_spacing(phases: Sequence[tuple[float, float, int]], relation: str, eps_error: float) -> float:
    """The power of two at or below ``κ·√(r·min(6v, 12m))`` (module docstring,
    :func:`step_scale`), minimised over the phases, with ``r = eps_error ·
    RELATIVE_PER_EPS_ERROR``."""
    scale = min(step_scale(q, s, relation) for s, q, _ in phases)
    r = eps_error * RELATIVE_PER_EPS_ERROR
    raw = _KAPPA * math.sqrt(r * max(scale, 1e-300))
    return 2.0 ** math.floor(math.log2(raw))


def _tail_mass(phases: Sequence[tuple[float, float, int]], delta: float, tail_delta: float | None) -> float:
    total = sum(k for _, _, k in phases)
    budget = delta * TAIL_FRACTION if tail_delta is None else min(tail_delta, delta * TAIL_FRACTION)
    return min(TAIL_MASS, budget / total)


def _parts(phases, h, tail, relation, both: bool = False) -> list[list[tuple[LatticeLoss, int]]]:
    """One list of ``(lattice, steps)`` per direction that can be the worse one (``both``:
    the pair and its swap, always)."""
    lattices = [(discretize_connect_the_dots(q, s, h, tail, relation), k) for s, q, k in phases]
    symmetric = relation == "replace_one" or all(q == 1.0 for _, q, _ in phases)
    directions = 1 if symmetric and not both else 2
    return [[(lat[d], k) for lat, k in lattices] for d in range(directions)]


def _fits(phases, h, tail, relation, max_size) -> bool:
    """Whether every step's lattice has at most ``max_size`` points at spacing ``h``."""
    for s, q, _ in phases:
        lo, hi = step_loss(q, s, relation).tail_points(tail)
        if (hi - lo) / h > max_size:
            return False
    return True


def _with_spacing(fn, phases, delta, relation, eps_error, tail, max_size, both=False):
    """``fn(parts_per_direction)`` at the model spacing, doubled while the FFT does not fit."""
    h = model_spacing(phases, relation, eps_error)
    for attempt in range(_MAX_WIDENINGS + 1):
        if _fits(phases, h, tail, relation, max_size):
            try:
                return fn(_parts(phases, h, tail, relation, both))
            except ValueError as err:
                if "widen the lattice spacing" not in str(err) or attempt == _MAX_WIDENINGS:
                    raise
        logger.warning("widening the lattice spacing from %.3g to %.3g to fit the FFT; the "
                       "upper bound may exceed the exact epsilon by more than eps_error", h, 2 * h)
        h *= 2.0
    raise ValueError("the composition does not fit the FFT size limit")


def _active(history: History) -> list[tuple[float, float, int]]:
    """Phases that leak anything: q > 0 and at least one step."""
    return [(float(s), float(q), int(k)) for s, q, k in history if q > 0 and k > 0]


def _check(delta: float, eps_error: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}.")
    if not eps_error > 0:
        raise ValueError(f"eps_error must be > 0, got {eps_error}.")


def compute_epsilon_pld(
    history: History,
    delta: float,
    eps_error: float = 0.01,
    tail_delta: float | None = None,
    max_size: int = MAX_FFT_SIZE,
    relation: str = "add_remove",
) -> float:
    """Upper bound on ε(δ) of phases ``[(noise_multiplier, sample_rate, steps), ...]``.

    The bound is the maximum over both directions of the add/remove relation (one direction for
    replace-one) and exceeds the exact ε by about ``eps_error/4`` relative or less (0.25 % by
    default; see the module docstring). ``tail_delta`` caps the δ spent on the tail cuts.
    Results are cached.
    """
    _check(delta, eps_error)
    check_relation(relation)
    phases = _active(history)
    if not phases:
        return 0.0
    if any(s == 0.0 for s, _, _ in phases):
        return math.inf
    return _cached_epsilon(tuple(phases), float(delta), float(eps_error),
                           tail_delta, int(max_size), relation)


@functools.lru_cache(maxsize=512)
def _cached_epsilon(phases, delta, eps_error, tail_delta, max_size, relation) -> float:
    tail = _tail_mass(phases, delta, tail_delta)

    def run(per_direction):
        return max(compose_and_invert(parts, delta, max_size=max_size) for parts in per_direction)

    return _with_spacing(run, phases, delta, relation, eps_error, tail, max_size)


@functools.lru_cache(maxsize=8)
def _untilted(phases, eps_error, max_size, relation) -> tuple[ComposedLoss, ...]:
    """The untilted compositions of each direction (for δ(ε) and trade-off curves)."""
    tail = min(TAIL_MASS, 1e-20 / sum(k for _, _, k in phases))

    def run(per_direction):
        return tuple(compose(parts, 1e-18, 0.0, max_size=max_size) for parts in per_direction)

    return _with_spacing(run, phases, 1e-10, relation, eps_error, tail, max_size, both=True)


def compute_delta_pld(
    history: History, epsilon: float, eps_error: float = 0.01,
    max_size: int = MAX_FFT_SIZE, relation: str = "add_remove",
) -> float:
    """Upper bound on δ(ε) (maximum over the directions), from the untilted composition."""
    check_relation(relation)
    phases = _active(history)
    if not phases:
        return 0.0
    if any(s == 0.0 for s, _, _ in phases):
        return 1.0
    comps = _untilted(tuple(phases), float(eps_error), int(max_size), relation)
    if relation == "replace_one":
        comps = comps[:1]  # the swap of the symmetric pair is not a neighbouring pair's order
    return max(delta_for_epsilon(c, float(epsilon)) for c in comps)


def compute_tradeoff_pld(
    history: History, alpha: np.ndarray, eps_error: float = 0.01,
    max_size: int = MAX_FFT_SIZE, relation: str = "add_remove",
) -> np.ndarray:
    """A lower bound on the f-DP trade-off curve β(α): the minimum over both orders of every
    neighbouring pair of the Neyman–Pearson curve of the dominating lattice pair (for the
    remove pair ``(P, Q)`` the add lattice gives the order ``(Q, P)``; the replace-one pair is
    symmetric)."""
    check_relation(relation)
    alpha = np.asarray(alpha, dtype=np.float64)
    phases = _active(history)
    if not phases:
        return 1.0 - np.clip(alpha, 0.0, 1.0)
    if any(s == 0.0 for s, _, _ in phases):
        return np.zeros_like(alpha)
    first, second = _untilted(tuple(phases), float(eps_error), int(max_size), relation)
    return np.minimum(tradeoff(first, second, alpha), tradeoff(second, first, alpha))
