"""Opacus module path ``opacus.utils.fast_gradient_clipping_utils``: an alias of :mod:`dptorch.grad_sample.fast_clipping_loss`.

``utils/`` imports nothing from the rest of dptorch; the code lives in :mod:`dptorch.grad_sample.fast_clipping_loss`, above what it
uses, and this module only re-exports it so that code written for Opacus keeps its imports.
"""

from ..grad_sample.fast_clipping_loss import *  # noqa: F403
from ..grad_sample.fast_clipping_loss import __all__  # noqa: F401
