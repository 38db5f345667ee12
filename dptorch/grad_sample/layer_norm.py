"""``nn.LayerNorm`` in every mode: its per-sample gradient, whose squared norm is taken from the
(small) instantiated gradient; the other modes use the generic paths."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.tensor_utils import sum_over_all_but_batch_and_last_n_dims
from .norm_samplers import instantiated_norm_sq
from .registry import LayerRule, register_layer_rule


def elementwise_affine_grad_sample(
    weight: nn.Parameter | None,
    bias: nn.Parameter | None,
    normalize: Callable[[], torch.Tensor],
    backprops: torch.Tensor,
    n_dims: int,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of the element-wise affine map ``y = x_hat * weight + bias`` over the
    last ``n_dims`` dimensions that ends ``LayerNorm`` / ``RMSNorm``.

    Args:
        normalize: returns ``x_hat`` (shape of ``backprops``), the input normalised without the
            affine part; called only when ``weight`` needs its per-sample gradient.
        backprops: ``(B, *middle, *normalized_shape)``.

    Returns:
        ``weight``: ``sum_middle(backprops * x_hat)``; ``bias``: ``sum_middle(backprops)``; both
        ``(B, *normalized_shape)``, for the parameters that exist and require grad.
    """
    ret: dict[nn.Parameter, torch.Tensor] = {}
    if weight is not None and weight.requires_grad:
        ret[weight] = sum_over_all_but_batch_and_last_n_dims(normalize() * backprops, n_dims)
    if bias is not None and bias.requires_grad:
        ret[bias] = sum_over_all_but_batch_and_last_n_dims(backprops, n_dims)
    return ret


def compute_layer_norm_grad_sample(
    layer: nn.LayerNorm, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``LayerNorm`` over the last ``k = len(normalized_shape)`` dims.

    Args:
        activations: ``[x]`` with ``x`` of shape ``(B, *middle, *normalized_shape)``.
        backprops: same shape as ``x``.

    Returns:
        ``weight``, ``bias``: ``(B, *normalized_shape)`` (see
        :func:`elementwise_affine_grad_sample`).
    """
    return elementwise_affine_grad_sample(
        layer.weight,
        layer.bias,
        lambda: F.layer_norm(activations[0], layer.normalized_shape, eps=layer.eps),
        backprops,
        len(layer.normalized_shape),
    )


LAYER_NORM_RULE = register_layer_rule(
    nn.LayerNorm,
    LayerRule(
        grad_sample=compute_layer_norm_grad_sample,
        norm_sq=instantiated_norm_sq(compute_layer_norm_grad_sample),
        generic={
            "clipped_sum": "recomputing the affine map and one vector-Jacobian product is cheap",
            "input_grad_only": "autograd's weight gradient is zeroed by a tensor hook",
            "prefer_ghost": "the (B, C) per-sample gradient is the cheapest exact norm",
        },
    ),
)
