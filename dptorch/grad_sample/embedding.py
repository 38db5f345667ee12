"""Per-sample gradients of ``nn.Embedding`` and ``nn.EmbeddingBag``.

Both reduce to one ``index_add`` into the ``(B, V, d)`` result: every looked-up index ``i`` of
sample (or bag) ``b`` adds ``coef * backprops[b]`` to row ``(b, i)``, so an index used several
times counts with its multiplicity. No other ``O(B * V * d)`` buffer is allocated. As in
PyTorch's own gradient, the ``padding_idx`` row gets a zero per-sample gradient.

The squared norms never build the ``(B, V, d)`` gradient: equal ``(sample, index)`` pairs are
summed first, ``O(B·S·d)``. Embedding's clipped sum is one ``index_add`` of the clip-scaled
output gradients, and bk's forward computes no gradient at all (indices have none). The ghost
path is always preferred.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .norm_samplers import Factors, ParamDict, positions, sample_norms, sq_sum, wants_grad
from .registry import LayerRule, pairs_with, register_layer_rule


def _scatter_rows(
    batch_size: int,
    num_embeddings: int,
    sample_of: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    scale_grad_by_freq: bool = False,
) -> torch.Tensor:
    """``out[b, v] = sum_{j: sample_of[j] = b, ids[j] = v} values[j]``.

    Args:
        sample_of, ids: ``(N,)`` integer tensors (sample index and embedding row of entry ``j``).
        values: ``(N, d)``.
        scale_grad_by_freq: divide ``out[b, v]`` by the number of entries ``j`` summed into it
            (the frequency of ``v`` in sample ``b``, as ``scale_grad_by_freq`` does for a batch
            holding only sample ``b``).

    Returns:
        ``(batch_size, num_embeddings, d)``.
    """
    d = values.shape[-1]
    out = values.new_zeros((batch_size * num_embeddings, d))
    flat = sample_of * num_embeddings + ids
    out.index_add_(0, flat, values)
    if scale_grad_by_freq:
        counts = values.new_zeros(batch_size * num_embeddings).index_add_(
            0, flat, values.new_ones(flat.shape)
        )
        out /= counts.clamp_min(1)[:, None]
    return out.view(batch_size, num_embeddings, d)


def compute_embedding_grad_sample(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient of ``nn.Embedding``.

    Args:
        activations: ``[ids]`` with ``ids`` of shape ``(B, *S)`` (integer).
        backprops: ``(B, *S, d)``.

    Returns:
        ``weight``: ``(B, V, d)``, zero on the ``padding_idx`` row. ``max_norm`` needs no special
        case: the renormalisation happens in place before the lookup and outside autograd, so the
        gradient has the same form.
    """
    if not layer.weight.requires_grad:
        return {}
    ids = activations[0]
    batch_size = backprops.shape[0]
    d = layer.embedding_dim
    ids = ids.reshape(batch_size, -1) if batch_size else ids.reshape(0, 0)
    per_sample = ids.shape[1]
    sample_of = torch.arange(batch_size, device=ids.device).repeat_interleave(per_sample)
    gs = _scatter_rows(
        batch_size,
        layer.num_embeddings,
        sample_of,
        ids.reshape(-1),
        backprops.reshape(batch_size * per_sample, d),
        scale_grad_by_freq=layer.scale_grad_by_freq,
    )
    if layer.padding_idx is not None:
        gs[:, layer.padding_idx] = 0
    return {layer.weight: gs}


