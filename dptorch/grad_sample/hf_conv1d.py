"""Hugging Face's ``Conv1D`` (GPT-2's projections) in every mode, without importing transformers.

``Conv1D(nf, nx)`` is a Linear with its weight stored transposed: ``y = x W + b`` with ``W``
``(nx, nf)``, on ``(B, ..., nx)``. Its rule is registered under the qualified type name, so it
applies as soon as a model holding one is wrapped:

* per-sample gradient: ``W[b] = Σ_t a_{bt} g_{bt}ᵀ`` ``(B, nx, nf)``, ``bias[b] = Σ_t g_{bt}``;
* squared norm: ghost (Gram matrices) or instantiated, whichever is cheaper (as Linear);
* clipped sum: ``Σ_{b,t} a_{bt} g_{bt}ᵀ`` with the clip-scaled ``g``;
* bk forward: ``x W + b`` whose backward returns the input gradient only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..utils import gemm
from .linear import _gram_norms
from .norm_samplers import (
    Factors,
    ParamDict,
    clip_weighted_pair,
    ghost_is_cheaper,
    position_sum,
    positions,
    sq_norms,
    sq_sum,
    wants_grad,
)
from .registry import LayerRule, pairs_with, register_layer_rule

CONV1D = "transformers.pytorch_utils.Conv1D"


def _flat(layer: nn.Module, activations: Sequence[torch.Tensor], backprops: torch.Tensor):
    """``(a, g)`` as ``(B, T, nx)``, ``(B, T, nf)``."""
    b = backprops.shape[0]
    t = positions(backprops)
    return activations[0].reshape(b, t, layer.nx), backprops.reshape(b, t, layer.nf)


def compute_conv1d_grad_sample(
    layer: nn.Module, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``weight``: ``(B, nx, nf)``; ``bias``: ``(B, nf)``."""
    a, g = _flat(layer, activations, backprops)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = gemm.bmm_nt(a.transpose(1, 2), g.transpose(1, 2))
    if wants_grad(layer.bias):
        ret[layer.bias] = g.sum(1)
    return ret


def compute_conv1d_norm_sq_sample(
    layer: nn.Module, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms ``{param: (B,)}`` (the weight's by Gram matrices if cheaper)."""
    a, g = _flat(layer, activations, backprops)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        if ghost_is_cheaper(a.shape[1], layer.nx, layer.nf):
            ret[layer.weight] = _gram_norms(a, g)
        else:
            ret[layer.weight] = sq_norms(gemm.bmm_nt(a.transpose(1, 2), g.transpose(1, 2)))
    if wants_grad(layer.bias):
        ret[layer.bias] = sq_sum(position_sum(g), 1)
    return ret


def conv1d_clipped_sum(
    layer: nn.Module, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``weight``: ``Σ_{b,t} a_{bt} g_{bt}ᵀ`` (one matmul); ``bias``: ``Σ_{b,t} g_{bt}``."""
    a = activations[0].reshape(-1, layer.nx)
    g = backprops.reshape(-1, layer.nf)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = gemm.mm_tn(a, g)
    if wants_grad(layer.bias):
        ret[layer.bias] = g.sum(0)
    return ret


@pairs_with("clipped_sum", conv1d_clipped_sum)
def conv1d_weighted_clipped_sum(
    layer: nn.Module, activations: Sequence[torch.Tensor], backprops: torch.Tensor, c: torch.Tensor
) -> ParamDict:
    """``weight``: ``Σ_{b,t} c_b a_{bt} g_{bt}ᵀ``, one matmul with ``c`` applied to the smaller
    of ``A`` and ``G``; ``bias``: ``Σ_b c_b Σ_t g_{bt}``."""
    a, g = _flat(layer, activations, backprops)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        ac, gc = clip_weighted_pair(a, g, c)
        ret[layer.weight] = gemm.mm_tn(ac.reshape(-1, layer.nx), gc.reshape(-1, layer.nf))
    if wants_grad(layer.bias):
        ret[layer.bias] = c.matmul(position_sum(g))
    return ret


@pairs_with("norm_sq", compute_conv1d_norm_sq_sample)
def conv1d_factors(
    layer: nn.Module, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, Factors]:
    """``weight``: ``Σ_t a_t g_tᵀ``; ``bias``: ``Σ_t g_t · 1`` (a tied use, see :class:`Factors`)."""
    a, g = _flat(layer, activations, backprops)
    ret = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = Factors(u=a, v=g)
    if wants_grad(layer.bias):
        ret[layer.bias] = Factors(u=g, v=g.new_ones(*g.shape[:2], 1))
    return ret


class _Conv1DInputGradOnly(torch.autograd.Function):
    """``x W + b`` whose backward returns only ``∂L/∂x = G Wᵀ``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(
            *x.shape[:-1], weight.shape[1]
        )

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        gx = g.matmul(weight.to(g.dtype).t()) if ctx.needs_input_grad[0] else None
        return gx, None, None


def conv1d_input_grad_only(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, with autograd computing ``∂L/∂x`` only."""
    return _Conv1DInputGradOnly.apply(x, layer.weight, layer.bias)


def conv1d_prefers_ghost(layer: nn.Module, activations: Sequence, backprops: torch.Tensor) -> bool:
    """Ghost beats instantiation for ``T`` positions when ``T(nx + nf) < nx·nf``."""
    return ghost_is_cheaper(positions(backprops), layer.nx, layer.nf)


CONV1D_RULE = register_layer_rule(
    CONV1D,
    LayerRule(
        grad_sample=compute_conv1d_grad_sample,
        norm_sq=compute_conv1d_norm_sq_sample,
        clipped_sum=conv1d_clipped_sum,
        input_grad_only=conv1d_input_grad_only,
        prefer_ghost=conv1d_prefers_ghost,
        factors=conv1d_factors,
        weighted_clipped_sum=conv1d_weighted_clipped_sum,
    ),
)
