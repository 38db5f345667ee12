"""Opacus module path ``opacus.utils.batch_memory_manager``: an alias of :mod:`dptorch.batch_memory_manager`.

``utils/`` imports nothing from the rest of dptorch; the code lives in :mod:`dptorch.batch_memory_manager`, above what it
uses, and this module only re-exports it so that code written for Opacus keeps its imports.
"""

from ..batch_memory_manager import *  # noqa: F403
from ..batch_memory_manager import __all__  # noqa: F401
