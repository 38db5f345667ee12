"""Per-layer clipping over ``torch.distributed``: :class:`DistributedPerLayerOptimizer`."""

from __future__ import annotations

from .ddpoptimizer import DistributedDPOptimizerMixin
from .perlayeroptimizer import DPPerLayerOptimizer

__all__ = ["DistributedPerLayerOptimizer", "SimpleDistributedPerLayerOptimizer"]


class DistributedPerLayerOptimizer(DistributedDPOptimizerMixin, DPPerLayerOptimizer):
    """:class:`DPPerLayerOptimizer` for data-parallel training.

    Each rank clips every parameter's per-sample gradient to its own norm ``max_grad_norm[i]``
    and sums locally; the sums are all-reduced and noise of std
    ``noise_multiplier × sqrt(Σ C_i²)`` is added once for the world (on rank 0), as in
    :class:`dptorch.optimizers.DistributedDPOptimizer`. ``expected_batch_size`` is per rank.

    The reduction happens once per step, after clipping, for every ``grad_sample_mode`` that fills
    ``p.grad_sample`` ("hooks", "functorch", "ew"); it is not overlapped with the backward pass.
    """


class SimpleDistributedPerLayerOptimizer(DistributedPerLayerOptimizer):
    """Same as :class:`DistributedPerLayerOptimizer` (Opacus name kept for compatibility)."""
