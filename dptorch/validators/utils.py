"""Decorators registering user validation / fixing rules with :class:`ModuleValidator`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .module_validator import ModuleValidator

# The validator class the decorators register with unless told otherwise (Opacus name).
DEFAULT_MODULE_VALIDATOR = ModuleValidator


def _targets(target_class_or_classes) -> list[type]:
    if isinstance(target_class_or_classes, type):
        return [target_class_or_classes]
    return list(target_class_or_classes)


def register_module_validator(
    target_class_or_classes: type | Sequence[type],
    validator_class: type | None = DEFAULT_MODULE_VALIDATOR,
) -> Callable:
    """Registers ``f(module) -> list[UnsupportedModuleError]`` as the rule for modules of exactly
    the given type(s). ``validator_class`` defaults to :class:`ModuleValidator`."""
    table = (validator_class or ModuleValidator).VALIDATORS

    def decorator(f: Callable) -> Callable:
        for t in _targets(target_class_or_classes):
            table[t] = f
        return f

    return decorator


def register_module_fixer(
    target_class_or_classes: type | Sequence[type],
    validator_class: type | None = DEFAULT_MODULE_VALIDATOR,
) -> Callable:
    """Registers ``f(module, **kwargs) -> nn.Module`` returning the replacement of a module of
    exactly the given type(s). ``validator_class`` defaults to :class:`ModuleValidator`."""
    table = (validator_class or ModuleValidator).FIXERS

    def decorator(f: Callable) -> Callable:
        for t in _targets(target_class_or_classes):
            table[t] = f
        return f

    return decorator
