"""Poisson-sampling helpers shared by the single-process and the distributed batch samplers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .randomness import secure_uniform


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


def robust_floor(x: float) -> int:
    """``floor(x)``, except that an ``x`` within float round-off of an integer is that integer
    (``3 / (1 / 75)`` is ``224.99999999999997``: 225 steps, as the loader runs)."""
    nearest = round(x)
    return int(nearest) if abs(x - nearest) < 1e-9 * max(1.0, abs(x)) else math.floor(x)


def steps_for_sample_rate(sample_rate: float) -> int:
    """Default number of steps per epoch, ``1 / sample_rate`` (robust to float round-off:
    ``1 / (1 / 49)`` is ``49.000000000000004``, and ``1 / 0.1`` must give 10, not 9)."""
    return max(1, robust_floor(1.0 / sample_rate))


def resolve_steps(steps: int | None, sample_rate: float) -> int:
    """``steps`` (checked) or, when ``None``, :func:`steps_for_sample_rate`."""
    if steps is not None and (not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
    return steps if steps is not None else steps_for_sample_rate(sample_rate)


def check_secure_generator(secure_mode: bool, generator: torch.Generator | None) -> None:
    """Secure mode draws from the OS CSPRNG: a seeded generator is refused."""
    if secure_mode and generator is not None:
        raise ValueError(
            "secure_mode draws batches from the OS CSPRNG and cannot take a seeded generator; "
            "pass generator=None."
        )


def poisson_mask(
    num_samples: int, sample_rate: float, generator: torch.Generator | None, secure_mode: bool
) -> torch.Tensor:
    """One step's inclusion mask: ``num_samples`` independent Bernoulli(``sample_rate``), drawn
    from ``generator`` (global RNG when ``None``) or, with ``secure_mode``, the OS CSPRNG."""
    if secure_mode:
        u = secure_uniform((num_samples,))
    else:
        u = torch.rand(num_samples, generator=generator, dtype=torch.float64)
    return u < sample_rate


def as_index_tensor(
    indices: Sequence[int] | torch.Tensor, *, size: int, name: str = "indices"
) -> torch.Tensor:
    """``indices`` as a 1-D ``torch.long`` tensor, checked to be ``size`` distinct integers.

    A record listed twice would be included twice in a Poisson batch, doubling its influence on
    the gradient (the accountant assumes each record's inclusion is one Bernoulli draw):
    duplicates raise ``ValueError``, as do non-integer values and a length other than ``size``.
    """
    if isinstance(indices, torch.Tensor):
        t = indices.detach().cpu().reshape(-1)
    else:
        values = list(indices)
        if any(isinstance(i, bool) for i in values):
            raise ValueError(f"{name} must be integers, got booleans in {type(indices).__name__}.")
        t = torch.as_tensor(values) if values else torch.zeros(0, dtype=torch.long)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be integers, got values of dtype {t.dtype}.")
    t = t.to(torch.long)
    if t.numel() != size:
        raise ValueError(
            f"{name}: {t.numel()} entries, but the sampler's size is {size}; it must be "
            "len(indices)."
        )
    values, counts = t.unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{name} contain some records more than once (e.g. {values[counts > 1][:5].tolist()}):"
            " Poisson sampling would put such a record several times in one batch, which the "
            "privacy accounting does not allow. Remove the duplicates."
        )
    return t
