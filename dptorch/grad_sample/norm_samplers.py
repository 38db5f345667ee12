"""Per-sample gradient norms without per-sample gradients (ghost norms), and clipped sums.

Two kinds of per-layer functions are used by the fast-clipping modes (``"ghost"`` and ``"bk"``):

* **norm samplers** (``register_norm_sq_sampler``): ``fn(layer, activations, backprops)`` returns
  ``{param: (B,)}`` squared per-sample gradient norms, with the conventions of the grad samplers
  (batch-first inputs, ``backprops`` already rescaled for ``loss_reduction``).
* **clipped-sum functions** (:data:`CLIPPED_SUM_FNS`): ``fn(layer, activations, backprops)``
  returns ``{param: grad}`` = the *batch* gradient ``Σ_b grad_b`` for the given backprops. Called
  with ``backprops[b]`` multiplied by the clip factor ``c_b`` it gives the clipped sum
  ``Σ_b c_b grad_b`` (every parameter gradient is linear in the output gradient) for the cost of
  one ordinary weight gradient. Layers without one use :func:`generic_clipped_sum` (recompute the
  layer's forward and one vector-Jacobian product).

Ghost norm of a linear map applied at ``T`` positions (Linear on ``(B, T, d_in)``, a convolution
after im2col with ``T`` output positions): with ``a_t`` the inputs and ``g_t`` the output gradients
of one sample, ``||Σ_t g_t a_tᵀ||² = Σ_{t,s} (a_t·a_s)(g_t·g_s)``: two ``T × T`` Gram matrices
instead of the ``d_out × d_in`` gradient. :func:`prefer_ghost` picks, per layer and call, the
cheaper of the two (ghost ``~T²(d_in + d_out)`` vs instantiation ``~T·d_in·d_out`` multiply-adds
per sample).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..utils.tensor_utils import unfold_nd
from .conv import _padded_input
from .embedding import _bags
from .group_norm import compute_group_norm_grad_sample
from .instance_norm import compute_instance_norm_grad_sample
from .layer_norm import compute_layer_norm_grad_sample
from .registry import GRAD_SAMPLERS, register_norm_sq_sampler
from .rms_norm import compute_rms_norm_grad_sample

ParamDict = dict[nn.Parameter, torch.Tensor]
CLIPPED_SUM_FNS: dict[type, Callable[[nn.Module, Sequence, torch.Tensor], ParamDict]] = {}


def register_clipped_sum(target_classes: type | Sequence[type]):
    """Decorator: registers ``fn(layer, activations, backprops) -> {param: Σ_b grad_b}``."""
    targets = target_classes if isinstance(target_classes, (list, tuple)) else [target_classes]

    def decorator(f):
        for t in targets:
            CLIPPED_SUM_FNS[t] = f
        return f

    return decorator


def _wants(p: nn.Parameter | None) -> bool:
    return p is not None and p.requires_grad


def _sq_norms(gs: torch.Tensor) -> torch.Tensor:
    """``(B, ...) -> (B,)`` squared L2 norms."""
    return gs.reshape(gs.shape[0], _positions(gs, 1, 0)).pow(2).sum(1)


def sample_norms(norms_sq: ParamDict) -> ParamDict:
    """``{param: (B,)}`` squared norms -> norms: the convention of Opacus's norm-sampler
    functions (``compute_linear_norm_sample`` ...), which dptorch exposes on top of these."""
    return {p: sq.clamp_min(0).sqrt() for p, sq in norms_sq.items()}


def instantiate_norms(grad_samples: ParamDict) -> ParamDict:
    """Squared norms of materialised per-sample gradients ``{p: (B, ...)} -> {p: (B,)}``."""
    return {p: _sq_norms(gs) for p, gs in grad_samples.items()}


# ----------------------------------------------------------------------------- cost model
def ghost_is_cheaper(t: int, d_in: int, d_out: int) -> bool:
    """Whether the Gram-matrix (ghost) norm of a linear map used at ``t`` positions is cheaper
    than instantiating its ``d_out × d_in`` per-sample gradient.

    Per sample, ghost costs ``t²(d_in + d_out)`` multiply-adds and ``t²`` memory; instantiation
    ``t·d_in·d_out`` and ``d_in·d_out``. With ``t = 1`` ghost is always chosen."""
    return t == 1 or t * (d_in + d_out) < d_in * d_out


def _positions(x: torch.Tensor, first: int = 1, last: int = -1) -> int:
    """Product of ``x.shape[first:last]`` (1 for an empty range)."""
    t = 1
    for s in x.shape[first:last] if last != 0 else x.shape[first:]:
        t *= s
    return t


def _linear_dims(layer: nn.Linear, a: torch.Tensor) -> tuple[int, int, int]:
    return _positions(a), layer.in_features, layer.out_features


def _conv_dims(layer: nn.modules.conv._ConvNd, backprops: torch.Tensor) -> tuple[int, int, int]:
    t = _positions(backprops, 2, 0)
    k = 1
    for s in layer.kernel_size:
        k *= s
    return t, layer.in_channels // layer.groups * k, layer.out_channels // layer.groups


def prefer_ghost(layer: nn.Module, activations: Sequence, backprops: torch.Tensor) -> bool:
    """Whether the ghost norm sampler of ``layer`` beats instantiating its per-sample gradient
    for this call (used by the norm samplers themselves and by the bk module to decide whether
    to keep the instantiated gradient for the clipped sum)."""
    if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
        return True
    if isinstance(layer, nn.Linear):
        return ghost_is_cheaper(*_linear_dims(layer, activations[0]))
    if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return ghost_is_cheaper(*_conv_dims(layer, backprops))
    return False


# ----------------------------------------------------------------------------- Linear
def _gram_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``Σ_{t,s} (a_t·a_s)(g_t·g_s)`` per sample for ``a: (B, T, d_in)``, ``g: (B, T, d_out)``."""
    if a.shape[1] == 1:
        return a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))
    aa = torch.bmm(a, a.transpose(1, 2))
    gg = torch.bmm(g, g.transpose(1, 2))
    return (aa * gg).sum((1, 2))


