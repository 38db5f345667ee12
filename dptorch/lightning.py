"""Opacus's ``opacus.lightning`` path: :class:`DPLightningDataModule` (Lightning 2.x, the
``lightning`` and ``pytorch_lightning`` namespaces alike), and :class:`DPCallback`, which makes
a whole ``LightningModule`` private. Both live in :mod:`dptorch.integrations.lightning`.

Needs Lightning: ``pip install "dptorch[lightning]"`` (an ``ImportError`` says so otherwise).
"""

from .integrations.lightning import DPCallback, DPLightningDataModule

__all__ = ["DPCallback", "DPLightningDataModule"]
