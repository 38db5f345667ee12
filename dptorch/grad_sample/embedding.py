"""Per-sample gradients of ``nn.Embedding`` and ``nn.EmbeddingBag``.

Both reduce to one ``index_add`` into the ``(B, V, d)`` result: every looked-up index ``i`` of
sample (or bag) ``b`` adds ``coef * backprops[b]`` to row ``(b, i)``, so an index used several
times counts with its multiplicity. No other ``O(B * V * d)`` buffer is allocated. As in
PyTorch's own gradient, the ``padding_idx`` row gets a zero per-sample gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .registry import register_grad_sampler


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


@register_grad_sampler(nn.Embedding)
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


@register_grad_sampler(nn.EmbeddingBag)
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
        raise NotImplementedError(
            "EmbeddingBag(scale_grad_by_freq=True) has no per-sample gradient sampler (PyTorch's "
            "own frequency scaling for bags is not a per-entry count); set it to False."
        )
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
    API); computed by the norm sampler of :mod:`dptorch.grad_sample.norm_samplers`."""
    from .norm_samplers import compute_embedding_norm_sq_sample, sample_norms

    return sample_norms(compute_embedding_norm_sq_sample(layer, activations, backprops))
