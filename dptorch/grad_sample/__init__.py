"""Per-sample gradients: GradSampleModule flavours and the per-layer sampler registries."""

from . import linear  # noqa: F401  (registers samplers)
from .grad_sample_module import GradSampleModule
from .gsm_base import AbstractGradSampleModule
from .gsm_exp_weights import GradSampleModuleExpandedWeights
from .registry import GRAD_SAMPLERS, NORM_SAMPLERS, register_grad_sampler, register_norm_sampler
from .utils import get_gsm_class, register_grad_sample_mode, wrap_model

__all__ = [
    "AbstractGradSampleModule",
    "GradSampleModule",
    "GradSampleModuleExpandedWeights",
    "GRAD_SAMPLERS",
    "NORM_SAMPLERS",
    "register_grad_sampler",
    "register_norm_sampler",
    "get_gsm_class",
    "register_grad_sample_mode",
    "wrap_model",
]
