"""Small models, data and reference computations shared by the engine tests."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyNet(nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 5, d_out: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_data(n: int = 64, d_in: int = 6, d_out: int = 3, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    w = torch.randn(d_in, d_out, generator=g, dtype=dtype)
    y = (x @ w).argmax(1)
    return TensorDataset(x, y)


def make_loader(ds, batch_size: int = 8, **kw) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, **kw)


def set_grad_samples(params, grad_samples) -> None:
    """Gives each parameter a hand-made per-sample gradient (and a matching .grad)."""
    for p, gs in zip(params, grad_samples):
        p.grad_sample = gs.clone()
        p.grad = gs.sum(0)


def reference_flat_clip(grad_samples: list[np.ndarray], c: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per-sample factors min(1, C / (‖g‖ + 1e-6)) and Σ_b factor_b g_b, in float64 numpy."""
    b = grad_samples[0].shape[0]
    flat = np.concatenate([g.reshape(b, -1) for g in grad_samples], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    factors = np.minimum(1.0, c / (norms + 1e-6))
    sums = [np.tensordot(factors, g, axes=(0, 0)) for g in grad_samples]
    return factors, sums


def chi2_variance_bounds(n: int, alpha: float = 1e-3) -> tuple[float, float]:
    """Two-sided bounds for s²/σ² of n i.i.d. normals at level alpha."""
    from scipy.stats import chi2

    return chi2.ppf(alpha / 2, n - 1) / (n - 1), chi2.ppf(1 - alpha / 2, n - 1) / (n - 1)
