"""Poisson sampling over a data set split across ``torch.distributed`` ranks.

Re-exported by :mod:`dptorch.utils.uniform_sampler`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ._poisson import (
    as_index_tensor,
    check_secure_generator,
    poisson_mask,
    resolve_steps,
    validate_sample_rate,
)

_SEED_BOUND = 2**63 - 1


def _rank_generator(generator: torch.Generator | None, rank: int) -> torch.Generator:
    """A generator private to ``rank``, seeded from one draw of ``generator`` (or of torch's global
    RNG) mixed with the rank, so that ranks seeded alike still draw independent batches."""
    device = generator.device if generator is not None else torch.device("cpu")
    base = int(torch.randint(_SEED_BOUND, (1,), generator=generator, device=device).item())
    seed = int(np.random.SeedSequence([base, rank]).generate_state(1, np.uint64)[0]) >> 1
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class DistributedUniformWithReplacementSampler(Sampler[list[int]]):
    """Batch sampler for distributed DP training: Poisson sampling of the whole data set (or of
    the subset ``indices``), each rank sampling its own shard.

    The ``total_size`` indices (``range(total_size)``, or the entries of ``indices`` when only a
    subset of the data set is trained on) are split into ``num_replicas`` disjoint shards (rank
    ``r`` gets positions ``r, r + W, r + 2W, ...`` of a permutation shared by all ranks,
    reshuffled every epoch with seed ``shuffle_seed + epoch`` when ``shuffle``). At every step
    each rank keeps each index of its shard independently with probability ``sample_rate``, so
    every record sampled from is in the global batch with probability ``q`` (exactly once, on the
    rank owning it) and no other record ever is, as the privacy accounting assumes. A local batch may be empty; it is still yielded (as ``[]``) so that
    all ranks run the same number of steps.

    Each rank's draws come from its own generator, seeded from one draw of ``generator`` (or of
    torch's global RNG when ``None``) mixed with the rank: identically seeded ranks do not draw
    identical (correlated) masks. With ``secure_mode`` they come from the OS CSPRNG.

    Args:
        total_size: number of records sampled from: the size of the whole data set, or
            ``len(indices)``.
        sample_rate: ``q``, the probability that a record is in a step's batch.
        shuffle: reshuffle the shard assignment every epoch.
        shuffle_seed: seed of the shard permutation (must be the same on every rank).
        generator: source of the sampling seed (see above).
        steps: steps per epoch (default ``1 / sample_rate``).
        num_replicas, rank: world size and rank (default: from ``torch.distributed``).
        secure_mode: draw the inclusion variables from the OS CSPRNG (no generator allowed).
        indices: the data set indices sampled from (distinct, ``total_size`` of them; ``None``:
            ``range(total_size)``).
    """

    def __init__(
        self,
        *,
        total_size: int,
        sample_rate: float,
        shuffle: bool = True,
        shuffle_seed: int = 0,
        generator: torch.Generator | None = None,
        steps: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        secure_mode: bool = False,
        indices: Sequence[int] | torch.Tensor | None = None,
    ):
        if isinstance(total_size, bool) or not isinstance(total_size, int) or total_size <= 0:
            raise ValueError(f"total_size must be a positive integer, got {total_size!r}")
        validate_sample_rate(sample_rate)
        check_secure_generator(secure_mode, generator)
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "DistributedUniformWithReplacementSampler needs torch.distributed to be "
                    "initialised, or explicit num_replicas and rank."
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if not (0 <= rank < num_replicas):
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.steps = resolve_steps(steps, sample_rate)
        self.total_size = total_size
        self.sample_rate = sample_rate
        self.shuffle = shuffle
        self.shuffle_seed = shuffle_seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.secure_mode = secure_mode
        self.generator = generator
        self.num_samples = len(range(rank, total_size, num_replicas))
        if indices is not None:
            indices = as_index_tensor(indices, size=total_size)
        self.indices = indices

    @property
    def generator(self) -> torch.Generator | None:
        """The generator this rank's sampling seed was drawn from; setting it re-seeds."""
        return self._generator

    @generator.setter
    def generator(self, generator: torch.Generator | None) -> None:
        self._generator = generator
        self.rank_generator = None if self.secure_mode else _rank_generator(generator, self.rank)

    def shard(self) -> torch.Tensor:
        """This rank's data set indices for the current epoch."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.shuffle_seed + self.epoch)
            positions = torch.randperm(self.total_size, generator=g)
        else:
            positions = torch.arange(self.total_size)
        positions = positions[self.rank :: self.num_replicas]
        return positions if self.indices is None else self.indices[positions]

    def __len__(self) -> int:
        return self.steps

    def sample_mask(self) -> torch.Tensor:
        """One step's inclusion mask over this rank's shard (independent Bernoulli(q))."""
        return poisson_mask(
            self.num_samples, self.sample_rate, self.rank_generator, self.secure_mode
        )

    def __iter__(self) -> Iterator[list[int]]:
        indices = self.shard()
        for _ in range(self.steps):
            yield indices[self.sample_mask()].tolist()
        self.epoch += 1

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch that seeds the shard permutation (call it on every rank)."""
        self.epoch = epoch
