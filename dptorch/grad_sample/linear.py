"""Per-sample gradients of ``nn.Linear`` for inputs of any rank ``(B, ..., d_in)``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .registry import register_grad_sampler


@register_grad_sampler(nn.Linear)
def compute_linear_grad_sample(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``weight``: ``sum_t g[b,t,:]^T a[b,t,:]`` -> ``(B, d_out, d_in)``; ``bias``: ``sum_t g[b,t,:]``."""
    a = activations[0]
    ret = {}
    if layer.weight.requires_grad:
        if a.dim() == 2:
            gs = torch.einsum("bo,bi->boi", backprops, a)
        else:
            gs = torch.einsum("b...o,b...i->boi", backprops, a)
        ret[layer.weight] = gs
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = backprops if backprops.dim() == 2 else backprops.flatten(1, -2).sum(1)
    return ret


def compute_linear_norm_sample(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms (not squared) of ``nn.Linear``, ``{param: (B,)}`` (Opacus
    API); computed by the ghost-norm sampler of :mod:`dptorch.grad_sample.norm_samplers`."""
    from .norm_samplers import compute_linear_norm_sq_sample, sample_norms

    return sample_norms(compute_linear_norm_sq_sample(layer, activations, backprops))
