"""``nn.Bilinear`` in every mode: ``y_o = Σ_ij x1_i W_oij x2_j + b_o`` on ``(B, ..., d1)``,
``(B, ..., d2)`` inputs, applied at ``T`` positions per sample.

* per-sample gradient: ``W[b] = Σ_t g_bt ⊗ x1_bt ⊗ x2_bt`` ``(B, out, d1, d2)``, ``b[b] = Σ_t g_bt``;
* squared norm: ghost, ``Σ_{t,s} (g_t·g_s)(x1_t·x1_s)(x2_t·x2_s)`` (three ``T × T`` Grams), or
  instantiated, whichever is cheaper;
* clipped sum: the same contraction over ``b`` and ``t`` at once, with the clip-scaled ``g``;
* bk forward: ``F.bilinear`` whose backward returns the two input gradients only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .norm_samplers import ParamDict, position_sum, positions, sq_norms, sq_sum, wants_grad
from .registry import LayerRule, register_layer_rule


def _flat(layer: nn.Bilinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor):
    """``(x1, x2, g)`` reshaped to ``(B, T, d1)``, ``(B, T, d2)``, ``(B, T, out)``."""
    b = backprops.shape[0]
    t = positions(backprops)
    x1, x2 = activations[0], activations[1]
    return (
        x1.reshape(b, t, layer.in1_features),
        x2.reshape(b, t, layer.in2_features),
        backprops.reshape(b, t, layer.out_features),
    )


def compute_bilinear_grad_sample(
    layer: nn.Bilinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``weight``: ``(B, out, d1, d2)``; ``bias``: ``(B, out)``."""
    x1, x2, g = _flat(layer, activations, backprops)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = torch.einsum("bto,bti,btj->boij", g, x1, x2)
    if wants_grad(layer.bias):
        ret[layer.bias] = g.sum(1)
    return ret


def _ghost_is_cheaper(t: int, layer: nn.Bilinear) -> bool:
    d1, d2, o = layer.in1_features, layer.in2_features, layer.out_features
    return t == 1 or t * (d1 + d2 + o) < d1 * d2 * o


def compute_bilinear_norm_sq_sample(
    layer: nn.Bilinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms ``{param: (B,)}``; the weight's from three ``T × T`` Gram
    matrices when that is cheaper than the ``(out, d1, d2)`` gradient."""
    x1, x2, g = _flat(layer, activations, backprops)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        if _ghost_is_cheaper(g.shape[1], layer):
            grams = [torch.bmm(z, z.transpose(1, 2)) for z in (g, x1, x2)]
            ret[layer.weight] = (grams[0] * grams[1] * grams[2]).sum((1, 2))
        else:
            ret[layer.weight] = sq_norms(torch.einsum("bto,bti,btj->boij", g, x1, x2))
    if wants_grad(layer.bias):
        ret[layer.bias] = sq_sum(position_sum(g), 1)
    return ret


def bilinear_clipped_sum(
    layer: nn.Bilinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``{weight: Σ_{b,t} g ⊗ x1 ⊗ x2, bias: Σ_{b,t} g}`` for the given (clip-scaled) ``g``."""
    x1, x2, g = _flat(layer, activations, backprops)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = torch.einsum("bto,bti,btj->oij", g, x1, x2)
    if wants_grad(layer.bias):
        ret[layer.bias] = g.sum((0, 1))
    return ret


class _BilinearInputGradOnly(torch.autograd.Function):
    """``F.bilinear(x1, x2, w, b)`` whose backward returns only ``∂L/∂x1`` and ``∂L/∂x2``."""

    @staticmethod
    def forward(ctx, x1, x2, weight, bias):
        ctx.save_for_backward(x1, x2, weight)
        return F.bilinear(x1, x2, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x1, x2, weight = ctx.saved_tensors
        w = weight.to(g.dtype)
        gx1 = torch.einsum("...o,oij,...j->...i", g, w, x2) if ctx.needs_input_grad[0] else None
        gx2 = torch.einsum("...o,oij,...i->...j", g, w, x1) if ctx.needs_input_grad[1] else None
        return gx1, gx2, None, None


def bilinear_input_grad_only(layer: nn.Bilinear, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``layer(x1, x2)``, with autograd computing the input gradients only."""
    return _BilinearInputGradOnly.apply(x1, x2, layer.weight, layer.bias)


def bilinear_prefers_ghost(
    layer: nn.Bilinear, activations: Sequence, backprops: torch.Tensor
) -> bool:
    """Ghost beats instantiation when ``T(d1 + d2 + out) < d1·d2·out``."""
    return _ghost_is_cheaper(positions(backprops), layer)


BILINEAR_RULE = register_layer_rule(
    nn.Bilinear,
    LayerRule(
        grad_sample=compute_bilinear_grad_sample,
        norm_sq=compute_bilinear_norm_sq_sample,
        clipped_sum=bilinear_clipped_sum,
        input_grad_only=bilinear_input_grad_only,
        prefer_ghost=bilinear_prefers_ghost,
    ),
)
