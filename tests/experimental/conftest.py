"""Shared fixtures of the experimental-engine tests: the scikit-learn digits task."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="session")
def digits():
    """``(x_train, y_train, x_test, y_test)`` float32 tensors; pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    x, y = x[perm], y[perm]
    return x[:1500], y[:1500], x[1500:], y[1500:]
