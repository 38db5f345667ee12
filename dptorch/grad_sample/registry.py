"""Registries of per-layer per-sample-gradient and per-sample-norm functions.

A *grad sampler* is ``fn(layer, activations, backprops) -> {param: grad_sample}`` where
``activations`` is the list of the layer's positional forward inputs (batch dimension first),
``backprops`` is the gradient of the loss with respect to the layer's output (batch first, already
rescaled for ``loss_reduction``), and each returned tensor has shape ``(B, *param.shape)``.

A *norm sampler* has the same signature and returns per-sample gradient norms ``{param: (B,)}``
(``register_norm_sampler``, Opacus's convention); ``NORM_SAMPLERS`` stores them squared
(``register_norm_sq_sampler``). Fast (ghost/bk) clipping uses them to avoid materialising
per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

GradSamplerFn = Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], dict]

GRAD_SAMPLERS: dict[type, GradSamplerFn] = {}
NORM_SAMPLERS: dict[type, GradSamplerFn] = {}


def _register(table: dict, target_class_or_classes: type | Iterable[type]):
    def decorator(f):
        targets = (
            target_class_or_classes
            if isinstance(target_class_or_classes, Iterable)
            else [target_class_or_classes]
        )
        for t in targets:
            table[t] = f
        return f

    return decorator


def register_grad_sampler(target_class_or_classes: type | Iterable[type]):
    """Decorator: register ``f(layer, activations, backprops)`` as the grad sampler of a layer type.

    Lookup is by exact type, so a subclass needs its own registration.
    """
    return _register(GRAD_SAMPLERS, target_class_or_classes)


def register_norm_sampler(target_class_or_classes: type | Iterable[type]):
    """Decorator (Opacus convention): register ``f(layer, activations, backprops)`` returning the
    per-sample gradient *norms* ``{param: (B,)}`` of a layer type, for the fast-clipping modes
    (``grad_sample_mode="ghost"``/``"bk"``). Stored squared (see :func:`register_norm_sq_sampler`).
    """

    def decorator(f):
        def squared(layer, activations, backprops):
            return {p: n.pow(2) for p, n in f(layer, activations, backprops).items()}

        squared.__wrapped__ = f
        _register(NORM_SAMPLERS, target_class_or_classes)(squared)
        return f

    return decorator


def register_norm_sq_sampler(target_class_or_classes: type | Iterable[type]):
    """Decorator: register ``f(layer, activations, backprops)`` returning *squared* per-sample
    norms ``{param: (B,)}`` (what dptorch's own samplers compute: no square root to undo)."""
    return _register(NORM_SAMPLERS, target_class_or_classes)