def _bags(
    ids: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flattens an EmbeddingBag input to ``(ids (N,), bag_of (N,), n_bags)``."""
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError("EmbeddingBag: offsets must be None when the input is 2-D (B, L)")
        n_bags, bag_len = ids.shape
        bag_of = torch.arange(n_bags, device=ids.device).repeat_interleave(bag_len)
        return ids.reshape(-1), bag_of, n_bags
    if ids.dim() != 1 or offsets is None:
        raise ValueError(
            "EmbeddingBag per-sample gradients need a 2-D input (B, L), or a 1-D input with "
            f"offsets; got input of shape {tuple(ids.shape)} and offsets={offsets!r}"
        )
    starts = offsets[:-1] if include_last_offset else offsets
    n_bags = starts.numel()
    positions = torch.arange(ids.numel(), device=ids.device)
    # bag of position j: the last bag whose start is <= j
    bag_of = torch.searchsorted(starts.contiguous(), positions, right=True) - 1
    if include_last_offset:
        # entries at or after the last offset belong to no bag (PyTorch ignores them)
        keep = positions < offsets[-1]
        return ids[keep], bag_of[keep], n_bags
    return ids, bag_of, n_bags


_BAG_FREQ = (
    "EmbeddingBag(scale_grad_by_freq=True) has no per-sample gradient in hooks, ghost or bk mode "
    "(PyTorch scales a bag's gradient by frequencies over the whole batch, not per sample); set "
    "scale_grad_by_freq=False or use grad_sample_mode='functorch'."
)


def compute_embeddingbag_grad_sample(
    layer: nn.EmbeddingBag, activations: Sequence, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample (per-bag) gradient of ``nn.EmbeddingBag`` in mode ``"sum"`` or ``"mean"``.

    Args:
        activations: ``[ids, offsets, per_sample_weights]`` as passed to ``forward`` (missing
            trailing entries mean ``None``): ``ids`` is ``(B, L)`` with ``offsets=None``, or
            ``(N,)`` with ``offsets`` of shape ``(B,)`` (``(B + 1,)`` if ``include_last_offset``).
            ``per_sample_weights`` (``ids``'s shape, mode ``"sum"`` only) scales each entry.
        backprops: ``(B, d)``.

    Returns:
        ``weight``: ``(B, V, d)``. Entries equal to ``padding_idx`` are left out of their bag
        (also from the ``"mean"`` denominator) and that row's gradient is zero.
    """
    if not layer.weight.requires_grad:
        return {}
    if layer.mode not in ("sum", "mean"):
        raise NotImplementedError(
            f"EmbeddingBag(mode={layer.mode!r}) has no per-sample gradient sampler; use "
            "mode='sum' or 'mean'."
        )
    if layer.scale_grad_by_freq:
        raise NotImplementedError(_BAG_FREQ)
    args = list(activations) + [None] * (3 - len(activations))
    ids, offsets, weights = args[:3]
    flat_ids, bag_of, n_bags = _bags(ids, offsets, layer.include_last_offset)
    batch_size = backprops.shape[0]
    if n_bags != batch_size:
        raise ValueError(
            f"EmbeddingBag produced {n_bags} bags but its output gradient has batch size "
            f"{batch_size}; use batch_first=True (bags are the batch)."
        )
    if layer.padding_idx is None:
        coef = backprops.new_ones(flat_ids.shape)
    else:
        coef = (flat_ids != layer.padding_idx).to(backprops.dtype)
    if layer.mode == "mean":  # divide by the number of (non-padding) entries of the bag
        counts = backprops.new_zeros(batch_size).index_add_(0, bag_of, coef)
        coef = coef / counts.clamp_min(1)[bag_of]
    elif weights is not None:
        if ids.dim() == 1 and layer.include_last_offset:
            weights = weights.reshape(-1)[: flat_ids.numel()]
        coef = coef * weights.reshape(-1).to(coef.dtype)
    gs = _scatter_rows(
        batch_size,
        layer.num_embeddings,
        bag_of,
        flat_ids,
        coef[:, None] * backprops[bag_of],
    )
    if layer.padding_idx is not None:
        gs[:, layer.padding_idx] = 0
    return {layer.weight: gs}


def compute_embeddingbag_gradsampler(
    layer: nn.EmbeddingBag, inputs: Sequence, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus name of :func:`compute_embeddingbag_grad_sample` (``inputs`` = activations)."""
    return compute_embeddingbag_grad_sample(layer, inputs, backprops)


def compute_embedding_norm_sample(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms (not squared) of ``nn.Embedding``, ``{weight: (B,)}`` (Opacus
    API)."""
    return sample_norms(compute_embedding_norm_sq_sample(layer, activations, backprops))


def _pair_groups(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups equal ``keys`` with shapes fixed by ``N`` alone (no host sync, so a CUDA graph can
    capture it; ``torch.unique`` must read its output size back).

    Args:
        keys: ``(N,)`` integers.

    Returns ``(group (N,), counts (N,))``: entry ``j`` is in group ``group[j]`` of ``0 .. U-1``
    (``U`` distinct keys, in sorted order); ``counts[g]`` is the size of group ``g``, 0 for
    ``g >= U``."""
    sorted_keys, order = keys.sort()
    new = torch.ones_like(sorted_keys, dtype=torch.bool)
    new[1:] = sorted_keys[1:] != sorted_keys[:-1]
    group = torch.empty_like(order).scatter_(0, order, new.cumsum(0) - 1)
    counts = torch.zeros_like(order).index_add_(0, group, torch.ones_like(order))
    return group, counts


def _grouped_row_sums(
    sample_of: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    num_embeddings: int,
    scale_grad_by_freq: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums ``values`` over equal ``(sample, id)`` pairs without a ``V``-sized buffer.

    Returns ``(row_sums (N, d), sample_of_row (N,))``: one row per distinct pair, then zero rows
    up to ``N`` (static shapes); with ``scale_grad_by_freq`` each row is divided by its number
    of entries (per-sample frequency, the convention of the Embedding grad sampler)."""
    keys = sample_of * num_embeddings + ids
    group, counts = _pair_groups(keys)
    rows = values.new_zeros(values.shape).index_add_(0, group, values)
    if scale_grad_by_freq:
        rows = rows / counts.clamp(min=1).to(rows.dtype)[:, None]
    row_keys = torch.zeros_like(keys).scatter_(0, group, keys)  # a group's entries share a key
    return rows, torch.div(row_keys, num_embeddings, rounding_mode="floor")


def _embedding_entries(layer: nn.Embedding, ids: torch.Tensor, backprops: torch.Tensor):
    """``(sample_of, ids, values)`` of every lookup, flattened; a ``padding_idx`` lookup's value
    is 0 (kept, not dropped: static shapes)."""
    b = backprops.shape[0]
    ids = ids.reshape(b, positions(ids, 1, 0))
    sample_of = torch.arange(b, device=ids.device).repeat_interleave(ids.shape[1])
    ids = ids.reshape(-1)
    values = backprops.reshape(-1, layer.embedding_dim)
    if layer.padding_idx is not None:
        values = torch.where((ids != layer.padding_idx)[:, None], values, 0.0)
    return sample_of, ids, values


def compute_embedding_norm_sq_sample(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """Squared per-sample norms of ``nn.Embedding`` gradients, ``O(B·S·d)``.

    Args:
        activations: ``[ids]`` with ``ids`` of shape ``(B, *S)``.
        backprops: ``(B, *S, d)``.

    Equal indices within a sample are summed first (``||Σ_t e_{i_t} g_tᵀ||² = Σ_v ||Σ_{t: i_t=v}
    g_t||²``); the ``padding_idx`` row is left out, as in the gradient."""
    if not wants_grad(layer.weight):
        return {}
    b = backprops.shape[0]
    sample_of, ids, values = _embedding_entries(layer, activations[0], backprops)
    rows, row_sample = _grouped_row_sums(
        sample_of, ids, values, layer.num_embeddings, layer.scale_grad_by_freq
    )
    out = backprops.new_zeros(b).index_add_(0, row_sample, sq_sum(rows, 1))
    return {layer.weight: out}


def embedding_clipped_sum(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> ParamDict:
    """``Σ_b grad_b``: one ``index_add`` of the (clip-scaled) output gradients into ``(V, d)``."""
    if not wants_grad(layer.weight):
        return {}
    sample_of, ids, values = _embedding_entries(layer, activations[0], backprops)
    if layer.scale_grad_by_freq:
        group, counts = _pair_groups(sample_of * layer.num_embeddings + ids)
        values = values / counts.to(values.dtype)[group][:, None]
    grad = values.new_zeros(layer.weight.shape).index_add_(0, ids, values)
    return {layer.weight: grad}


@pairs_with("norm_sq", compute_embedding_norm_sq_sample)
def embedding_factors(
    layer: nn.Embedding, activations: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, Factors]:
    """``weight``: ``Σ_t e_{i_t} g_tᵀ`` as ``(ids, g)`` (see :class:`Factors`), ``g`` zero at
    ``padding_idx`` and divided by the per-sample frequency with ``scale_grad_by_freq``."""
    if not wants_grad(layer.weight):
        return {}
    b = backprops.shape[0]
    ids = activations[0].reshape(b, -1)
    values = backprops.reshape(b, ids.shape[1], layer.embedding_dim)
    if layer.padding_idx is not None:
        values = torch.where((ids != layer.padding_idx).unsqueeze(-1), values, 0.0)
    if layer.scale_grad_by_freq:
        sample_of = torch.arange(b, device=ids.device)[:, None] * layer.num_embeddings
        group, counts = _pair_groups((sample_of + ids).reshape(-1))
        values = values / counts.to(values.dtype)[group].view(ids.shape).unsqueeze(-1)
    return {layer.weight: Factors(v=values, ids=ids)}


def compute_embeddingbag_norm_sq_sample(
    layer: nn.EmbeddingBag, activations: Sequence, backprops: torch.Tensor
) -> ParamDict:
    """Squared per-bag norms of ``nn.EmbeddingBag`` (modes ``"sum"``/``"mean"``) gradients,
    without the ``(B, V, d)`` per-sample gradient. Inputs as for the EmbeddingBag grad sampler."""
    if not wants_grad(layer.weight):
        return {}
    if layer.mode not in ("sum", "mean"):
        raise NotImplementedError(
            f"EmbeddingBag(mode={layer.mode!r}) has no per-sample gradient; use 'sum' or 'mean'."
        )
    if layer.scale_grad_by_freq:
        raise NotImplementedError(_BAG_FREQ)
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
        False,
    )
    out = backprops.new_zeros(b).index_add_(0, row_bag, sq_sum(rows, 1))
    return {layer.weight: out}

class _EmbeddingNoGrad(torch.autograd.Function):
    """``F.embedding`` whose backward computes nothing (indices have no gradient)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
        return F.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)

    @staticmethod
    def backward(ctx, g):
        return (None,) * 7


def embedding_input_grad_only(layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``layer(ids)`` with no gradient for the weight (the indices have none either)."""
    return _EmbeddingNoGrad.apply(
        ids, layer.weight, layer.padding_idx, layer.max_norm, layer.norm_type,
        layer.scale_grad_by_freq, layer.sparse,
    )


def _always(layer: nn.Module, activations: Sequence, backprops: torch.Tensor) -> bool:
    return True


def _frequency_over_the_batch(layer: nn.Embedding) -> str | None:
    if layer.scale_grad_by_freq and layer.weight.requires_grad:
        return (
            "scale_grad_by_freq=True divides each row's gradient by the index's frequency in the "
            "whole batch, so one sample's contribution depends on the others"
        )
    return None


EMBEDDING_RULE = register_layer_rule(
    nn.Embedding,
    LayerRule(
        grad_sample=compute_embedding_grad_sample,
        norm_sq=compute_embedding_norm_sq_sample,
        clipped_sum=embedding_clipped_sum,
        input_grad_only=embedding_input_grad_only,
        prefer_ghost=_always,
        factors=embedding_factors,
        batch_grad_not_a_sum=_frequency_over_the_batch,
    ),
)
EMBEDDING_BAG_RULE = register_layer_rule(
    nn.EmbeddingBag,
    LayerRule(
        grad_sample=compute_embeddingbag_grad_sample,
        norm_sq=compute_embeddingbag_norm_sq_sample,
        prefer_ghost=_always,
        generic={
            "clipped_sum": "recomputing the bag sum and one vector-Jacobian product is as cheap",
            "input_grad_only": "autograd's weight gradient is zeroed by a tensor hook",
        },
    ),
)
