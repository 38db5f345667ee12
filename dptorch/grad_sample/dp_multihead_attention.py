"""Rule of :class:`dptorch.layers.dp_multihead_attention.SequenceBias`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..layers.dp_multihead_attention import SequenceBias
from .norm_samplers import instantiated_norm_sq
from .registry import LayerRule, register_layer_rule


def compute_sequence_bias_grad_sample(
    layer: SequenceBias, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """The bias is the last step of the output: its gradient is ``backprops[:, -1]`` ``(B, E)``
    (``backprops`` ``(B, L + 1, E)``, batch first)."""
    if not layer.bias.requires_grad:
        return {}
    return {layer.bias: backprops[:, -1]}


SEQUENCE_BIAS_RULE = register_layer_rule(
    SequenceBias,
    LayerRule(
        grad_sample=compute_sequence_bias_grad_sample,
        norm_sq=instantiated_norm_sq(compute_sequence_bias_grad_sample),
        generic={
            "clipped_sum": "recomputing the concatenation and one vector-Jacobian product is cheap",
            "input_grad_only": "autograd's bias gradient is zeroed by a tensor hook",
            "prefer_ghost": "the (B, E) per-sample gradient is the cheapest exact norm",
        },
    ),
)
