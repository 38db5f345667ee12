"""Decorators registering user validation / fixing rules with :class:`ModuleValidator`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .module_validator import ModuleValidator

# The validator class the decorators register with unless told otherwise (Opacus name).
DEFAULT_MODULE_VALIDATOR = ModuleValidator


def _targets(target_class_or_classes) -> list[type]:
    if isinstance(target_class_or_classes, type):
        return [target_class_or_classes]
    return list(target_class_or_classes)


def _registering_decorator(table: dict, target_class_or_classes) -> Callable:
    """A decorator storing the decorated function in ``table`` under each target class."""

    def decorator(f: Callable) -> Callable:
        for t in _targets(target_class_or_classes):
            table[t] = f
        return f

    return decorator


def register_module_validator(
    target_class_or_classes: type | Sequence[type],
    validator_class: type | None = DEFAULT_MODULE_VALIDATOR,
) -> Callable:
    """Registers ``f(module) -> list[UnsupportedModuleError]`` as the rule for modules of exactly
    the given type(s). ``validator_class`` defaults to :class:`ModuleValidator`."""
    return _registering_decorator(
        (validator_class or ModuleValidator).VALIDATORS, target_class_or_classes
    )


def register_module_fixer(
    target_class_or_classes: type | Sequence[type],
    validator_class: type | None = DEFAULT_MODULE_VALIDATOR,
) -> Callable:
    """Registers ``f(module, **kwargs) -> nn.Module`` returning the replacement of a module of
    exactly the given type(s). ``validator_class`` defaults to :class:`ModuleValidator`."""
    return _registering_decorator(
        (validator_class or ModuleValidator).FIXERS, target_class_or_classes
    )


def copy_norm_state(old: nn.Module, new: nn.Module) -> nn.Module:
    """Gives ``new`` (a replacement normalisation layer) the affine parameters of ``old``
    (values, ``requires_grad``, device and dtype) and its training mode; returns ``new``."""
    if old.affine:
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        new.weight.requires_grad_(old.weight.requires_grad)
        new.bias.requires_grad_(old.bias.requires_grad)
        new.to(device=old.weight.device, dtype=old.weight.dtype)
    new.train(old.training)
    return new
