"""Per-sample gradients of ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``.

Every stride, dilation, group count, ``padding`` (ints, ``"valid"``, ``"same"``) and
``padding_mode`` (zeros, reflect, replicate, circular) is supported. The input is unfolded into
its receptive fields (im2col) and each group's weight gradient is one batched matrix product::

    cols = unfold(x)                                  # (B, C_in * K, L)
    grad_sample[b] = backprops[b] @ cols[b]^T         # (B, C_out, C_in / groups * K)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.tensor_utils import unfold_nd
from .registry import register_grad_sampler


def _padded_input(layer: nn.modules.conv._ConvNd, x: torch.Tensor):
    """Returns ``(x, padding)`` such that ``conv(x, padding=padding)`` equals ``layer(x)``.

    Non-zero padding modes and string padding (``"same"`` can be asymmetric) are applied
    explicitly, exactly as the layer's forward pads; symmetric zero padding is left to unfold.
    """
    if layer.padding_mode == "zeros":
        if layer.padding == "valid":
            return x, 0
        if not isinstance(layer.padding, str):
            return x, layer.padding
        return F.pad(x, layer._reversed_padding_repeated_twice), 0
    return F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode), 0


@register_grad_sampler([nn.Conv1d, nn.Conv2d, nn.Conv3d])
def compute_conv_grad_sample(
    layer: nn.modules.conv._ConvNd,
    activations: Sequence[torch.Tensor],
    backprops: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a convolution.

    Args:
        layer: the ``ConvNd`` layer (``n`` = 1, 2 or 3 spatial dims).
        activations: ``[x]`` with ``x`` of shape ``(B, C_in, *spatial_in)``.
        backprops: ``(B, C_out, *spatial_out)``, the gradient of the loss w.r.t. the output.

    Returns:
        ``weight``: ``(B, C_out, C_in / groups, *kernel_size)``; ``bias``: ``(B, C_out)``.
    """
    x = activations[0]
    n = len(layer.kernel_size)
    if x.dim() != n + 2:
        raise ValueError(
            f"{type(layer).__name__} per-sample gradients need a batched input (B, C, *spatial) "
            f"with {n} spatial dims, got shape {tuple(x.shape)}. Add the batch dimension "
            "(x.unsqueeze(0)), and pass batch_first=True."
        )
    batch_size = backprops.shape[0]
    c_out = layer.out_channels
    n_out = 1
    for s in backprops.shape[2:]:
        n_out *= s
    g = backprops.reshape(batch_size, c_out, n_out)
    ret: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        x, padding = _padded_input(layer, x)
        cols = unfold_nd(
            x, layer.kernel_size, padding=padding, stride=layer.stride, dilation=layer.dilation
        )  # (B, C_in * K, L)
        groups = layer.groups
        if groups == 1:
            gs = torch.bmm(g, cols.transpose(1, 2))
        else:
            gs = torch.einsum(
                "bgol,bgil->bgoi",
                g.view(batch_size, groups, c_out // groups, n_out),
                cols.view(batch_size, groups, cols.shape[1] // groups, n_out),
            )
        ret[layer.weight] = gs.reshape(batch_size, *layer.weight.shape)
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = g.sum(dim=2)
    return ret
