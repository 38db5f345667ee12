"""Per-sample gradients of ``nn.RMSNorm``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.tensor_utils import sum_over_all_but_batch_and_last_n_dims
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
    if layer.weight is None or not layer.weight.requires_grad:
        return {}
    x_hat = F.rms_norm(activations[0], layer.normalized_shape, eps=layer.eps)
    k = len(layer.normalized_shape)
    return {layer.weight: sum_over_all_but_batch_and_last_n_dims(x_hat * backprops, k)}
