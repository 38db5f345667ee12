"""Model adapters: small per-instance rewrites that make a known model's default forward give
exact per-sample gradients without any change to the user's model code.

An adapter is a ``(predicate, install)`` pair: ``install(module)`` patches that one instance
(instance attributes only, never the class) and returns a function that undoes it.
:func:`install_adapters` applies every matching adapter to a model; ``GradSampleModule`` calls it
when wrapping and undoes it in ``to_standard_module()`` / ``cleanup()``.

T5-style relative attention bias (T5, mT5, UMT5, LongT5 local attention, Switch/Pop2Piano
copies): ``compute_bias`` looks the bias up in an ``nn.Embedding`` with a ``[q, k]`` bucket
index and returns ``[1, H, q, k]``, broadcast over the batch. No hook can split the gradient
of a shared lookup per sample, so the adapter computes it per sample: the bucket index expanded
to ``[B, q, k]`` gives a ``[B, H, q, k]`` bias, equal to the original broadcast to ``B``, whose
rows each reach one sample's scores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ADAPTERS", "install_adapters", "register_adapter"]

Remove = Callable[[], None]

#: ``(predicate(module) -> bool, install(module) -> remove)`` pairs, tried in order
ADAPTERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Remove]]] = []


def register_adapter(predicate: Callable[[nn.Module], bool]):
    """Decorator: registers ``install(module) -> remove`` for the modules ``predicate`` accepts."""

    def deco(install: Callable[[nn.Module], Remove]) -> Callable[[nn.Module], Remove]:
        ADAPTERS.append((predicate, install))
        return install

    return deco


def install_adapters(model: nn.Module) -> list[Remove]:
    """Installs every matching adapter on the submodules of ``model``; returns the removers."""
    removers = []
    for m in model.modules():
        for predicate, install in ADAPTERS:
            if predicate(m):
                removers.append(install(m))
                break
    return removers


# ----------------------------------------------------------------------------- T5 relative bias
def _is_t5_relative_attention(m: nn.Module) -> bool:
    return (
        bool(getattr(m, "has_relative_attention_bias", False))
        and isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
        and callable(getattr(m, "_relative_position_bucket", None))
        and callable(getattr(m, "compute_bias", None))
        and hasattr(m, "relative_attention_num_buckets")
        and hasattr(m, "relative_attention_max_distance")
        and "compute_bias" not in m.__dict__
    )


@register_adapter(_is_t5_relative_attention)
def _per_sample_relative_bias(attn: nn.Module) -> Remove:
    """``attn.compute_bias`` returns ``[B, H, q, k]``: the bias of each sample, looked up with the
    bucket index expanded to the batch ``B`` of the current ``attn.forward`` call."""
    batch: list[int] = []

    def forward(hidden_states, *args, **kwargs):
        batch.append(hidden_states.shape[0])
        try:
            return type(attn).forward(attn, hidden_states, *args, **kwargs)
        finally:
            batch.pop()

    def compute_bias(query_length, key_length, device=None, past_seen_tokens=0,
                     cache_position=None, **_):
        emb = attn.relative_attention_bias
        device = emb.weight.device if device is None else device
        if cache_position is not None:
            context = cache_position.to(device)[:, None]
        else:
            context = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
            context = context + past_seen_tokens
        memory = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        bucket = attn._relative_position_bucket(
            memory - context,
            bidirectional=not attn.is_decoder,
            num_buckets=attn.relative_attention_num_buckets,
            max_distance=attn.relative_attention_max_distance,
        )  # [q, k]
        b = batch[-1] if batch else 1
        values = emb(bucket.expand(b, *bucket.shape))  # [B, q, k, H]
        return values.permute(0, 3, 1, 2)  # [B, H, q, k]

    attn.forward = forward
    attn.compute_bias = compute_bias

    def remove() -> None:
        for name in ("forward", "compute_bias"):
            attn.__dict__.pop(name, None)

    return remove
