"""Model adapters: small per-instance rewrites that make a known model's default forward give
exact per-sample gradients without any change to the user's model code.

An adapter is a ``(predicate, install)`` pair: ``install(module)`` patches that one instance
(instance attributes only, never the class) and returns a function that undoes it.
:func:`install_adapters` applies every matching adapter to a model; ``GradSampleModule`` calls it
when wrapping and undoes it in ``to_standard_module()`` / ``cleanup()``.

T5-style relative attention bias (T5, mT5, UMT5, LongT5 — full, local and transient-global
attention —, Switch Transformers, UDOP, Pix2Struct, Pop2Piano): ``compute_bias`` looks the bias
up in an ``nn.Embedding`` (``relative_attention_bias``) with a bucket index built from the
sequence length (``[q, k]``) and returns it with a leading batch axis of size 1 (``[1, H, q, k]``;
LongT5's blocked attention ``[1, 1, H, l, 3l]``), broadcast over the batch. The lookup's output
has no batch axis, so no hook can split the gradient of the table per sample. The adapter
computes the bias per sample instead: the same bucket index, expanded to the batch ``B`` of the
current ``forward`` call, gives ``[B, H, q, k]`` (``[B, 1, H, l, 3l]``), equal to the original
bias broadcast to ``B``, whose row ``b`` only reaches sample ``b``'s attention scores.

MPNet (``MPNetEncoder.compute_position_bias``): the same lookup, expanded to the batch after
it; adapted the same way.

The bucket index is not recomputed here: the model's own method runs once with the table
replaced by a probe that returns the index (:class:`_BucketProbe`), so each model's bucketing
and layout are used as they are.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from .use_trace import mark_batched

__all__ = ["ADAPTERS", "install_adapters", "register_adapter"]

Remove = Callable[[], None]

#: ``(predicate(module) -> bool, install(module) -> remove)`` pairs, tried in order
ADAPTERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Remove]]] = []

#: instance attribute of an adapted T5 attention: the batch sizes of the forward calls in progress
_BATCH = "_dptorch_relative_bias_batch"


def register_adapter(predicate: Callable[[nn.Module], bool]):
    """Decorator: registers ``install(module) -> remove`` for the modules ``predicate`` accepts."""

    def deco(install: Callable[[nn.Module], Remove]) -> Callable[[nn.Module], Remove]:
        ADAPTERS.append((predicate, install))
        return install

    return deco


def install_adapters(model: nn.Module) -> list[Remove]:
    """Installs the first matching adapter on every submodule of ``model`` (itself included);
    returns the removers, to be called to restore the model."""
    removers = []
    for m in model.modules():
        for predicate, install in ADAPTERS:
            if predicate(m):
                removers.append(install(m))
                break
    return removers


# ----------------------------------------------------------------------------- bias tables
class _BucketProbe(nn.Module):
    """Stands in for the bias table during one bias computation: for a bucket index ``idx`` of
    shape ``S`` it returns ``idx`` repeated along a new last axis of length
    ``marker = max(S) + 2`` (``[*S, marker]``, long), where the real table returns ``[*S, H]``.
    The model's own code then lays it out as it would the bias (permute, unsqueeze, expand):
    the only axis of length ``marker`` shows where the heads went."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        # what the model may read off its table (LongT5 reads ``weight.device``), unregistered
        for name in ("weight", "num_embeddings", "embedding_dim", "padding_idx"):
            object.__setattr__(self, name, getattr(table, name))
        self.index_shapes: list[torch.Size] = []
        self.marker = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.index_shapes.append(idx.shape)
        self.marker = max(idx.shape, default=0) + 2
        return idx.unsqueeze(-1).expand(*idx.shape, self.marker)


def _bucket_layout(
    module: nn.Module, method: str, args: tuple, kwargs: dict, batch: int
) -> tuple[torch.Tensor, int] | None:
    """Runs the class's ``method(*args, **kwargs)`` (which looks the bias up in
    ``module.relative_attention_bias``) with the table replaced by a :class:`_BucketProbe`.
    Returns ``(bucket, head_axis)``: the bucket index in the layout of the bias without its head
    axis, leading axis of size 1 or ``batch`` (e.g. ``[1, q, k]``), and the position of the head
    axis in the bias (e.g. 1 for ``[1, H, q, k]``); ``None`` when the layout is not recognised
    (one lookup, one axis of the probe's length, a leading batch axis)."""
    table = module.relative_attention_bias
    probe = _BucketProbe(table)
    module._modules["relative_attention_bias"] = probe
    try:
        with torch.no_grad():
            laid_out = getattr(type(module), method)(module, *args, **kwargs)
    finally:
        module._modules["relative_attention_bias"] = table
    if len(probe.index_shapes) != 1 or not isinstance(laid_out, torch.Tensor):
        return None
    axes = [d for d, n in enumerate(laid_out.shape) if n == probe.marker]
    if len(axes) != 1:
        return None
    bucket = laid_out.select(axes[0], 0).long()
    if (
        bucket.dim() == 0
        or bucket.shape[0] not in (1, batch)
        or bucket[0].numel() != probe.index_shapes[0].numel()
    ):
        return None
    return bucket, axes[0]


