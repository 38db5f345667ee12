"""Poisson (uniform with replacement across steps) batch sampling for DP-SGD.

Every record joins every batch independently with probability ``sample_rate``: the batch size
is ``Binomial(num_samples, sample_rate)`` and batches of different steps are independent. This
is the sampling that the privacy amplification of DP-SGD accountants assumes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from ._poisson import (
    as_index_tensor,
    check_secure_generator,
    poisson_mask,
    resolve_steps,
    steps_for_sample_rate,
    validate_sample_rate,
)

__all__ = [
    "DistributedUniformWithReplacementSampler",
    "UniformWithReplacementSampler",
    "validate_sample_rate",
    "steps_for_sample_rate",
    "as_index_tensor",
]


class UniformWithReplacementSampler(Sampler[list[int]]):
    """Batch sampler yielding ``steps`` Poisson batches of indices in ``range(num_samples)``, or,
    with ``indices``, of entries of ``indices`` (a subset of the dataset: each of them joins each
    batch independently with probability ``sample_rate``, no other record ever does).

    Args:
        num_samples: number of records sampled from (> 0): the dataset size, or
            ``len(indices)``.
        sample_rate: probability ``q`` that each record joins each batch, in (0, 1].
        generator: ``torch.Generator`` for the inclusion draws (global RNG when ``None``).
        steps: number of batches per iteration (``len()``); defaults to ``1 / sample_rate``.
        secure_mode: draw the inclusion variables from the OS CSPRNG (no generator allowed).
        indices: the dataset indices sampled from (distinct; ``None``: ``range(num_samples)``).
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        generator: torch.Generator | None = None,
        steps: int | None = None,
        secure_mode: bool = False,
        indices: Sequence[int] | torch.Tensor | None = None,
    ):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(
                f"num_samples must be a positive integer, got {num_samples!r}: the dataset is empty."
            )
        validate_sample_rate(sample_rate)
        self.steps = resolve_steps(steps, sample_rate)
        check_secure_generator(secure_mode, generator)
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.generator = generator
        self.secure_mode = secure_mode
        self.indices = None if indices is None else as_index_tensor(indices, size=num_samples)

    def __len__(self) -> int:
        return self.steps

    def sample_mask(self) -> torch.Tensor:
        """One step's inclusion mask: ``num_samples`` independent Bernoulli(``sample_rate``)."""
        return poisson_mask(self.num_samples, self.sample_rate, self.generator, self.secure_mode)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            picked = self.sample_mask().nonzero().reshape(-1)
            yield (picked if self.indices is None else self.indices[picked]).tolist()


# the distributed variant lives in its own module (owned by the distributed-training code)
from .distributed_sampler import DistributedUniformWithReplacementSampler  # noqa: E402

__all__.append("DistributedUniformWithReplacementSampler")
