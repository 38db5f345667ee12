"""Per-sample gradients of ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``.

Every stride, dilation, group count, ``padding`` (ints, ``"valid"``, ``"same"``) and
``padding_mode`` (zeros, reflect, replicate, circular) is supported. The input is unfolded into
its receptive fields (im2col) and each group's weight gradient is one batched matrix product::

    cols = unfold(x)                                  # (B, C_in * K, L)
    grad_sample[b] = backprops[b] @ cols[b]^T         # (B, C_out, C_in / groups * K)

The squared norm is each group's ghost (``L × L`` Grams) or instantiated norm, whichever is
cheaper; the clipped sum is ``aten.convolution_backward`` with the clip-scaled output gradient;
bk's forward is a convolution whose backward returns the input gradient only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import gemm
from ..utils.tensor_utils import unfold_nd
from .norm_samplers import (
    ParamDict,
    ghost_is_cheaper,
    positions,
    sq_norms,
    sq_sum,
    wants_grad,
    widened,
)
from .registry import LayerRule, register_layer_rule


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


#: Most elements of per-sample intermediates (the unfolded input, the ``L × L`` Grams, the
#: batch-folded convolution's operands) formed at once: a batch whose intermediates exceed it is
#: taken a chunk of samples at a time. Each sample's result is computed as it would be in one
#: call; on a CPU the chunks are no slower (measured: 0.9–1.1× the time, a quarter of the
#: transient memory at 8 of 32 samples on CIFAR-10's layers).
CHUNK_ELEMENTS = 1 << 20


def _weight_path(layer: nn.modules.conv._ConvNd, backprops: torch.Tensor, norms: bool) -> str:
    """How the per-sample weight gradients (``norms=False``) or their norms are formed:
    ``"folded"`` (one batch-folded grouped convolution, no unfolded input), ``"ghost"`` (the
    unfolded input's ``L × L`` Grams) or ``"unfolded"`` (unfolded input, batched product)."""
    n_out = positions(backprops, 2, 0)
    d_in = layer.in_channels // layer.groups * positions(layer.weight, 2, 0)
    ghost = norms and ghost_is_cheaper(n_out, d_in, layer.out_channels // layer.groups)
    if not ghost and _folding_is_faster(layer):
        return "folded"
    return "ghost" if ghost else "unfolded"


def samples_per_chunk(
    layer: nn.modules.conv._ConvNd, x: torch.Tensor, backprops: torch.Tensor, path: str
) -> int:
    """How many samples of ``x`` ``(B, C_in, *spatial_in)`` and ``backprops``
    ``(B, C_out, *spatial_out)`` one chunk of ``path`` (:func:`_weight_path`) takes: at most
    :data:`CHUNK_ELEMENTS` per-sample intermediate elements (at least one sample). Per sample:
    the weight's size (the result), plus the input and output gradient (folded: the operands
    oneDNN reorders), or the unfolded input ``C_in · K · L`` (with ``2 · groups · L²`` for the
    Grams of the ghost path)."""
    n_out = positions(backprops, 2, 0)
    if path == "folded":
        per_sample = positions(x, 1, 0) + positions(backprops, 1, 0) + layer.weight.numel()
    else:
        per_sample = layer.in_channels * positions(layer.weight, 2, 0) * n_out + (
            2 * layer.groups * n_out * n_out if path == "ghost" else layer.weight.numel()
        )
    return max(1, CHUNK_ELEMENTS // per_sample)


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
    ret: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        path = _weight_path(layer, backprops, False)
        step = samples_per_chunk(layer, x, backprops, path)
        if step >= batch_size:
            ret[layer.weight] = _weight_grad_sample(layer, x, backprops, path)
        else:  # written chunk by chunk into the result: no second (B, *weight.shape) copy
            gs = None
            for i in range(0, batch_size, step):
                part = _weight_grad_sample(layer, x[i : i + step], backprops[i : i + step], path)
                if gs is None:
                    gs = part.new_empty((batch_size, *part.shape[1:]))
                gs[i : i + step] = part
            ret[layer.weight] = gs
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = backprops.flatten(2).sum(dim=2)
    return ret


def _weight_grad_sample(
    layer: nn.modules.conv._ConvNd, x: torch.Tensor, backprops: torch.Tensor, path: str
) -> torch.Tensor:
    """``(B, *weight.shape)`` per-sample weight gradients of ``x`` ``(B, C_in, *spatial_in)``
    and ``backprops`` ``(B, C_out, *spatial_out)``: batch-folded (``path="folded"``), or
    unfolded and multiplied."""
    if path == "folded":
        return _folded_weight_grad_sample(layer, x, backprops)
    batch_size, c_out = backprops.shape[0], layer.out_channels
    n_out = positions(backprops, 2, 0)
    g = backprops.reshape(batch_size, c_out, n_out)
    x, padding = _padded_input(layer, x)
    cols = unfold_nd(
        x, layer.kernel_size, padding=padding, stride=layer.stride, dilation=layer.dilation
    )  # (B, C_in * K, L)
    groups = layer.groups
    if groups == 1:
        gs = gemm.bmm_nt(g, cols)
    else:
        gs = torch.einsum(
            "bgol,bgil->bgoi",
            g.view(batch_size, groups, c_out // groups, n_out),
            cols.view(batch_size, groups, cols.shape[1] // groups, n_out),
        )
    return gs.reshape(batch_size, *layer.weight.shape)


def _folding_is_faster(layer: nn.modules.conv._ConvNd) -> bool:
    """Whether the batch-folded grouped convolution beats unfold + batched matmul for this
    ``Conv2d``'s per-sample weight gradients. Measured with torch 2.13's oneDNN on a CPU over
    seven layer shapes and B = 32..256: folding is 1.2–4× faster with at most 64 output channels
    per group and receptive fields of at least 128 values (``C_in/groups · kh · kw``), and up to
    2.5× slower with 128 output channels or small receptive fields."""
    if len(layer.kernel_size) != 2:
        return False
    k = layer.kernel_size[0] * layer.kernel_size[1]
    return layer.out_channels // layer.groups <= 64 and layer.in_channels // layer.groups * k >= 128


def _folded_weight_grad_sample(
    layer: nn.modules.conv._ConvNd, x: torch.Tensor, backprops: torch.Tensor
) -> torch.Tensor:
    """``(B, *weight.shape)`` per-sample weight gradients of a ``Conv2d`` as the weight gradient
    of one convolution whose ``B · groups`` groups are the samples' (see
    :func:`convolution2d_backward_as_a_convolution`)."""
    b, w = backprops.shape[0], layer.weight
    if b == 0:
        return w.new_zeros((0, *w.shape), dtype=backprops.dtype)
    x, padding = _padded_input(layer, x)
    folded_w = w.new_zeros((1,) * w.dim()).expand(b * w.shape[0], *w.shape[1:])  # shape only
    _, gw, _ = torch.ops.aten.convolution_backward(
        backprops.reshape(1, -1, *backprops.shape[2:]),
        x.reshape(1, -1, *x.shape[2:]),
        folded_w,
        None,
        list(layer.stride),
        [padding] * 2 if isinstance(padding, int) else list(padding),
        list(layer.dilation),
        False,
        [0, 0],
        b * layer.groups,
        [False, True, False],
    )
    return gw.view(b, *w.shape)


def convolution2d_backward_as_a_convolution(
    layer: nn.Conv2d, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``nn.Conv2d`` as one weight-gradient of a grouped convolution
    (Opacus's alternative sampler; the unfold one above is the default).

    The batch is folded into the groups: the ``B`` samples become ``B·groups`` groups of one
    convolution whose input is ``(1, B·C_in, H, W)`` and output gradient ``(1, B·C_out, H', W')``;
    its weight gradient, ``(B·C_out, C_in/groups, kh, kw)``, holds every sample's block.

    Args:
        activations: ``[x]``, ``x`` of shape ``(B, C_in, H, W)``.
        backprops: ``(B, C_out, H', W')``.

    Returns:
        ``weight``: ``(B, C_out, C_in/groups, kh, kw)``; ``bias``: ``(B, C_out)``.
    """
    ret: dict[nn.Parameter, torch.Tensor] = {}
    if wants_grad(layer.weight):
        ret[layer.weight] = _folded_weight_grad_sample(layer, activations[0], backprops)
    if layer.bias is not None and wants_grad(layer.bias):
        ret[layer.bias] = backprops.sum(dim=(2, 3))
    return ret


def compute_conv_norm_sq_sample(
    layer: nn.modules.conv._ConvNd, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms of a convolution's gradients.

    Args:
        activations: ``[x]``, ``x`` of shape ``(B, C_in, *spatial_in)``.
        backprops: ``(B, C_out, *spatial_out)``.

    The input is unfolded to ``(B, groups, C_in/groups · K, L)``; each group is a linear map used
    at ``L`` positions (ghost via ``L × L`` Grams, or instantiated, per :func:`ghost_is_cheaper`).
    A batch whose intermediates exceed :data:`CHUNK_ELEMENTS` is taken in chunks of samples.
    """
    b = backprops.shape[0]
    path = _weight_path(layer, backprops, True)
    step = samples_per_chunk(layer, activations[0], backprops, path)
    if step < b:
        x = activations[0]
        parts = [
            compute_conv_norm_sq_sample(layer, [x[i : i + step]], backprops[i : i + step])
            for i in range(0, b, step)
        ]
        return {p: torch.cat([part[p] for part in parts]) for p in parts[0]}
    groups = layer.groups
    n_out = positions(backprops, 2, 0)
    g = backprops.reshape(b, groups, layer.out_channels // groups, n_out)  # (B, G, o, L)
    ret: ParamDict = {}
    if wants_grad(layer.weight) and path == "folded":
        ret[layer.weight] = sq_norms(_folded_weight_grad_sample(layer, activations[0], backprops))
    elif wants_grad(layer.weight):
        # float16/bfloat16: im2col and the Grams in float32 (their entries overflow float16)
        x, padding = _padded_input(layer, widened(activations[0]))
        cols = unfold_nd(
            x, layer.kernel_size, padding=padding, stride=layer.stride, dilation=layer.dilation
        )
        cols = cols.reshape(b, groups, cols.shape[1] // groups, n_out)  # (B, G, i, L)
        gw = widened(g)
        if path == "ghost":
            aa = torch.matmul(cols.transpose(2, 3), cols)  # (B, G, L, L)
            gg = torch.matmul(gw.transpose(2, 3), gw)
            ret[layer.weight] = (aa * gg).sum((1, 2, 3))
        else:
            ret[layer.weight] = sq_norms(torch.matmul(gw, cols.transpose(2, 3)))
    if wants_grad(layer.bias):
        ret[layer.bias] = sq_sum(g.sum(3), (1, 2), wide=True)
    return ret


def conv_clipped_sum(
    layer: nn.modules.conv._ConvNd, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """The convolution's batch weight/bias gradient from ``aten.convolution_backward``."""
    x, padding = _padded_input(layer, activations[0])
    n = len(layer.kernel_size)
    padding = [padding] * n if isinstance(padding, int) else list(padding)
    want_w, want_b = wants_grad(layer.weight), wants_grad(layer.bias)
    _, gw, gb = torch.ops.aten.convolution_backward(
        backprops,
        x,
        layer.weight,
        [layer.out_channels] if layer.bias is not None else None,
        list(layer.stride),
        padding,
        list(layer.dilation),
        False,
        [0] * n,
        layer.groups,
        [False, want_w, want_b],
    )
    ret: ParamDict = {}
    if want_w:
        ret[layer.weight] = gw
    if want_b:
        ret[layer.bias] = gb
    return ret

class _ConvInputGradOnly(torch.autograd.Function):
    """A zero-padded convolution whose backward returns only the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        ctx.save_for_backward(x, weight)
        ctx.conf = (stride, padding, dilation, groups)
        n = weight.dim() - 2
        conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
        return conv(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        n = weight.dim() - 2
        # under autocast the forward ran in g's precision: differentiate that convolution
        gx, _, _ = torch.ops.aten.convolution_backward(
            g, x.to(g.dtype), weight.to(g.dtype), None, list(stride), list(padding), list(dilation), False, [0] * n,
            groups, [True, False, False],
        )
        return gx, None, None, None, None, None, None


def conv_input_grad_only(layer: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, with autograd computing ``∂L/∂x`` only (no weight or bias gradient)."""
    x, padding = _padded_input(layer, x)
    n = len(layer.kernel_size)
    padding = (padding,) * n if isinstance(padding, int) else tuple(padding)
    return _ConvInputGradOnly.apply(
        x, layer.weight, layer.bias, layer.stride, padding, layer.dilation, layer.groups
    )


def conv_prefers_ghost(
    layer: nn.modules.conv._ConvNd, activations: Sequence, backprops: torch.Tensor
) -> bool:
    """Ghost beats instantiation when ``L(d_in + d_out) < d_in·d_out`` for ``L`` output positions,
    ``d_in = C_in / groups · K`` and ``d_out = C_out / groups``."""
    k = 1
    for s in layer.kernel_size:
        k *= s
    return ghost_is_cheaper(
        positions(backprops, 2, 0),
        layer.in_channels // layer.groups * k,
        layer.out_channels // layer.groups,
    )


CONV_RULE = register_layer_rule(
    [nn.Conv1d, nn.Conv2d, nn.Conv3d],
    LayerRule(
        grad_sample=compute_conv_grad_sample,
        norm_sq=compute_conv_norm_sq_sample,
        clipped_sum=conv_clipped_sum,
        input_grad_only=conv_input_grad_only,
        prefer_ghost=conv_prefers_ghost,
    ),
)
