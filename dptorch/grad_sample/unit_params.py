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


def sampled_parameters(model: nn.Module) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """``{id(module): [(name, p), ...]}``: the trainable parameters whose per-sample gradients
    each module's hook computes, for every module of ``model`` that has some.

    A module samples the parameters it owns (:func:`unit_parameters`), except those that one of
    its descendants also owns: a Parameter registered in a parent and in its child (BERT's MLM
    head ``bias`` is ``decoder.bias``) is sampled once, where the child uses it. A Parameter
    owned by two unrelated modules (tied weights) is sampled by each, for its own calls, and the
    results add up. Duplicate registrations within one module count once.
    """
    below: dict[int, set[int]] = {}

    def subtree(m: nn.Module) -> set[int]:
        ids: set[int] = set()
        for cname, child in m.named_children():
            if cname == "parametrizations" and parametrize.is_parametrized(m):
                continue  # folded into ``m``: its originals are ``m``'s own
            if id(child) not in below:
                subtree(child)
            ids |= below[id(child)]
            ids |= {id(p) for _, p in unit_parameters(child)}
        below[id(m)] = ids
        return ids

    subtree(model)
    out: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, m in model.named_modules():
        if "parametrizations" in name.split("."):
            continue
        seen: set[int] = set()
        own = []
        for n, p in unit_parameters(m):
            if p.requires_grad and id(p) not in below.get(id(m), ()) and id(p) not in seen:
                seen.add(id(p))
                own.append((n, p))
        if own:
            out[id(m)] = own
    return out


def trainable_signature(model: nn.Module) -> tuple[int, ...]:
    """Ids of ``model``'s trainable parameters: it changes when one is frozen or unfrozen."""
    return tuple(id(p) for p in model.parameters() if p.requires_grad)
