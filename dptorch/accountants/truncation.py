"""Fixed-shape (truncated) Poisson sampling: what truncating a Poisson batch to ``M`` rows
costs in δ, and the ε of a run that pays for it.

A fixed-shape batch is a Poisson batch cut to at most ``M`` records (then padded). Outside the
steps where the cut bites, the run equals the Poisson run, so it is ``(ε, δ_P + (1 + e^ε)·τ)``-DP
when the Poisson run is ``(ε, δ_P)``-DP and ``τ`` bounds the probability that any step truncates
(:func:`truncated_delta`). :class:`Truncation` is that sampling as plain data; an accountant that
holds one includes the cost in every ε it reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "Truncation",
    "epsilon_with_truncation",
    "rank_rows",
    "step_truncation_probability",
    "truncated_delta",
    "truncation_delta",
    "truncation_probability",
]


@dataclass(frozen=True)
class Truncation:
    """Fixed-shape batches: ``num_records`` records (N), cut to ``max_batch_size`` rows (M)
    shared by ``world_size`` ranks."""

    num_records: int
    max_batch_size: int
    world_size: int = 1

    def tau(self, steps_by_rate: Sequence[tuple[float, int]]) -> float:
        """:func:`truncation_delta` of the ``(q, steps)`` of a run."""
        return truncation_delta(steps_by_rate, self.num_records, self.max_batch_size,
                                self.world_size)


def truncation_probability(num_records: int, sample_rate: float, max_batch_size: int) -> float:
    """``P(Binomial(num_records + 1, q) > M)``: the chance that a Poisson batch of the larger of
    two neighbouring data sets has more than ``M`` records (exact binomial tail)."""
    from scipy.stats import binom

    return float(binom.sf(max_batch_size, num_records + 1, sample_rate))


def rank_rows(max_batch_size: int, world_size: int = 1) -> int:
    """The rows of each rank's batch when a fixed shape of ``max_batch_size`` rows is shared
    by ``world_size`` ranks: ``ceil(M / W)`` (every rank the same shape)."""
    return -(-max_batch_size // world_size)


def step_truncation_probability(num_records: int, sample_rate: float, max_batch_size: int,
                                world_size: int = 1) -> float:
    """A bound on the probability that a step truncates, on either of two neighbouring data
    sets: ``Σ_r P(Binomial(N_r + 1, q) > M_r)`` over the ranks (rank r samples its shard of
    ``N_r`` records, in ``M_r`` = :func:`rank_rows` rows; one rank: :func:`truncation_probability`)."""
    m = rank_rows(max_batch_size, world_size)
    return sum(truncation_probability(len(range(r, num_records, world_size)), sample_rate, m)
               for r in range(world_size))


def truncation_delta(steps_by_rate: Sequence[tuple[float, int]], num_records: int,
                     max_batch_size: int, world_size: int = 1) -> float:
    """``τ = Σ steps × step_truncation_probability(q)`` over the ``(q, steps)`` of a run: a bound
    on the probability that any of its batches is truncated, on either of two neighbouring
    data sets (a union bound over the steps and the ranks)."""
    return sum(n * step_truncation_probability(num_records, q, max_batch_size, world_size)
               for q, n in steps_by_rate)


def truncated_delta(epsilon: float, poisson_delta: float, tau: float) -> float:
    """The δ of the truncated run at ``epsilon`` when the Poisson run is ``(epsilon,
    poisson_delta)``-DP and ``tau`` bounds its truncation probability:
    ``poisson_delta + (1 + e^ε)·τ``.

    Outside the truncation events the two runs are the same (coupled), so each output
    distribution is within total variation ``τ`` of the Poisson one, on D and on D':
    ``P[A(D) ∈ S] ≤ P[P(D) ∈ S] + τ ≤ e^ε P[P(D') ∈ S] + δ + τ ≤ e^ε P[A(D') ∈ S] + δ +
    (1 + e^ε)·τ``."""
    return poisson_delta + (1.0 + math.exp(epsilon)) * tau


def epsilon_with_truncation(epsilon_at: Callable[[float], float], delta: float,
                            tau: float) -> float:
    """The smallest ε (to 1e-9) with ``truncated_delta(ε, δ_P, tau) ≤ delta``, where
    ``epsilon_at(δ_P)`` is the Poisson run's ε at ``δ_P``: the fixed point of
    ``ε = epsilon_at(delta − (1 + e^ε)·tau)``, reached from below (``epsilon_at`` decreases
    in δ_P). ``ValueError`` when truncation alone spends ``delta``."""
    if tau == 0.0:
        return epsilon_at(delta)
    eps = 0.0
    for _ in range(100):
        rest = delta - (1.0 + math.exp(eps)) * tau
        if rest <= 0:
            raise ValueError(
                f"Truncating the fixed-shape batches costs delta >= (1 + e^eps)·{tau:.3g} "
                f"with eps >= {eps:.3g}, which reaches {delta:g}: ask for a larger delta, or "
                "train with a larger max_batch_size."
            )
        nxt = epsilon_at(rest)
        if nxt <= eps:  # eps is a fixed point from above: (eps, delta) holds
            return eps
        eps = nxt + 1e-9
    raise ValueError(
        f"No epsilon found for delta={delta:g} with truncation cost tau={tau:.3g} (the fixed "
        "point did not converge: truncation spends nearly all of delta). Ask for a larger "
        "delta, or train with a larger max_batch_size."
    )
