"""``nn.LSTM`` rules (Opacus module path ``validators.lstm``); see :mod:`.recurrent`."""

from __future__ import annotations

from torch import nn

from . import recurrent
from .errors import UnsupportedModuleError

__all__ = ["fix", "validate"]


def validate(module: nn.LSTM) -> list[UnsupportedModuleError]:
    """``nn.LSTM`` has no per-sample gradients: asks for ``DPLSTM`` if it is trainable."""
    return recurrent.validate(module)


def fix(module: nn.LSTM) -> nn.Module:
    """The equivalent ``dptorch.layers.DPLSTM`` with the same weights."""
    return recurrent.fix(module)
