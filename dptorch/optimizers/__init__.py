"""DP optimizers: the clipping/noising core (DPOptimizer), its variants, and the class chooser.

``get_optimizer_class(clipping, distributed, grad_sample_mode)`` and
:func:`register_optimizer_class` are views on the mode registry (:mod:`dptorch.modes`): this
package registers the per-sample-gradient optimizers (every mode that fills ``p.grad_sample``)
and the fast-clipping ones of ``"ghost"`` and ``"bk"`` and of their FSDP2 forms
``"ghost_fsdp"`` and ``"bk_fsdp"``.
"""

from __future__ import annotations

from ..modes import optimizer_class, register_optimizer
from .adaclipoptimizer import AdaClipDPOptimizer
from .ddp_perlayeroptimizer import DistributedPerLayerOptimizer, SimpleDistributedPerLayerOptimizer
from .ddpoptimizer import DistributedDPOptimizer
from .fsdpoptimizer_fast_gradient_clipping import FSDPOptimizerFastGradientClipping
from .optimizer import DPOptimizer
from .optimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping,
    DistributedDPPerLayerOptimizerFastGradientClipping,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizerFastGradientClipping,
)
from .perlayeroptimizer import DPPerLayerOptimizer

#: Opacus 1.6 lists this misspelling in ``opacus.optimizers.__all__`` (without defining it); here
#: it names the distributed fast-gradient-clipping optimizer, so ``import *`` works
DistributedDPOptimizerFastGradientlipping = DistributedDPOptimizerFastGradientClipping

__all__ = [
    "AdaClipDPOptimizer",
    "DistributedDPOptimizer",
    "DistributedDPOptimizerFastGradientClipping",
    "DistributedDPOptimizerFastGradientlipping",
    "DistributedPerLayerOptimizer",
    "DPOptimizer",
    "DPOptimizerFastGradientClipping",
    "DPPerLayerOptimizer",
    "FSDPOptimizerFastGradientClipping",
    "SimpleDistributedPerLayerOptimizer",
    "get_optimizer_class",
    "register_optimizer_class",
]


def register_optimizer_class(
    cls: type[DPOptimizer],
    *,
    clipping: str,
    distributed: bool,
    grad_sample_mode: str | None = None,
) -> None:
    """Makes ``get_optimizer_class(clipping, distributed, grad_sample_mode)`` return ``cls``.

    ``grad_sample_mode=None`` registers ``cls`` for every mode that fills ``p.grad_sample``
    (see :func:`dptorch.modes.register_optimizer`).
    """
    register_optimizer(cls, clipping=clipping, distributed=distributed, mode=grad_sample_mode)


def get_optimizer_class(
    clipping: str, distributed: bool, grad_sample_mode: str | None = None
) -> type[DPOptimizer]:
    """The DPOptimizer class for a clipping mode (``"flat"``, ``"per_layer"``, ``"adaptive"``),
    distributed training or not, and a ``grad_sample_mode`` (its entry in :mod:`dptorch.modes`).
    Raises ``ValueError`` for an unsupported combination or an unknown mode."""
    return optimizer_class(grad_sample_mode, clipping, distributed)


# mode -> {(clipping, distributed): class}; None: every mode that fills p.grad_sample. The
# fast-clipping modes compute norms only: ghost clips flat (its second backward pass weights
# whole sample losses), bk flat or per layer.
_BUILTIN: dict[str | None, dict[tuple[str, bool], type[DPOptimizer]]] = {
    None: {
        ("flat", False): DPOptimizer,
        ("per_layer", False): DPPerLayerOptimizer,
        ("adaptive", False): AdaClipDPOptimizer,
        ("flat", True): DistributedDPOptimizer,
        ("per_layer", True): DistributedPerLayerOptimizer,
    },
    "ghost": {
        ("flat", False): DPOptimizerFastGradientClipping,
        ("flat", True): DistributedDPOptimizerFastGradientClipping,
    },
    "bk": {
        ("flat", False): DPOptimizerFastGradientClipping,
        ("flat", True): DistributedDPOptimizerFastGradientClipping,
        ("per_layer", False): DPPerLayerOptimizerFastGradientClipping,
        ("per_layer", True): DistributedDPPerLayerOptimizerFastGradientClipping,
    },
    # FSDP2 models are always distributed; flat clipping only
    "ghost_fsdp": {("flat", True): FSDPOptimizerFastGradientClipping},
    "bk_fsdp": {("flat", True): FSDPOptimizerFastGradientClipping},
}
for _mode, _classes in _BUILTIN.items():
    for (_clipping, _distributed), _cls in _classes.items():
        register_optimizer(_cls, clipping=_clipping, distributed=_distributed, mode=_mode)
