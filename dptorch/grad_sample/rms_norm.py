"""``nn.RMSNorm`` in every mode: its per-sample gradient, whose squared norm is taken from the
(small) instantiated gradient; the other modes use the generic paths."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layer_norm import elementwise_affine_grad_sample
from .norm_samplers import instantiated_norm_sq
from .registry import LayerRule, register_layer_rule


def compute_rms_norm_grad_sample(
    layer: nn.RMSNorm, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient of ``RMSNorm`` (``y = x / rms(x) * weight``).

    Args:
        activations: ``[x]`` with ``x`` of shape ``(B, *middle, *normalized_shape)``.
        backprops: same shape as ``x``.

    Returns:
        ``weight``: ``sum_middle(backprops * x / rms(x))`` of shape ``(B, *normalized_shape)``
        (``eps=None`` means ``torch.finfo(x.dtype).eps``, as in PyTorch).
    """
    return elementwise_affine_grad_sample(
        layer.weight,
        None,
        lambda: F.rms_norm(activations[0], layer.normalized_shape, eps=layer.eps),
        backprops,
        len(layer.normalized_shape),
    )


RMS_NORM_RULE = register_layer_rule(
    nn.RMSNorm,
    LayerRule(
        grad_sample=compute_rms_norm_grad_sample,
        norm_sq=instantiated_norm_sq(compute_rms_norm_grad_sample),
        generic={
            "clipped_sum": "recomputing the affine map and one vector-Jacobian product is cheap",
            "input_grad_only": "autograd's weight gradient is zeroed by a tensor hook",
            "prefer_ghost": "the (B, C) per-sample gradient is the cheapest exact norm",
        },
    ),
)
