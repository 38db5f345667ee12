"""Privacy-loss-distribution (PLD) accounting of the Poisson-subsampled Gaussian mechanism.

Each step's privacy loss (:mod:`.sgm_loss`, both directions of the add/remove relation) is
discretised onto the lattice ``{i·h}`` with the *connect-the-dots* rule (Doroshenko, Ghazi,
Kamath, Kumar, Manurangsi 2022, "Connect the Dots: Tighter Discrete Approximations of Privacy
Loss Distributions"): the P-mass of the loss in each cell ``(a, b] = (i·h, (i+1)·h]`` is split
between the two end points so that both the mass and ``E_P[e^{−loss}]`` (the Q-mass of the cell)
are preserved. The split is a mean-preserving spread of ``e^{−loss}``, and ``(1 − e^ε u)_+`` is
convex in ``u = e^{−loss}``, so the discrete pair *dominates* the true one: its privacy profile
is ≥ the true profile everywhere and equal on the lattice. Domination is preserved by
composition, so the composed ε is a rigorous upper bound. Tails:

* the P-mass above the upper cut (``tail_mass`` per step) goes to the +∞ atom, i.e. is counted
  as infinite loss and fully enters δ;
* the P-mass below the lower cut is moved up to the lowest lattice point (pessimistic).

Composition (:func:`.lattice.compose`) is by FFT with the window slack added to δ; the ε reported
is the maximum over the "remove" and "add" compositions (both orders of neighbouring datasets).

Error: per cell the spread raises the mean loss by at most ``h²/8``, so after ``K`` steps the
upper bound exceeds the exact ε by about ``K·h²/8`` (and by at most ``h`` for ``K = 1``). The
spacing is ``h = min(eps_error, sqrt(4·eps_error/K))``, which targets an excess of at most
``eps_error/2``; if the FFT would exceed :data:`.lattice.MAX_FFT_SIZE` points, ``h`` is widened
(the result stays an upper bound, only looser) and a warning is logged.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from .lattice import MAX_FFT_SIZE, LatticeLoss, compose_and_invert, window_width
from .sgm_loss import DIRECTIONS, SubsampledGaussianLoss

logger = logging.getLogger(__name__)

History = Sequence[tuple[float, float, int]]


@functools.lru_cache(maxsize=256)
def discretize_connect_the_dots(
    sample_rate: float, noise_multiplier: float, direction: str, h: float, tail_mass: float
) -> LatticeLoss:
    """Dominating connect-the-dots lattice PLD of one step (see the module docstring)."""
    loss = SubsampledGaussianLoss(sample_rate, noise_multiplier, direction)
    lo, hi = loss.tail_points(tail_mass)
    i0, i1 = math.floor(lo / h), math.ceil(hi / h)
    if i1 <= i0:
        i1 = i0 + 1
    t = np.arange(i0, i1 + 1) * h
    edges = np.concatenate(([-np.inf], t, [np.inf]))
    p_mass, q_mass = loss.interval_masses(edges)
    below, cells_p, cells_q, above = p_mass[0], p_mass[1:-1], q_mass[1:-1], p_mass[-1]
    # split each cell (a, b] so that mass and Q-mass are kept:
    # w_a + w_b = m, w_a e^{-a} + w_b e^{-b} = s  =>  w_a = (s e^{a} − m e^{-h}) / (1 − e^{-h})
    with np.errstate(over="ignore", invalid="ignore"):
        w_lo = (cells_q * np.exp(t[:-1]) - cells_p * math.exp(-h)) / -math.expm1(-h)
    w_lo = np.clip(np.nan_to_num(w_lo, nan=0.0, posinf=0.0, neginf=0.0), 0.0, cells_p)
    pmf = np.zeros(t.size)
    pmf[:-1] += w_lo
    pmf[1:] += cells_p - w_lo
    pmf[0] += below
    pmf.setflags(write=False)
    return LatticeLoss(h=h, start=i0, pmf=pmf, inf_mass=float(min(above, 1.0)))


def _spacing(total_steps: int, eps_error: float) -> float:
    return min(eps_error, math.sqrt(4.0 * eps_error / total_steps))


def _active(history: History) -> list[tuple[float, float, int]]:
    """Phases that leak anything: q > 0 and at least one step."""
    return [(float(s), float(q), int(k)) for s, q, k in history if q > 0 and k > 0]


def lattice_spacing(
    parts_at: Callable[[float], list[tuple[LatticeLoss, int]]], h: float, max_size: int
) -> tuple[float, list[tuple[LatticeLoss, int]]]:
    """Widen ``h`` until the composition window fits an FFT of ``max_size`` points.

    ``parts_at(h)`` discretises the history at spacing ``h``. Returns the spacing and parts.
    """
    for _ in range(10):
        parts = parts_at(h)
        width = window_width(parts, 1e-12)
        if width / h < 0.5 * max_size:
            return h, parts
        h_new = 1.05 * width / (0.5 * max_size)
        logger.warning("widening the lattice spacing from %.3g to %.3g to fit the FFT; the "
                       "upper bound may exceed the exact epsilon by more than eps_error", h, h_new)
        h = h_new
    return h, parts_at(h)


def epsilon_one_direction(
    history: History, direction: str, delta: float, eps_error: float,
    max_size: int = MAX_FFT_SIZE,
) -> float:
    """Upper bound on ε(δ) from the composed dominating lattice PLD in one direction."""
    phases = _active(history)
    total = sum(k for _, _, k in phases)
    tail_mass = delta * 1e-4 / total  # per step, counted as infinite loss

    def parts_at(h: float) -> list[tuple[LatticeLoss, int]]:
        return [(discretize_connect_the_dots(q, s, direction, h, tail_mass), k)
                for s, q, k in phases]

    _, parts = lattice_spacing(parts_at, _spacing(total, eps_error), max_size)
    return compose_and_invert(parts, delta, max_size=max_size)


def compute_epsilon_pld(history: History, delta: float, eps_error: float = 0.01) -> float:
    """Upper bound on ε(δ) of a history ``[(noise_multiplier, sample_rate, steps), ...]``.

    The bound is the maximum over both directions of the add/remove relation and exceeds the
    exact ε by about ``eps_error/2`` or less (see the module docstring).
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
    return max(epsilon_one_direction(phases, d, delta, eps_error) for d in DIRECTIONS)
