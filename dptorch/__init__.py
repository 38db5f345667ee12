"""dptorch: differentially private deep learning for PyTorch (Opacus-compatible API)."""

from . import utils
from .grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from .privacy_engine import PrivacyEngine
from .version import __version__

__all__ = [
    "GradSampleModule",
    "GradSampleModuleFastGradientClipping",
    "PrivacyEngine",
    "utils",
    "__version__",
]
