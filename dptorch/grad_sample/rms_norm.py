"""Per-sample gradients of ``nn.RMSNorm``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layer_norm import elementwise_affine_grad_sample
from .registry import register_grad_sampler


@register_grad_sampler(nn.RMSNorm)
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
