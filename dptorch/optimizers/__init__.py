"""DP optimizers: the clipping/noising core (DPOptimizer), its variants, and the class chooser.

``get_optimizer_class(clipping, distributed, grad_sample_mode)`` looks the optimizer class up in
a registry that other parts (distributed, fast clipping) extend with
:func:`register_optimizer_class`.
"""

from __future__ import annotations

from .adaclipoptimizer import AdaClipDPOptimizer
from .ddp_perlayeroptimizer import DistributedPerLayerOptimizer, SimpleDistributedPerLayerOptimizer
from .ddpoptimizer import DistributedDPOptimizer
from .optimizer import DPOptimizer
from .perlayeroptimizer import DPPerLayerOptimizer

__all__ = [
    "AdaClipDPOptimizer",
    "DistributedDPOptimizer",
    "DistributedPerLayerOptimizer",
    "DPOptimizer",
    "DPPerLayerOptimizer",
    "SimpleDistributedPerLayerOptimizer",
    "get_optimizer_class",
    "register_optimizer_class",
]

# (clipping, distributed, grad_sample_mode) -> class; grad_sample_mode None is the entry for
# every mode that materialises per-sample gradients (see _PER_SAMPLE_GRADIENT_MODES).
_OPTIMIZERS: dict[tuple[str, bool, str | None], type[DPOptimizer]] = {
    ("flat", False, None): DPOptimizer,
    ("per_layer", False, None): DPPerLayerOptimizer,
    ("adaptive", False, None): AdaClipDPOptimizer,
    ("flat", True, None): DistributedDPOptimizer,
    ("per_layer", True, None): DistributedPerLayerOptimizer,
}

# Modes whose GradSampleModule fills p.grad_sample, so the generic optimizers apply to them.
# Any other mode (e.g. "ghost", which only computes norms) must register its own classes.
_PER_SAMPLE_GRADIENT_MODES: set[str | None] = {None, "hooks", "functorch", "ew"}


def register_optimizer_class(
    cls: type[DPOptimizer],
    *,
    clipping: str,
    distributed: bool,
    grad_sample_mode: str | None = None,
) -> None:
    """Makes ``get_optimizer_class(clipping, distributed, grad_sample_mode)`` return ``cls``.

    ``grad_sample_mode=None`` registers ``cls`` for every per-sample-gradient mode.
    """
    _OPTIMIZERS[(clipping, bool(distributed), grad_sample_mode)] = cls


def get_optimizer_class(
    clipping: str, distributed: bool, grad_sample_mode: str | None = None
) -> type[DPOptimizer]:
    """The DPOptimizer class for a clipping mode (``"flat"``, ``"per_layer"``, ``"adaptive"``),
    distributed training or not, and a ``grad_sample_mode``. Raises ``ValueError`` for an
    unsupported combination."""
    key = (clipping, bool(distributed), grad_sample_mode)
    if key in _OPTIMIZERS:
        return _OPTIMIZERS[key]
    if grad_sample_mode in _PER_SAMPLE_GRADIENT_MODES:
        cls = _OPTIMIZERS.get((clipping, bool(distributed), None))
        if cls is not None:
            return cls
    supported = sorted(
        f"clipping={c!r}, distributed={d}, grad_sample_mode={m!r}" for c, d, m in _OPTIMIZERS
    )
    raise ValueError(
        f"Unsupported combination clipping={clipping!r}, distributed={distributed}, "
        f"grad_sample_mode={grad_sample_mode!r}. Supported: " + "; ".join(supported)
    )


def _register_fast_gradient_clipping() -> None:
    """Optimizers of the fast-clipping modes (ghost / bk), which do not fill p.grad_sample."""
    from .optimizer_fast_gradient_clipping import (
        DistributedDPOptimizerFastGradientClipping,
        DistributedDPPerLayerOptimizerFastGradientClipping,
        DPOptimizerFastGradientClipping,
        DPPerLayerOptimizerFastGradientClipping,
    )

    for mode in ("ghost", "bk"):
        register_optimizer_class(
            DPOptimizerFastGradientClipping, clipping="flat", distributed=False, grad_sample_mode=mode
        )
        register_optimizer_class(
            DistributedDPOptimizerFastGradientClipping,
            clipping="flat",
            distributed=True,
            grad_sample_mode=mode,
        )
    register_optimizer_class(
        DPPerLayerOptimizerFastGradientClipping,
        clipping="per_layer",
        distributed=False,
        grad_sample_mode="bk",
    )
    register_optimizer_class(
        DistributedDPPerLayerOptimizerFastGradientClipping,
        clipping="per_layer",
        distributed=True,
        grad_sample_mode="bk",
    )


_register_fast_gradient_clipping()
from .optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping  # noqa: E402

__all__ += ["DPOptimizerFastGradientClipping"]
