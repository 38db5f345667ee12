"""Noise and sampling randomness, optionally from the operating system's CSPRNG (secure mode).

Secure mode draws every random number from ``os.urandom`` (the kernel CSPRNG), so no seed can
reproduce or predict it. It does not protect against floating-point attacks on the Gaussian
sampler (Mironov 2012); see docs/privacy.md.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

_TWO_POW_53 = float(2**53)


def secure_uniform(shape: tuple[int, ...] | torch.Size, dtype=torch.float64) -> torch.Tensor:
    """Uniform samples in (0, 1) of ``shape`` from ``os.urandom`` (53 random bits each)."""
    n = math.prod(shape)
    raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    u = (raw.astype(np.float64) + 0.5) / _TWO_POW_53
    return torch.from_numpy(u).reshape(tuple(shape)).to(dtype)


def secure_normal(
    shape: tuple[int, ...] | torch.Size, std: float, dtype=torch.float32, device=None
) -> torch.Tensor:
    """``N(0, std²)`` samples of ``shape`` from ``os.urandom`` through the Box-Muller transform."""
    n = math.prod(shape)
    m = (n + 1) // 2
    u = secure_uniform((2, m))
    r = torch.sqrt(-2.0 * torch.log(u[0]))
    theta = 2.0 * math.pi * u[1]
    z = torch.cat([r * torch.cos(theta), r * torch.sin(theta)])[:n]
    return (std * z).reshape(tuple(shape)).to(dtype=dtype, device=device)


def secure_generator_seed() -> int:
    """A 63-bit seed from the OS CSPRNG."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def generate_noise(
    std: float,
    reference: torch.Tensor,
    generator: torch.Generator | None = None,
    secure_mode: bool = False,
) -> torch.Tensor:
    """Gaussian noise ``N(0, std²)`` with the shape, dtype and device of ``reference``."""
    if std == 0:
        return torch.zeros_like(reference)
    if secure_mode:
        return secure_normal(reference.shape, std, dtype=reference.dtype, device=reference.device)
    return torch.normal(
        mean=0.0, std=std, size=reference.shape, dtype=reference.dtype, device=reference.device,
        generator=generator,
    )
