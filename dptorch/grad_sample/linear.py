"""``nn.Linear`` in every mode, for inputs of any rank ``(B, ..., d_in)``.

* per-sample gradient: ``weight[b] = Σ_t g_{bt} a_{bt}ᵀ``, ``bias[b] = Σ_t g_{bt}``;
* squared norm: ghost (two ``T × T`` Gram matrices) or instantiated, whichever is cheaper;
* clipped sum: ``Σ_{b,t} g_{bt} a_{bt}ᵀ`` (one matmul) with the clip-scaled ``g``;
* bk forward: ``F.linear`` whose backward returns the input gradient only.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import gemm
from .norm_samplers import (
    Factors,
    ParamDict,
    clip_weighted_pair,
    ghost_is_cheaper,
    gram,
    norm_product_sq,
    position_sum,
    positions,
    sample_norms,
    sq_norms,
    sq_sum,
    wants_grad,
)
from .registry import LayerRule, pairs_with, register_layer_rule


def compute_linear_grad_sample(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``weight``: ``sum_t g[b,t,:]^T a[b,t,:]`` -> ``(B, d_out, d_in)``; ``bias``: ``sum_t g[b,t,:]``."""
    a = activations[0]
    ret = {}
    if layer.weight.requires_grad:
        if a.dim() == 2:
            gs = torch.einsum("bo,bi->boi", backprops, a)
        else:
            b, t = backprops.shape[0], positions(a)
            g3 = backprops.reshape(b, t, backprops.shape[-1])
            gs = gemm.bmm_nt(g3.transpose(1, 2), a.reshape(b, t, a.shape[-1]).transpose(1, 2))
        ret[layer.weight] = gs
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = backprops if backprops.dim() == 2 else backprops.flatten(1, -2).sum(1)
    return ret


#: ``(output gradient, its version, its Gram)`` of the last ghost norm: layers fed the same
#: output-gradient tensor (a recurrent cell's input and hidden projections, whose gradients are
#: both the gates' gradient) compute its ``(B, T, T)`` Gram once
_last_gram: tuple[weakref.ref, tuple, torch.Tensor] | None = None


