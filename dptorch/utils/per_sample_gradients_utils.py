"""Opacus module path ``opacus.utils.per_sample_gradients_utils``: an alias of :mod:`dptorch.grad_sample.per_sample_check`.

``utils/`` imports nothing from the rest of dptorch; the code lives in :mod:`dptorch.grad_sample.per_sample_check`, above what it
uses, and this module only re-exports it so that code written for Opacus keeps its imports.
"""

from ..grad_sample.gsm_exp_weights import check_torch_version_for_ew_sample  # noqa: F401
from ..grad_sample.per_sample_check import *  # noqa: F403
from ..grad_sample.per_sample_check import __all__  # noqa: F401
