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


#: module classes whose traversal is nn.Module's own (see :func:`_plain_traversal`)
_PLAIN_TRAVERSAL: set[type] = set()
_TRAVERSAL_METHODS = ("parameters", "named_parameters", "_named_members", "named_modules")


def _plain_traversal(cls: type) -> bool:
    """Whether ``cls`` neither overrides how ``nn.Module`` enumerates parameters and submodules
    nor how modules compare (``named_modules`` deduplicates them by hash): then walking the
    ``_modules`` / ``_parameters`` dicts gives exactly what ``parameters()`` gives."""
    if cls in _PLAIN_TRAVERSAL:
        return True
    plain = all(getattr(cls, n) is getattr(nn.Module, n) for n in _TRAVERSAL_METHODS) and (
        cls.__hash__ is nn.Module.__hash__ and cls.__eq__ is nn.Module.__eq__
    )
    if plain:
        _PLAIN_TRAVERSAL.add(cls)
    return plain


def module_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``list(model.parameters())``: every parameter of ``model`` and its submodules, each once,
    in the same order.

    Per-step checks enumerate the parameters at every forward pass and step; this walks the
    modules' ``_modules`` and ``_parameters`` dicts directly (the same pre-order, the same
    deduplication of modules and parameters), without the generators and the name strings of
    ``named_modules``. A module class that overrides any of that gets ``model.parameters()``.
    """
    modules: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> None:
        modules[id(m)] = m
        for child in m._modules.values():
            if child is not None and id(child) not in modules:
                visit(child)

    visit(model)
    plain = _PLAIN_TRAVERSAL
    params: dict[int, nn.Parameter] = {}
    for m in modules.values():
        if type(m) not in plain and not _plain_traversal(type(m)):
            return list(model.parameters())
        for p in m._parameters.values():
            if p is not None:
                params.setdefault(id(p), p)
    return list(params.values())


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``list(module.parameters(recurse=False))``, read from ``module._parameters`` directly
    when the class does not override the traversal."""
    if not _plain_traversal(type(module)):
        return list(module.parameters(recurse=False))
    out: list[nn.Parameter] = []
    for p in module._parameters.values():
        if p is not None and all(p is not q for q in out):
            out.append(p)
    return out


def trainable_signature(model: nn.Module) -> tuple[int, ...]:
    """For each submodule of ``model`` that registers trainable parameters itself: its id, then
    theirs. It changes when a parameter is frozen or unfrozen, when a trainable parameter is
    added, removed or replaced, and when a module registering an already trainable parameter
    is added (a tied copy of a layer: it needs hooks of its own). Module and parameter ids
    cannot be confused: they are ids of distinct live objects."""
    out: list[int] = []
    seen: set[int] = set()
    plain = _PLAIN_TRAVERSAL

    def visit(m: nn.Module) -> bool:  # pre-order, as named_modules; False: not plain
        seen.add(id(m))
        if type(m) not in plain and not _plain_traversal(type(m)):
            return False
        owner = True
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                if owner:
                    out.append(id(m))
                    owner = False
                out.append(id(p))
        for c in m._modules.values():
            if c is not None and id(c) not in seen and not visit(c):
                return False
        return True

    if visit(model):
        return tuple(out)
    out.clear()
    for m in model.modules():
        own = [id(p) for p in m.parameters(recurse=False) if p.requires_grad]
        if own:
            out += [id(m), *own]
    return tuple(out)
