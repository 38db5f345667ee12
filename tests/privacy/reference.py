"""Brute-force reference for DP-SGD: per-sample gradients one sample at a time, in float64.

Independent of dptorch: a float64 copy of the model is run on each sample alone (the inputs
sliced along dimension 0, dimensions kept) and ``torch.autograd.grad`` of that sample's loss
(reduction ``"sum"``) gives its gradient with respect to every trainable parameter. Parameters
are keyed by their name in ``named_parameters()``, which lists a tied parameter once (under its
first name), so a shared weight gets one gradient summing all its uses.

From those, the reference DP update with noise 0: each sample's whole gradient (all parameters
together) is scaled by ``min(1, C / (norm + 1e-6))`` and the results are summed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: ``loss_fn(model_output, labels, reduction) -> loss``
LossFn = Callable[[Any, torch.Tensor, str], torch.Tensor]


@dataclass
class Reference:
    """``grads``: ``{name: (B, *p.shape)}`` per-sample gradients; ``norms``: ``(B,)`` norms of
    the per-sample gradients over all parameters; ``factors``: ``(B,)`` clip factors;
    ``clipped_sum``: ``{name: p.shape}``, ``Σ_b factors[b] · grads[name][b]``."""

    grads: dict[str, torch.Tensor]
    norms: torch.Tensor
    factors: torch.Tensor
    clipped_sum: dict[str, torch.Tensor]


def sample_of(obj: Any, b: int, batch_size: int) -> Any:
    """Sample ``b`` of ``obj``: a tensor with ``batch_size`` rows along dim 0 becomes
    ``obj[b : b + 1]`` (dimensions kept); dicts, lists and tuples are sliced entry by entry;
    anything else is returned as is."""
    if isinstance(obj, torch.Tensor):
        return obj[b : b + 1] if obj.dim() > 0 and obj.shape[0] == batch_size else obj
    if isinstance(obj, Mapping):
        return {k: sample_of(v, b, batch_size) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(sample_of(v, b, batch_size) for v in obj)
    return obj


def _to_double(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        return obj.double()
    if isinstance(obj, Mapping):
        return {k: _to_double(v) for k, v in obj.items()}
    return obj


def per_sample_grads(
    model: nn.Module,
    inputs: Mapping[str, Any],
    labels: torch.Tensor,
    loss_fn: LossFn,
) -> dict[str, torch.Tensor]:
    """``{name: (B, *p.shape)}``: for each sample ``b`` alone, the gradient of
    ``loss_fn(model(**inputs_b), labels_b, "sum")`` with respect to every trainable parameter
    (zeros where it is unused), computed on a float64 copy of ``model`` (same train/eval
    mode). ``B = labels.shape[0]``."""
    m = copy.deepcopy(model).double()
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    batch_size = labels.shape[0]
    inputs = _to_double(inputs)
    rows: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
    for b in range(batch_size):
        out = m(**sample_of(inputs, b, batch_size))
        loss = loss_fn(out, sample_of(labels, b, batch_size), "sum")
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for (n, p), g in zip(named, grads):
            rows[n].append(torch.zeros_like(p) if g is None else g.detach())
    return {n: torch.stack(r) for n, r in rows.items()}


def clip_and_sum(
    grads: Mapping[str, torch.Tensor], max_grad_norm: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Flat clipping of per-sample gradients ``{name: (B, *shape)}``: returns
    ``(clipped_sum {name: shape}, norms (B,), factors (B,))`` with ``norms[b]`` the norm of
    sample ``b``'s gradient over all parameters and
    ``factors[b] = min(1, max_grad_norm / (norms[b] + 1e-6))``."""
    sq = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
    norms = sq.sqrt()
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    clipped = {
        n: torch.einsum("b,b...->...", factors.to(g.dtype), g) for n, g in grads.items()
    }
    return clipped, norms, factors


def reference_dp(
    model: nn.Module,
    inputs: Mapping[str, Any],
    labels: torch.Tensor,
    loss_fn: LossFn,
    max_grad_norm: float,
) -> Reference:
    """The per-sample gradients (:func:`per_sample_grads`) and the noise-free DP-SGD sum of
    their flat-clipped versions (:func:`clip_and_sum`)."""
    grads = per_sample_grads(model, inputs, labels, loss_fn)
    clipped, norms, factors = clip_and_sum(grads, max_grad_norm)
    return Reference(grads, norms, factors, clipped)