def _output_gram(backprops: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g gᵀ`` ``(B, T, T)`` for ``g`` ``(B, T, d_out)``, a view of ``backprops``; reused while
    the next call gets the same, unmodified ``backprops`` object."""
    global _last_gram
    if backprops.is_inference():  # no version counter
        return gram(g)
    # a view of the same tensor counts as the same (hooks may reshape the gradient they get)
    root = backprops if backprops._base is None else backprops._base
    key = (backprops._version, g.shape, g.stride(), g.storage_offset(), g.data_ptr())
    last = _last_gram
    if last is not None and last[0]() is root and last[1] == key:
        return last[2]
    gg = gram(g)
    _last_gram = (weakref.ref(root, _forget_gram), key, gg)
    return gg


def _forget_gram(ref: weakref.ref) -> None:
    global _last_gram
    if _last_gram is not None and _last_gram[0] is ref:
        _last_gram = None


def _gram_norms(a: torch.Tensor, g: torch.Tensor, gg: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_{t,s} (a_t·a_s)(g_t·g_s)`` per sample for ``a: (B, T, d_in)``, ``g: (B, T, d_out)``
    (``gg``: ``g gᵀ`` if already known).

    Overflow-safe where the result is finite: float16/bfloat16 inputs are reduced (one
    position) or multiplied (Grams) in float32; one position gives ``(‖a‖·‖g‖)²``, not
    ``‖a‖²·‖g‖²``. A norm that still overflows is inf or NaN (``inf · 0``), whose clip factor
    is 0: the sample is dropped, never released unclipped."""
    if a.shape[1] == 1:
        return norm_product_sq(a, g, (1, 2))
    aa = gram(a)
    if gg is None:
        gg = gram(g)
    return (aa * gg).sum((1, 2))


def compute_linear_norm_sq_sample(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms of ``nn.Linear`` gradients for an input ``(B, ..., d_in)``.

    ``weight``: ghost (Gram) or instantiated, as :func:`ghost_is_cheaper` says; ``bias``:
    ``||Σ_t g_t||²``. Returns ``{param: (B,)}``."""
    a = activations[0]
    b = backprops.shape[0]
    t = positions(a)
    a3 = a.reshape(b, t, a.shape[-1])
    g3 = backprops.reshape(b, t, backprops.shape[-1])
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        if ghost_is_cheaper(a3.shape[1], a3.shape[2], g3.shape[2]):
            gg = _output_gram(backprops, g3) if t > 1 else None
            ret[layer.weight] = _gram_norms(a3, g3, gg)
        else:
            ret[layer.weight] = sq_norms(gemm.bmm_nt(g3.transpose(1, 2), a3.transpose(1, 2)))
    if wants_grad(layer.bias):
        ret[layer.bias] = sq_sum(position_sum(g3), 1, wide=True)
    return ret


def compute_linear_norm_sample(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Per-sample gradient norms (not squared) of ``nn.Linear``, ``{param: (B,)}`` (Opacus API)."""
    return sample_norms(compute_linear_norm_sq_sample(layer, activations, backprops))


def linear_clipped_sum(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``weight``: ``Σ_{b,t} g_{bt} a_{bt}ᵀ`` (one matmul); ``bias``: ``Σ_{b,t} g_{bt}``."""
    a = activations[0].reshape(-1, layer.in_features)
    g = backprops.reshape(-1, layer.out_features)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = gemm.mm_tn(g, a)
    if wants_grad(layer.bias):
        ret[layer.bias] = g.sum(0)
    return ret


@pairs_with("clipped_sum", linear_clipped_sum)
def linear_weighted_clipped_sum(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor, c: torch.Tensor
) -> ParamDict:
    """``weight``: ``Σ_{b,t} c_b g_{bt} a_{bt}ᵀ``, one matmul with ``c`` applied to the smaller of
    ``A`` and ``G``; ``bias``: ``Σ_b c_b Σ_t g_{bt}``."""
    b, t = backprops.shape[0], positions(activations[0])
    g = backprops.reshape(b, t, layer.out_features)
    ret: ParamDict = {}
    if wants_grad(layer.weight):
        a, gc = clip_weighted_pair(activations[0].reshape(b, t, layer.in_features), g, c)
        ret[layer.weight] = gemm.mm_tn(
            gc.reshape(-1, layer.out_features), a.reshape(-1, layer.in_features)
        )
    if wants_grad(layer.bias):
        ret[layer.bias] = c.matmul(position_sum(g))
    return ret


@pairs_with("norm_sq", compute_linear_norm_sq_sample)
def linear_factors(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, Factors]:
    """``weight``: ``Σ_t g_t a_tᵀ``; ``bias``: ``Σ_t g_t · 1`` (a tied use, see :class:`Factors`)."""
    a = activations[0]
    b = backprops.shape[0]
    t = positions(a)
    g3 = backprops.reshape(b, t, layer.out_features)
    ret = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = Factors(u=g3, v=a.reshape(b, t, layer.in_features))
    if wants_grad(layer.bias):
        ret[layer.bias] = Factors(u=g3, v=g3.new_ones(b, t, 1))
    return ret


class _LinearInputGradOnly(torch.autograd.Function):
    """``F.linear(x, w, b)`` on a 2-d ``x`` ``(N, d_in)``, whose backward returns only
    ``∂L/∂x = G w``; with ``onednn``, both products on :mod:`dptorch.utils.gemm`."""

    @staticmethod
    def forward(ctx, x, weight, bias, onednn):
        ctx.save_for_backward(weight)
        ctx.onednn = onednn
        return gemm.linear(x, weight, bias) if onednn else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            w = weight.to(g.dtype)
            gx = gemm.mm(g, w) if ctx.onednn else g.matmul(w)
        return gx, None, None, None


def linear_input_grad_only(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, with autograd computing ``∂L/∂x`` only (no weight or bias gradient).

    The function runs on ``x`` flattened to 2-d and the result is reshaped outside it: a view
    made inside a custom Function cannot be modified in place (``nn.ReLU(inplace=True)`` after
    a Linear on ``(B, T, d)``), a view of its output can."""
    return input_grad_only_products(layer, x, onednn=False)


def input_grad_only_products(layer: nn.Linear, x: torch.Tensor, *, onednn: bool) -> torch.Tensor:
    """:func:`linear_input_grad_only`, with its products on :mod:`dptorch.utils.gemm` for
    ``onednn`` (the DP-LSTM's projections, which stand in for torch's fused oneDNN kernel)."""
    if x.dim() == 2:
        return _LinearInputGradOnly.apply(x, layer.weight, layer.bias, onednn)
    lead = x.shape[:-1]
    out = _LinearInputGradOnly.apply(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias,
                                     onednn)
    return out.view(*lead, out.shape[-1])


def linear_prefers_ghost(layer: nn.Linear, activations: Sequence, backprops: torch.Tensor) -> bool:
    """Ghost beats instantiation for ``T`` positions when ``T(d_in + d_out) < d_in·d_out``."""
    return ghost_is_cheaper(positions(activations[0]), layer.in_features, layer.out_features)


LINEAR_RULE = register_layer_rule(
    nn.Linear,
    LayerRule(
        grad_sample=compute_linear_grad_sample,
        norm_sq=compute_linear_norm_sq_sample,
        clipped_sum=linear_clipped_sum,
        input_grad_only=linear_input_grad_only,
        prefer_ghost=linear_prefers_ghost,
        factors=linear_factors,
        weighted_clipped_sum=linear_weighted_clipped_sum,
    ),
)
