"""Which modules own which trainable parameters ("units" that get a per-sample-gradient hook)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.nn.utils import parametrize


def unit_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters owned by ``module`` itself, including the originals of its parametrizations
    (``parametrizations.weight.original``), named relative to ``module``."""
    own = list(module.named_parameters(recurse=False))
    if parametrize.is_parametrized(module):
        own += [
            (f"parametrizations.{n}", p) for n, p in module.parametrizations.named_parameters()
        ]
    return own


def trainable_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` for every module owning at least one parameter with ``requires_grad``.

    Parametrization containers are folded into the module they parametrize.
    """
    for name, m in model.named_modules():
        if "parametrizations" in name.split("."):
            continue
        if any(p.requires_grad for _, p in unit_parameters(m)):
            yield name, m
