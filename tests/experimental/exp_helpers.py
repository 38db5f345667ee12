"""Helpers of the experimental-engine tests (small models, batching, accuracy)."""

from __future__ import annotations

import torch


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).double().mean().item()


def batches(n: int, batch_size: int, generator: torch.Generator):
    """Shuffled fixed-size batches (last partial batch dropped)."""
    perm = torch.randperm(n, generator=generator)
    for i in range(0, n - batch_size + 1, batch_size):
        yield perm[i : i + batch_size]


def mlp(seed: int, hidden: int = 32, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10)
    ).to(dtype)
