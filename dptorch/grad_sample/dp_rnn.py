"""Rule of :class:`dptorch.layers.dp_rnn.RNNLinear`: the one of ``nn.Linear``.

``DPRNN`` / ``DPGRU`` / ``DPLSTM`` call each ``RNNLinear`` once per forward on the whole
sequence ``(B, T, in)``, so its per-sample gradient, norms and clipped sum are ``nn.Linear``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..layers.dp_rnn import RNNLinear
from .linear import LINEAR_RULE, compute_linear_grad_sample
from .registry import register_layer_rule


def compute_rnn_linear_grad_sample(
    layer: RNNLinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of an ``RNNLinear``: those of ``nn.Linear``."""
    return compute_linear_grad_sample(layer, activations, backprops)


RNN_LINEAR_RULE = register_layer_rule(
    RNNLinear, replace(LINEAR_RULE, grad_sample=compute_rnn_linear_grad_sample)
)
