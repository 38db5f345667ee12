"""Opacus module path ``opacus.optimizers.ddpoptimizer_fast_gradient_clipping``: the distributed
fast-gradient-clipping optimizer, which dptorch defines in
:mod:`dptorch.optimizers.optimizer_fast_gradient_clipping` (re-exported here)."""

from .optimizer_fast_gradient_clipping import DistributedDPOptimizerFastGradientClipping

__all__ = ["DistributedDPOptimizerFastGradientClipping"]
