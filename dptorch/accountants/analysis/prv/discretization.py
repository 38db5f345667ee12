"""Mean-preserving discretisation of a privacy random variable (Gopi, Lee, Wutschitz 2021).

The PRV of one step (:mod:`..sgm_loss`) is truncated to ``[lo, hi]`` (the P-mass outside,
``p_out`` per step, is accounted for in δ), each lattice cell ``[(i − ½)h, (i + ½)h)`` is rounded
to its centre ``i·h``, and the whole lattice is shifted by the difference between the exact
truncated mean and the rounded mean, so the discrete variable has the exact mean.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..lattice import LatticeLoss
from ..sgm_loss import SubsampledGaussianLoss


@functools.lru_cache(maxsize=256)
def discretize_mean_preserving(
    sample_rate: float, noise_multiplier: float, direction: str, h: float, tail_mass: float
) -> tuple[LatticeLoss, float]:
    """Discretised truncated PRV of one step and its truncated mass ``p_out`` (≤ 2·tail_mass)."""
    loss = SubsampledGaussianLoss(sample_rate, noise_multiplier, direction)
    lo, hi = loss.tail_points(tail_mass)
    i0, i1 = math.floor(lo / h + 0.5), math.ceil(hi / h - 0.5)
    i1 = max(i1, i0)
    centres = np.arange(i0, i1 + 1) * h
    edges = np.concatenate((centres - h / 2, [centres[-1] + h / 2]))
    edges[0], edges[-1] = lo, hi
    p_mass, _ = loss.interval_masses(edges)
    inside, moment = loss.truncated_moment(lo, hi)
    p_out = max(1.0 - inside, 0.0)
    pmf = p_mass / p_mass.sum()
    shift = moment / inside - float(np.dot(pmf, centres))
    pmf.setflags(write=False)
    return LatticeLoss(h=h, start=i0, pmf=pmf, shift=shift), p_out
