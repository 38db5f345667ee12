"""The ``torch.func`` recompute of a layer must be the forward call that ran.

A layer without a grad sampler gets its per-sample gradients from ``torch.func``, which calls the
layer's forward a second time, in the backward pass (:mod:`dptorch.grad_sample.functorch`). That
is exact only if the second call computes what the first computed, which a *stateful* forward
breaks: ``torch.nn.utils.parametrizations.spectral_norm`` in training mode runs one more power
iteration on its ``_u`` / ``_v`` buffers, a schedule kept in a child module's buffer advances, a
Python counter is incremented. The recompute then differentiates another function than the
forward: the per-sample gradients are wrong (hooks, functorch, bk), and ghost clipping, which
takes its norms from them and its released gradient from the real graph, releases more than the
clipping bound.

A static rule ("a trainable layer without a grad sampler must have no buffers", Opacus's) cannot
tell a state the forward changes from a constant one, and would refuse exact cases
(``parametrizations.orthogonal`` keeps a constant ``base`` buffer). The check here is exact and
cheap instead: :func:`recompute_guard` records, before the recompute, the identity and version
counter of every buffer and tensor attribute, and the value of every number attribute, of the
layer and all its submodules (parametrizations included); any change made by the recompute means
the forward changes state, and the step is refused (``ValueError`` naming the layer and the
attribute) before anything is released. Attributes the recompute reassigned are put back (no
tensor of ``torch.func`` leaks into the model). A tensor attribute that carries a gradient (an
auxiliary loss or an attention map kept on the module by the forward) is a cache of the forward's
graph, not state: it is put back without a refusal (whether the loss uses it is checked by
:mod:`dptorch.grad_sample.escapes`). An in-place update inside the recompute, which ``torch.func``
refuses with a ``RuntimeError``, gives the same ``ValueError``.

The same guard lets sparse embeddings (``nn.Embedding(sparse=True)``) be recomputed: their
``sparse`` flag is off during the recompute, which gives the same (dense) per-sample gradient.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

__all__ = ["recompute_guard"]

#: attributes every ``nn.Module`` has (``training``, its parameter, buffer and hook dictionaries)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_MISSING = object()


def _snapshot(layer: nn.Module) -> list[tuple]:
    """``(module, path, kind, key, value, version)`` for every buffer, tensor attribute and
    number attribute of ``layer`` and its submodules."""
    entries = []
    for path, m in layer.named_modules():
        for k, b in m._buffers.items():
            entries.append((m, path, "buffer", k, b, None if b is None else b._version))
        for k, v in m.__dict__.items():
            if k in _MODULE_INTERNALS:
                continue
            if isinstance(v, torch.Tensor):
                entries.append((m, path, "attribute", k, v, v._version))
            elif isinstance(v, (int, float)):  # bool included
                entries.append((m, path, "attribute", k, v, None))
    return entries


def _restore(entries: list[tuple]) -> list[str]:
    """Puts back what the recompute reassigned; returns the state it changed (``path.key``)."""
    changed = []
    for m, path, kind, k, old, version in entries:
        store = m._buffers if kind == "buffer" else m.__dict__
        cur = store.get(k, _MISSING)
        name = f"{path}.{k}" if path else k
        if isinstance(old, torch.Tensor):
            if cur is not old:
                store[k] = old
                if kind == "buffer" or not old.requires_grad:
                    changed.append(f"{name} ({kind} reassigned)")
            elif old._version != version:
                changed.append(f"{name} ({kind} updated in place)")
        elif cur is not old and (cur is _MISSING or cur != old):
            store[k] = old
            changed.append(f"{name} ({kind} changed)")
    return changed


def _message(label: str, changed: list[str], error: Exception | None = None) -> str:
    text = f"{error} {error.__cause__}" if error is not None else ""
    op = re.search(r"in-place operation \(([^)]*)\)", text)
    what = f" ({', '.join(changed[:4])})" if changed else (
        f" (an in-place update{f' ({op.group(1)})' if op else ''} of a buffer or attribute)"
    )
    return (
        f"{label}: its forward changes the layer's state{what}. This layer has no grad sampler, "
        "so dptorch gets its per-sample gradients by calling its forward again with torch.func "
        "in the backward pass, and that second call sees (and makes) another state than the "
        "forward did (torch.nn.utils.parametrizations.spectral_norm in training mode runs one "
        "more power iteration): its per-sample gradients would not be those of the released "
        "gradient. Fix: keep such state out of trainable layers' forward (update it between "
        "steps), freeze the layer, or register a grad sampler for it "
        "(dptorch.grad_sample.register_grad_sampler), which works from the forward's own "
        "activations. For spectral_norm: put the parametrization in eval mode during the step "
        "(layer.parametrizations.weight[0].eval() after model.train()), which keeps u and v "
        "fixed, and run the power iterations between steps."
    )


@contextlib.contextmanager
def recompute_guard(layer: nn.Module, label: str):
    """Runs a ``torch.func`` recompute of ``layer`` (named ``label`` in messages): sparse
    embeddings are recomputed dense, and ``ValueError`` is raised if the recompute changed the
    layer's state (see the module docstring)."""
    sparse = [
        m for m in layer.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    for m in sparse:
        m.sparse = False
    error, entries, changed = None, None, []
    try:
        entries = _snapshot(layer)
        try:
            yield
        except (RuntimeError, ValueError) as e:  # torch.func's error, or a message wrapping it
            if not any("mutate a captured Tensor" in str(x) for x in (e, e.__cause__)):
                raise
            error = e
    finally:  # also when the recompute failed: nothing of torch.func stays in the model
        if entries is not None:
            changed = _restore(entries)
        for m in sparse:
            m.sparse = True
    if changed or error is not None:
        raise ValueError(_message(label, changed, error)) from error
