"""Per-sample gradients of ``nn.LayerNorm``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.tensor_utils import sum_over_all_but_batch_and_last_n_dims
from .registry import register_grad_sampler


@register_grad_sampler(nn.LayerNorm)
def compute_layer_norm_grad_sample(
    layer: nn.LayerNorm, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``LayerNorm`` over the last ``k = len(normalized_shape)`` dims.

    Args:
        activations: ``[x]`` with ``x`` of shape ``(B, *middle, *normalized_shape)``.
        backprops: same shape as ``x``.

    Returns:
        ``weight``: ``sum_middle(backprops * x_hat)``; ``bias``: ``sum_middle(backprops)``; both
        ``(B, *normalized_shape)``, where ``x_hat`` is ``x`` normalised without the affine part.
    """
    ret: dict[nn.Parameter, torch.Tensor] = {}
    k = len(layer.normalized_shape)
    if layer.weight is not None and layer.weight.requires_grad:
        x_hat = F.layer_norm(activations[0], layer.normalized_shape, eps=layer.eps)
        ret[layer.weight] = sum_over_all_but_batch_and_last_n_dims(x_hat * backprops, k)
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = sum_over_all_but_batch_and_last_n_dims(backprops, k)
    return ret
