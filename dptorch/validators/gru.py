"""``nn.GRU`` rules (Opacus module path ``validators.gru``); see :mod:`.recurrent`."""

from __future__ import annotations

from torch import nn

from . import recurrent
from .errors import UnsupportedModuleError

__all__ = ["fix", "validate"]


def validate(module: nn.GRU) -> list[UnsupportedModuleError]:
    """``nn.GRU`` has no per-sample gradients: asks for ``DPGRU`` if it is trainable."""
    return recurrent.validate(module)


def fix(module: nn.GRU) -> nn.Module:
    """The equivalent ``dptorch.layers.DPGRU`` with the same weights."""
    return recurrent.fix(module)
