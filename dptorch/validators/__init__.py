"""Model validation and automatic fixing for differentially private training."""

from . import batch_norm, gru, instance_norm, lstm, multihead_attention, recurrent  # noqa: F401,I001  (rules)
from .errors import (
    IllegalModuleConfigurationError,
    NotYetSupportedModuleError,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    UnsupportedError,
    UnsupportedModuleError,
)
from .module_validator import ModuleValidator
from .utils import register_module_fixer, register_module_validator

__all__ = [
    "ModuleValidator",
    "register_module_validator",
    "register_module_fixer",
    "UnsupportedError",
    "UnsupportedModuleError",
    "UnsupportableModuleError",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "IllegalModuleConfigurationError",
]
