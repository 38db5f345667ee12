"""Poisson (uniform with replacement across steps) batch sampling for DP-SGD.

Every record joins every batch independently with probability ``sample_rate``: the batch size
is ``Binomial(num_samples, sample_rate)`` and batches of different steps are independent. This
is the sampling that the privacy amplification of DP-SGD accountants assumes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from .randomness import secure_uniform

__all__ = [
    "DistributedUniformWithReplacementSampler",
    "UniformWithReplacementSampler",
    "validate_sample_rate",
    "steps_for_sample_rate",
]


def validate_sample_rate(sample_rate: float) -> None:
    """Raises ``ValueError`` unless ``0 < sample_rate <= 1``."""
    if (
        isinstance(sample_rate, bool)
        or not isinstance(sample_rate, (int, float))
        or not math.isfinite(sample_rate)
        or not (0 < sample_rate <= 1)
    ):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}. It is the probability that a "
            "record joins a batch, 1 / len(data_loader) for a loader built from batch_size."
        )


def steps_for_sample_rate(sample_rate: float) -> int:
    """Default number of steps per epoch, ``1 / sample_rate`` (robust to float round-off:
    ``1 / (1 / 49)`` is ``49.000000000000004``, and ``1 / 0.1`` must give 10, not 9)."""
    inv = 1.0 / sample_rate
    nearest = round(inv)
    return max(1, int(nearest) if abs(inv - nearest) < 1e-9 * max(1.0, inv) else int(inv))


class UniformWithReplacementSampler(Sampler[list[int]]):
    """Batch sampler yielding ``steps`` Poisson batches of indices in ``range(num_samples)``.

    Args:
        num_samples: dataset size (> 0).
        sample_rate: probability ``q`` that each record joins each batch, in (0, 1].
        generator: ``torch.Generator`` for the inclusion draws (global RNG when ``None``).
        steps: number of batches per iteration (``len()``); defaults to ``1 / sample_rate``.
        secure_mode: draw the inclusion variables from the OS CSPRNG (no generator allowed).
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        generator: torch.Generator | None = None,
        steps: int | None = None,
        secure_mode: bool = False,
    ):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(
                f"num_samples must be a positive integer, got {num_samples!r}: the dataset is empty."
            )
        validate_sample_rate(sample_rate)
        if steps is not None and (not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
        if secure_mode and generator is not None:
            raise ValueError(
                "secure_mode draws batches from the OS CSPRNG and cannot take a seeded generator; "
                "pass generator=None."
            )
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.generator = generator
        self.secure_mode = secure_mode
        self.steps = steps if steps is not None else steps_for_sample_rate(sample_rate)

    def __len__(self) -> int:
        return self.steps

    def sample_mask(self) -> torch.Tensor:
        """One step's inclusion mask: ``num_samples`` independent Bernoulli(``sample_rate``)."""
        if self.secure_mode:
            u = secure_uniform((self.num_samples,))
        else:
            u = torch.rand(self.num_samples, generator=self.generator, dtype=torch.float64)
        return u < self.sample_rate

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            yield self.sample_mask().nonzero().reshape(-1).tolist()


# the distributed variant lives in its own module (owned by the distributed-training code)
from .distributed_sampler import DistributedUniformWithReplacementSampler  # noqa: E402

__all__.append("DistributedUniformWithReplacementSampler")
