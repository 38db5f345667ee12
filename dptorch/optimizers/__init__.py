"""DP optimizers: the clipping/noising core (DPOptimizer) and its variants."""

from .optimizer import DPOptimizer

__all__ = ["DPOptimizer"]
