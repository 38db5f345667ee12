"""Grad sampler of :class:`dptorch.layers.dp_rnn.RNNLinear`: the one of ``nn.Linear``.

``DPRNN`` / ``DPGRU`` / ``DPLSTM`` call each ``RNNLinear`` once per forward on the whole
sequence ``(B, T, in)``, so its per-sample gradient is ``nn.Linear``'s (summed over ``T``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..layers.dp_rnn import RNNLinear
from .linear import compute_linear_grad_sample
from .registry import register_grad_sampler


@register_grad_sampler(RNNLinear)
def compute_rnn_linear_grad_sample(
    layer: RNNLinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of an ``RNNLinear``: those of ``nn.Linear``."""
    return compute_linear_grad_sample(layer, activations, backprops)
