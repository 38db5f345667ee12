"""Per-sample gradients of ``nn.GroupNorm``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .registry import register_grad_sampler


def per_channel_affine_grad_sample(
    weight: nn.Parameter | None,
    bias: nn.Parameter | None,
    x_hat: torch.Tensor,
    backprops: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a per-channel affine map ``y = x_hat * w[c] + b[c]``.

    Args:
        x_hat, backprops: ``(B, C, *spatial)``.

    Returns:
        ``{weight: (B, C), bias: (B, C)}`` for the parameters that require grad.
    """
    ret: dict[nn.Parameter, torch.Tensor] = {}
    spatial = tuple(range(2, backprops.dim()))
    if weight is not None and weight.requires_grad:
        prod = x_hat * backprops
        ret[weight] = prod.sum(dim=spatial) if spatial else prod
    if bias is not None and bias.requires_grad:
        ret[bias] = backprops.sum(dim=spatial) if spatial else backprops
    return ret


@register_grad_sampler(nn.GroupNorm)
def compute_group_norm_grad_sample(
    layer: nn.GroupNorm, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``GroupNorm``.

    Args:
        activations: ``[x]`` with ``x`` of shape ``(B, C, *spatial)``.
        backprops: same shape as ``x``.

    Returns:
        ``weight``, ``bias``: ``(B, C)``.
    """
    if not layer.affine:
        return {}
    x_hat = None
    if layer.weight.requires_grad:
        x_hat = F.group_norm(activations[0], layer.num_groups, eps=layer.eps)
    return per_channel_affine_grad_sample(layer.weight, layer.bias, x_hat, backprops)
