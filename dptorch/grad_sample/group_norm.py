"""``nn.GroupNorm`` in every mode: its per-sample gradient, whose squared norm is taken from the
(small) instantiated gradient; the other modes use the generic paths."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .norm_samplers import instantiated_norm_sq
from .registry import LayerRule, register_layer_rule


def per_channel_affine_grad_sample(
    layer: nn.Module,
    normalize: Callable[[], torch.Tensor],
    backprops: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of the per-channel affine map ``y = x_hat * w[c] + b[c]`` that ends a
    normalisation layer with ``affine`` parameters ``layer.weight`` / ``layer.bias``.

    Args:
        normalize: returns ``x_hat`` ``(B, C, *spatial)``, the input normalised without the
            affine part; called only when the weight needs its per-sample gradient.
        backprops: ``(B, C, *spatial)``.

    Returns:
        ``{weight: (B, C), bias: (B, C)}`` for the parameters that require grad (empty without
        ``affine``).
    """
    ret: dict[nn.Parameter, torch.Tensor] = {}
    if not layer.affine:
        return ret
    spatial = tuple(range(2, backprops.dim()))
    if layer.weight.requires_grad:
        prod = normalize() * backprops
        ret[layer.weight] = prod.sum(dim=spatial) if spatial else prod
    if layer.bias.requires_grad:
        ret[layer.bias] = backprops.sum(dim=spatial) if spatial else backprops
    return ret


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
    return per_channel_affine_grad_sample(
        layer, lambda: F.group_norm(activations[0], layer.num_groups, eps=layer.eps), backprops
    )


GROUP_NORM_RULE = register_layer_rule(
    nn.GroupNorm,
    LayerRule(
        grad_sample=compute_group_norm_grad_sample,
        norm_sq=instantiated_norm_sq(compute_group_norm_grad_sample),
        generic={
            "clipped_sum": "recomputing the affine map and one vector-Jacobian product is cheap",
            "input_grad_only": "autograd's weight gradient is zeroed by a tensor hook",
            "prefer_ghost": "the (B, C) per-sample gradient is the cheapest exact norm",
        },
    ),
)