@register_norm_sq_sampler(nn.Linear)
def compute_linear_norm_sq_sample(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms of ``nn.Linear`` gradients for an input ``(B, ..., d_in)``.

    ``weight``: ghost (Gram) or instantiated, as :func:`ghost_is_cheaper` says; ``bias``:
    ``||Σ_t g_t||²``. Returns ``{param: (B,)}``."""
    a = activations[0]
    b = backprops.shape[0]
    t = _positions(a)
    a3 = a.reshape(b, t, a.shape[-1])
    g3 = backprops.reshape(b, t, backprops.shape[-1])
    ret: ParamDict = {}
    if _wants(layer.weight):
        if ghost_is_cheaper(a3.shape[1], a3.shape[2], g3.shape[2]):
            ret[layer.weight] = _gram_norms(a3, g3)
        else:
            ret[layer.weight] = _sq_norms(torch.bmm(g3.transpose(1, 2), a3))
    if _wants(layer.bias):
        ret[layer.bias] = g3.sum(1).pow(2).sum(1)
    return ret


@register_clipped_sum(nn.Linear)
def linear_clipped_sum(
    layer: nn.Linear, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``weight``: ``Σ_{b,t} g_{bt} a_{bt}ᵀ`` (one matmul); ``bias``: ``Σ_{b,t} g_{bt}``."""
    a = activations[0].reshape(-1, layer.in_features)
    g = backprops.reshape(-1, layer.out_features)
    ret: ParamDict = {}
    if _wants(layer.weight):
        ret[layer.weight] = g.t().mm(a)
    if _wants(layer.bias):
        ret[layer.bias] = g.sum(0)
    return ret


# ----------------------------------------------------------------------------- Conv
@register_norm_sq_sampler([nn.Conv1d, nn.Conv2d, nn.Conv3d])
def compute_conv_norm_sq_sample(
    layer: nn.modules.conv._ConvNd, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms of a convolution's gradients.

    Args:
        activations: ``[x]``, ``x`` of shape ``(B, C_in, *spatial_in)``.
        backprops: ``(B, C_out, *spatial_out)``.

    The input is unfolded to ``(B, groups, C_in/groups · K, L)``; each group is a linear map used
    at ``L`` positions (ghost via ``L × L`` Grams, or instantiated, per :func:`ghost_is_cheaper`).
    """
    b = backprops.shape[0]
    groups = layer.groups
    n_out = _positions(backprops, 2, 0)
    g = backprops.reshape(b, groups, layer.out_channels // groups, n_out)  # (B, G, o, L)
    ret: ParamDict = {}
    if _wants(layer.weight):
        x, padding = _padded_input(layer, activations[0])
        cols = unfold_nd(
            x, layer.kernel_size, padding=padding, stride=layer.stride, dilation=layer.dilation
        )
        cols = cols.reshape(b, groups, cols.shape[1] // groups, n_out)  # (B, G, i, L)
        t, d_in, d_out = cols.shape[-1], cols.shape[2], g.shape[2]
        if ghost_is_cheaper(t, d_in, d_out):
            aa = torch.matmul(cols.transpose(2, 3), cols)  # (B, G, L, L)
            gg = torch.matmul(g.transpose(2, 3), g)
            ret[layer.weight] = (aa * gg).sum((1, 2, 3))
        else:
            ret[layer.weight] = _sq_norms(torch.matmul(g, cols.transpose(2, 3)))
    if _wants(layer.bias):
        ret[layer.bias] = g.sum(3).pow(2).sum((1, 2))
    return ret


@register_clipped_sum([nn.Conv1d, nn.Conv2d, nn.Conv3d])
def conv_clipped_sum(
    layer: nn.modules.conv._ConvNd, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """The convolution's batch weight/bias gradient from ``aten.convolution_backward``."""
    x, padding = _padded_input(layer, activations[0])
    n = len(layer.kernel_size)
    padding = [padding] * n if isinstance(padding, int) else list(padding)
    want_w, want_b = _wants(layer.weight), _wants(layer.bias)
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


# ----------------------------------------------------------------------------- Embedding
def _grouped_row_sums(
    sample_of: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    num_embeddings: int,
    scale_grad_by_freq: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums ``values`` over equal ``(sample, id)`` pairs without a ``V``-sized buffer.

    Returns ``(row_sums (U, d), sample_of_row (U,))`` over the ``U`` distinct pairs; with
    ``scale_grad_by_freq`` each row is divided by its number of entries (per-sample frequency,
    the convention of the Embedding grad sampler)."""
    keys = sample_of * num_embeddings + ids
    uniq, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    rows = values.new_zeros((uniq.numel(), values.shape[-1])).index_add_(0, inverse, values)
    if scale_grad_by_freq:
        rows = rows / counts.to(rows.dtype)[:, None]
    return rows, torch.div(uniq, num_embeddings, rounding_mode="floor")


def _embedding_entries(layer: nn.Embedding, ids: torch.Tensor, backprops: torch.Tensor):
    """``(sample_of, ids, values)`` of every non-padding lookup, flattened."""
    b = backprops.shape[0]
    ids = ids.reshape(b, _positions(ids, 1, 0))
    sample_of = torch.arange(b, device=ids.device).repeat_interleave(ids.shape[1])
    ids = ids.reshape(-1)
    values = backprops.reshape(-1, layer.embedding_dim)
    if layer.padding_idx is not None:
        keep = ids != layer.padding_idx
        sample_of, ids, values = sample_of[keep], ids[keep], values[keep]
    return sample_of, ids, values


@register_norm_sq_sampler(nn.Embedding)
def compute_embedding_norm_sq_sample(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms of ``nn.Embedding`` gradients, ``O(B·S·d)``.

    Args:
        activations: ``[ids]`` with ``ids`` of shape ``(B, *S)``.
        backprops: ``(B, *S, d)``.

    Equal indices within a sample are summed first (``||Σ_t e_{i_t} g_tᵀ||² = Σ_v ||Σ_{t: i_t=v}
    g_t||²``); the ``padding_idx`` row is left out, as in the gradient."""
    if not _wants(layer.weight):
        return {}
    b = backprops.shape[0]
    sample_of, ids, values = _embedding_entries(layer, activations[0], backprops)
    rows, row_sample = _grouped_row_sums(
        sample_of, ids, values, layer.num_embeddings, layer.scale_grad_by_freq
    )
    out = backprops.new_zeros(b).index_add_(0, row_sample, rows.pow(2).sum(1))
    return {layer.weight: out}


@register_clipped_sum(nn.Embedding)
def embedding_clipped_sum(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``Σ_b grad_b``: one ``index_add`` of the (clip-scaled) output gradients into ``(V, d)``."""
    if not _wants(layer.weight):
        return {}
    sample_of, ids, values = _embedding_entries(layer, activations[0], backprops)
    if layer.scale_grad_by_freq:
        keys = sample_of * layer.num_embeddings + ids
        _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        values = values / counts.to(values.dtype)[inverse][:, None]
    grad = values.new_zeros(layer.weight.shape).index_add_(0, ids, values)
    return {layer.weight: grad}


@register_norm_sq_sampler(nn.EmbeddingBag)
def compute_embeddingbag_norm_sq_sample(
    layer: nn.EmbeddingBag, activations: Sequence, backprops: torch.Tensor
) -> ParamDict:
    """Squared per-bag norms of ``nn.EmbeddingBag`` (modes ``"sum"``/``"mean"``) gradients,
    without the ``(B, V, d)`` per-sample gradient. Inputs as for the EmbeddingBag grad sampler."""
    if not _wants(layer.weight):
        return {}
    if layer.mode not in ("sum", "mean"):
        raise NotImplementedError(
            f"EmbeddingBag(mode={layer.mode!r}) has no per-sample gradient; use 'sum' or 'mean'."
        )
    args = list(activations) + [None] * (3 - len(activations))
    ids, offsets, weights = args[:3]
    flat_ids, bag_of, n_bags = _bags(ids, offsets, layer.include_last_offset)
    b = backprops.shape[0]
    coef = backprops.new_ones(flat_ids.shape)
    if layer.padding_idx is not None:
        coef = (flat_ids != layer.padding_idx).to(backprops.dtype)
    if layer.mode == "mean":
        counts = backprops.new_zeros(b).index_add_(0, bag_of, coef)
        coef = coef / counts.clamp_min(1)[bag_of]
    elif weights is not None:
        if ids.dim() == 1 and layer.include_last_offset:
            weights = weights.reshape(-1)[: flat_ids.numel()]
        coef = coef * weights.reshape(-1).to(coef.dtype)
    rows, row_bag = _grouped_row_sums(
        bag_of, flat_ids, coef[:, None] * backprops[bag_of], layer.num_embeddings,
        layer.scale_grad_by_freq,
    )
    out = backprops.new_zeros(b).index_add_(0, row_bag, rows.pow(2).sum(1))
    return {layer.weight: out}


# ----------------------------------------------------------------------------- normalisation
# Their per-sample gradients are (B, C): instantiating them is the cheapest exact norm.
def _norm_via(grad_sampler):
    def norm_sampler(layer, activations, backprops):
        return instantiate_norms(grad_sampler(layer, activations, backprops))

    norm_sampler.__doc__ = (
        "Squared per-sample norms ``{param: (B,)}`` from the (small) instantiated per-sample "
        f"gradients of ``{grad_sampler.__name__}``."
    )
    return norm_sampler


register_norm_sq_sampler(nn.LayerNorm)(_norm_via(compute_layer_norm_grad_sample))
register_norm_sq_sampler(nn.GroupNorm)(_norm_via(compute_group_norm_grad_sample))
register_norm_sq_sampler(nn.RMSNorm)(_norm_via(compute_rms_norm_grad_sample))
register_norm_sq_sampler([nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d])(
    _norm_via(compute_instance_norm_grad_sample)
)


def _register_dp_layers() -> None:
    """Norm samplers of the DP layers' building blocks (RNNLinear is a Linear; SequenceBias is
    a (B, d) bias gradient, cheapest instantiated)."""
    try:
        from ..layers.dp_multihead_attention import SequenceBias
        from ..layers.dp_rnn import RNNLinear
    except ImportError:  # pragma: no cover - layers package not available
        return
    register_norm_sq_sampler(RNNLinear)(compute_linear_norm_sq_sample)
    register_clipped_sum(RNNLinear)(linear_clipped_sum)
    if SequenceBias in GRAD_SAMPLERS:
        register_norm_sq_sampler(SequenceBias)(_norm_via(GRAD_SAMPLERS[SequenceBias]))


def generic_clipped_sum(
    layer: nn.Module, activations: Sequence, backprops: torch.Tensor, kwargs: dict | None = None,
    batch_first: bool = True,
    params: Sequence[tuple[str, nn.Parameter]] | None = None,
) -> ParamDict:
    """``Σ_b grad_b`` of any layer: recomputes its forward on the captured inputs and takes one
    vector-Jacobian product with ``backprops`` (batch-first; moved back for ``batch_first=False``),
    w.r.t. the layer's own trainable parameters (or the named ``params`` it samples).
    """
    from .unit_params import unit_parameters

    if params is None:
        params = unit_parameters(layer)
    params = [p for _, p in params if p.requires_grad]
    if not params:
        return {}
    args = list(activations)
    if not batch_first:
        args = [a.movedim(0, 1) if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args]
        backprops = backprops.movedim(0, 1)
    with torch.enable_grad():
        out = layer(*args, **(kwargs or {}))
        if isinstance(out, (tuple, list)):
            out = out[0]
        grads = torch.autograd.grad(out, params, backprops, allow_unused=True)
    return {p: (g if g is not None else torch.zeros_like(p)) for p, g in zip(params, grads)}


_register_dp_layers()
