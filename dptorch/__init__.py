"""dptorch: differentially private deep learning for PyTorch (Opacus-compatible API)."""

from . import utils
from .grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from .version import __version__

__all__ = ["GradSampleModule", "GradSampleModuleFastGradientClipping", "utils", "__version__"]

try:  # the engine imports the whole stack; keep the per-sample-gradient core importable alone
    from .privacy_engine import PrivacyEngine  # noqa: F401

    __all__.append("PrivacyEngine")
except ImportError as _e:  # pragma: no cover - only while a part is missing
    if "privacy_engine" not in str(_e):
        raise
