"""Small helpers about modules and their parameters (Opacus ``opacus.utils.module_utils`` API)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "are_state_dict_equal",
    "clone_module",
    "get_submodule",
    "has_trainable_params",
    "parametrized_modules",
    "requires_grad",
    "trainable_modules",
    "trainable_parameters",
]


def has_trainable_params(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its children) owns a parameter with ``requires_grad``."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


def requires_grad(module: nn.Module, *, recurse: bool = False) -> bool:
    """Whether some parameter of ``module`` requires a gradient.

    Only the module's own parameters are looked at unless ``recurse=True``.
    """
    return any(p.requires_grad for p in module.parameters(recurse=recurse))


def parametrized_modules(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``(name, submodule)`` for every submodule (``module`` included) that owns parameters."""
    for name, m in module.named_modules():
        if next(m.parameters(recurse=False), None) is not None:
            yield name, m


def trainable_modules(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``(name, submodule)`` for every submodule that owns a parameter with ``requires_grad``."""
    for name, m in parametrized_modules(module):
        if requires_grad(m):
            yield name, m


def trainable_parameters(module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``module`` with ``requires_grad``."""
    for name, p in module.named_parameters():
        if p.requires_grad:
            yield name, p


def clone_module(module: nn.Module) -> nn.Module:
    """An independent copy of ``module`` (parameters, buffers and Python attributes).

    The copy goes through ``torch.save``/``torch.load`` in memory, so it lands on the same
    devices and shares no storage with the original.
    """
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def get_submodule(module: nn.Module, target: str) -> nn.Module:
    """The submodule at dotted path ``target`` (``""`` is ``module`` itself).

    Raises ``AttributeError`` naming the missing component, like ``nn.Module.get_submodule``.
    """
    if target == "":
        return module
    current = module
    walked: list[str] = []
    for part in target.split("."):
        child = current._modules.get(part) if isinstance(current, nn.Module) else None
        if child is None:
            where = ".".join(walked) or type(module).__name__
            raise AttributeError(f"{where} has no submodule named {part!r} (path {target!r})")
        current = child
        walked.append(part)
    return current


def are_state_dict_equal(sd1: Mapping[str, torch.Tensor], sd2: Mapping[str, torch.Tensor]) -> bool:
    """Whether two state dicts have the same keys and (numerically close) equal-shape values.

    Each difference is logged at INFO level.
    """
    equal = True
    for key in sorted(set(sd1) | set(sd2)):
        if key not in sd1 or key not in sd2:
            logger.info("state dict key %r present in only one of the two", key)
            equal = False
            continue
        a, b = sd1[key], sd2[key]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if a != b:
                logger.info("state dict entry %r differs: %r vs %r", key, a, b)
                equal = False
            continue
        if a.shape != b.shape:
            logger.info("state dict entry %r: shape %s vs %s", key, tuple(a.shape), tuple(b.shape))
            equal = False
        elif not torch.allclose(a.to(b.device), b, equal_nan=True):
            logger.info("state dict entry %r: values differ", key)
            equal = False
    return equal
