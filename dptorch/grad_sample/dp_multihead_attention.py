"""Grad sampler of :class:`dptorch.layers.dp_multihead_attention.SequenceBias`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..layers.dp_multihead_attention import SequenceBias
from .registry import register_grad_sampler


@register_grad_sampler(SequenceBias)
def compute_sequence_bias_grad_sample(
    layer: SequenceBias, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """The bias is the last step of the output: its gradient is ``backprops[:, -1]`` ``(B, E)``
    (``backprops`` ``(B, L + 1, E)``, batch first)."""
    if not layer.bias.requires_grad:
        return {}
    return {layer.bias: backprops[:, -1]}
