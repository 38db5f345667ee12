"""Small helpers shared by the DP optimizers."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

__all__ = ["params"]


def params(optimizer: Optimizer) -> list[nn.Parameter]:
    """The trainable parameters (``requires_grad``) of every param group of ``optimizer``, in
    order: the parameters a DP optimizer clips and noises."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
