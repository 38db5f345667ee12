"""Errors reported by :class:`dptorch.validators.ModuleValidator` (same hierarchy as Opacus)."""

from __future__ import annotations


class UnsupportedError(ValueError):
    """Base class of every validation error."""


class UnsupportedModuleError(UnsupportedError):
    """A module cannot be trained with differential privacy as it is."""


class UnsupportableModuleError(UnsupportedModuleError):
    """A module that can never get exact per-sample gradients (freeze or remove it)."""


class NotYetSupportedModuleError(UnsupportedModuleError):
    """A module dptorch could support but does not yet."""


class ShouldReplaceModuleError(UnsupportedModuleError):
    """A module that has a privacy-safe replacement (``ModuleValidator.fix`` applies it)."""


class IllegalModuleConfigurationError(UnsupportedModuleError):
    """A supported module in a configuration that breaks privacy (``fix`` changes it)."""
