"""Rule of :class:`dptorch.layers.dp_rnn.RNNLinear`: the one of ``nn.Linear``.

``DPRNN`` / ``DPGRU`` / ``DPLSTM`` call each ``RNNLinear`` once per forward on the whole
sequence ``(B, T, in)``, so its per-sample gradient, norms and clipped sum are ``nn.Linear``'s.
A call inside :meth:`RNNLinear.returning` returns the value the recurrence already computed;
in bk mode it is the input-gradient-only ``F.linear`` with that value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..layers.dp_rnn import RNNLinear
from .linear import LINEAR_RULE, compute_linear_grad_sample, input_grad_only_products
from .registry import register_layer_rule


def compute_rnn_linear_grad_sample(
    layer: RNNLinear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of an ``RNNLinear``: those of ``nn.Linear``."""
    return compute_linear_grad_sample(layer, activations, backprops)


class _GivenInputGradOnly(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of known value ``given``, whose backward returns
    ``∂L/∂x`` only (bk forms the parameters' clipped sums itself). ``weight`` and ``bias`` are
    inputs so that the output requires a gradient whenever either parameter does."""

    @staticmethod
    def forward(ctx, given, x, weight, bias):
        ctx.save_for_backward(weight)
        return given.view_as(given)

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        gx = g.matmul(weight.to(g.dtype)) if ctx.needs_input_grad[1] else None
        return None, gx, None, None


def rnn_linear_input_grad_only(layer: RNNLinear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with autograd computing ``∂L/∂x`` only; the recurrence's value if given."""
    given = layer.take_given(x)
    if given is not None:
        return _GivenInputGradOnly.apply(given, x, layer.weight, layer.bias)
    return input_grad_only_products(layer, x, onednn=True)


RNN_LINEAR_RULE = register_layer_rule(
    RNNLinear,
    replace(
        LINEAR_RULE,
        grad_sample=compute_rnn_linear_grad_sample,
        input_grad_only=rnn_linear_input_grad_only,
    ),
)
