"""DP-SGD where people already train: optional integrations with training frameworks.

* :mod:`dptorch.integrations.transformers`: ``DPTrainer``, a ``transformers.Trainer`` that trains
  privately (Poisson sampling, per-sample clipping, noise, ε in the logs, accountant in the
  checkpoints), PEFT models included. Extra: ``pip install "dptorch[hf]"``.
* :mod:`dptorch.integrations.lightning`: ``DPCallback``, a Lightning callback that makes a
  ``LightningModule`` private, and ``DPLightningDataModule``. Works with the ``lightning`` and
  ``pytorch_lightning`` namespaces. Extra: ``pip install "dptorch[lightning]"``.

The core of dptorch depends on torch and numpy only; importing an integration whose framework is
missing raises an ``ImportError`` that names the extra to install. Guide: docs/integrations.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["release", "require"]


def require(extra: str, *modules: str, what: str) -> list[ModuleType]:
    """Imports ``modules`` (all of them) for ``what``, or raises ``ImportError`` naming the
    dptorch extra that installs them: ``pip install "dptorch[<extra>]"``."""
    out = []
    for name in modules:
        try:
            out.append(importlib.import_module(name))
        except ImportError as e:
            raise ImportError(
                f"{what} needs the {name!r} package, which is not installed. Install the "
                f'dptorch extra: pip install "dptorch[{extra}]" ({", ".join(modules)}).'
            ) from e
    return out


def release(dp_module: Any, dp_optimizer: Any) -> None:
    """Makes the model a plain model again after ``make_private``: gradients and per-sample
    state cleared, the GradSampleModule's hooks removed, the optimizer's clipped sums
    (``p.summed_grad``) deleted. The DP optimizer must not step again afterwards."""
    if dp_optimizer is not None:
        dp_optimizer.zero_grad(set_to_none=True)
        for p in dp_optimizer.params:
            if hasattr(p, "summed_grad"):
                del p.summed_grad
    if dp_module is not None:
        dp_module.cleanup()
