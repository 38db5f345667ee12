"""``nn.InstanceNorm1d`` / ``2d`` / ``3d`` with ``affine=True`` in every mode: its per-sample gradient, whose squared norm is taken from the
(small) instantiated gradient; the other modes use the generic paths."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .group_norm import per_channel_affine_grad_sample
from .norm_samplers import instantiated_norm_sq
from .registry import LayerRule, register_layer_rule


def compute_instance_norm_grad_sample(
    layer: nn.modules.instancenorm._InstanceNorm,
    activations: Sequence[torch.Tensor],
    backprops: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``InstanceNorm`` (statistics per sample and channel).

    Hooks only run in training mode, where the input's own statistics are used even with
    ``track_running_stats=True``, so the running buffers never enter the gradient.

    Args:
        activations: ``[x]`` with ``x`` of shape ``(B, C, *spatial)``.
        backprops: same shape as ``x``.

    Returns:
        ``weight``, ``bias``: ``(B, C)``.
    """
    if not layer.affine:
        return {}
    x = activations[0]
    if x.dim() != layer._get_no_batch_dim() + 1:
        raise ValueError(
            f"{type(layer).__name__} per-sample gradients need a batched input (B, C, *spatial), "
            f"got shape {tuple(x.shape)}"
        )
    return per_channel_affine_grad_sample(
        layer, lambda: F.instance_norm(x, eps=layer.eps), backprops
    )


INSTANCE_NORM_RULE = register_layer_rule(
    [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d],
    LayerRule(
        grad_sample=compute_instance_norm_grad_sample,
        norm_sq=instantiated_norm_sq(compute_instance_norm_grad_sample),
        generic={
            "clipped_sum": "recomputing the affine map and one vector-Jacobian product is cheap",
            "input_grad_only": "autograd's weight gradient is zeroed by a tensor hook",
            "prefer_ghost": "the (B, C) per-sample gradient is the cheapest exact norm",
        },
    ),
)