def _per_sample_bias(
    module: nn.Module, method: str, args: tuple, kwargs: dict, batch: int
) -> torch.Tensor:
    """``module.method(*args, **kwargs)`` computed per sample: the bias ``[1, H, q, k]``
    (whatever the layout) becomes ``[B, H, q, k]``, ``B = batch``, each row looked up in
    ``module.relative_attention_bias`` with the bucket index expanded to the batch; equal to
    the original broadcast to ``B``. The class's method runs when the layout is not recognised
    (the use trace then refuses the shared lookup)."""
    layout = _bucket_layout(module, method, args, kwargs, batch)
    if layout is None:
        return getattr(type(module), method)(module, *args, **kwargs)
    bucket, head_axis = layout
    index = mark_batched(bucket.expand(batch, *bucket.shape[1:]))  # [B, q, k]
    values = module.relative_attention_bias(index)  # [B, q, k, H]
    return values.movedim(-1, head_axis)  # [B, H, q, k]


def _remover(module: nn.Module, *names: str) -> Remove:
    def remove() -> None:
        for name in names:
            module.__dict__.pop(name, None)

    return remove


# ----------------------------------------------------------------------------- T5 family
def _is_t5_relative_attention(m: nn.Module) -> bool:
    """T5-style attention that owns a relative-position bias table, not yet adapted."""
    return (
        bool(getattr(m, "has_relative_attention_bias", False))
        and isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
        and callable(getattr(type(m), "compute_bias", None))
        and "compute_bias" not in m.__dict__
        and "forward" not in m.__dict__
    )


def _t5_forward(attn: nn.Module, *args, **kwargs):
    """``attn.forward`` with the batch size of ``hidden_states`` (first argument) recorded for
    :func:`_t5_compute_bias`."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    batch = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() else 1
    attn.__dict__[_BATCH].append(batch)
    try:
        return type(attn).forward(attn, *args, **kwargs)
    finally:
        attn.__dict__[_BATCH].pop()


def _t5_compute_bias(attn: nn.Module, *args, **kwargs) -> torch.Tensor:
    """The bias of each sample, ``[B, H, q, k]`` (LongT5's blocked attention ``[B, 1, H, l, 3l]``),
    ``B`` the batch of the ``attn.forward`` call in progress; equal to the class's
    ``compute_bias`` (``[1, H, q, k]``) broadcast to ``B``. Outside a forward call the class's
    ``compute_bias`` runs."""
    stack = attn.__dict__[_BATCH]
    if not stack:
        return type(attn).compute_bias(attn, *args, **kwargs)
    return _per_sample_bias(attn, "compute_bias", args, kwargs, stack[-1])


@register_adapter(_is_t5_relative_attention)
def _adapt_t5_attention(attn: nn.Module) -> Remove:
    """Overrides, on the instance ``attn`` only, ``forward`` (records the batch size) and
    ``compute_bias`` (:func:`_t5_compute_bias`). Bound methods, so that a deep copy of the model
    is adapted by itself. The remover deletes the instance attributes."""
    attn.__dict__[_BATCH] = []
    attn.forward = types.MethodType(_t5_forward, attn)
    attn.compute_bias = types.MethodType(_t5_compute_bias, attn)
    return _remover(attn, "forward", "compute_bias", _BATCH)


# ----------------------------------------------------------------------------- MPNet
def _is_mpnet_encoder(m: nn.Module) -> bool:
    """MPNet's encoder: ``compute_position_bias(x)`` looks a ``[q, k]`` bucket index up in
    ``relative_attention_bias`` and expands the result to the batch of ``x``."""
    return (
        isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
        and callable(getattr(type(m), "compute_position_bias", None))
        and "compute_position_bias" not in m.__dict__
    )


def _mpnet_position_bias(encoder: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``[B, H, q, k]``, ``B = x.shape[0]``: each sample's bias looked up with its own copy of
    the bucket index (the class looks it up once and expands the result)."""
    return _per_sample_bias(encoder, "compute_position_bias", (x, *args), kwargs, x.shape[0])


@register_adapter(_is_mpnet_encoder)
def _adapt_mpnet_encoder(encoder: nn.Module) -> Remove:
    """Overrides ``compute_position_bias`` on the instance (:func:`_mpnet_position_bias`)."""
    encoder.compute_position_bias = types.MethodType(_mpnet_position_bias, encoder)
    return _remover(encoder, "compute_position_bias")
