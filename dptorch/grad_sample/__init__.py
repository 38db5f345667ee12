"""Per-sample gradients: GradSampleModule flavours and the per-layer rules (one file per layer)."""

from . import (  # noqa: F401  (each registers its layer rule)
    bilinear,
    conv,
    dp_multihead_attention,
    dp_rnn,
    embedding,
    group_norm,
    hf_conv1d,
    instance_norm,
    layer_norm,
    linear,
    rms_norm,
)
from .grad_sample_module import (
    GradSampleHooks,
    GradSampleModule,
    create_or_accumulate_grad_sample,
)
from .grad_sample_module_bk import (  # noqa: E402
    GradSampleHooksBookKeeping,
    GradSampleModuleBookKeeping,
)
from .grad_sample_module_bk_fsdp import (  # noqa: E402
    GradSampleHooksBookKeepingFSDP,
    GradSampleModuleBookKeepingFSDP,
)
from .grad_sample_module_fast_gradient_clipping import (  # noqa: E402
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from .grad_sample_module_fast_gradient_clipping_fsdp import (  # noqa: E402
    GradSampleHooksFastGradientClippingFSDP,
    GradSampleModuleFastGradientClippingFSDP,
)
from .gsm_base import AbstractGradSampleHooks, AbstractGradSampleModule
from .gsm_exp_weights import GradSampleModuleExpandedWeights
from .gsm_no_op import GradSampleHooksNoOp, GradSampleModuleNoOp  # noqa: E402  (registers grad_sample_mode="no_op")
from .registry import (
    GRAD_SAMPLERS,
    LAYER_RULES,
    NORM_SAMPLERS,
    LayerRule,
    register_grad_sampler,
    register_layer_rule,
    register_norm_sampler,
)
from .utils import get_gsm_class, prepare_module, register_grad_sample_mode, wrap_model

__all__ = [
    "AbstractGradSampleHooks",
    "AbstractGradSampleModule",
    "GradSampleHooksNoOp",
    "GradSampleHooks",
    "GradSampleHooksBookKeeping",
    "GradSampleHooksFastGradientClipping",
    "GradSampleHooksFastGradientClippingFSDP",
    "GradSampleHooksBookKeepingFSDP",
    "GradSampleModule",
    "GradSampleModuleExpandedWeights",
    "GradSampleModuleNoOp",
    "GradSampleModuleFastGradientClipping",
    "GradSampleModuleBookKeeping",
    "GradSampleModuleFastGradientClippingFSDP",
    "GradSampleModuleBookKeepingFSDP",
    "create_or_accumulate_grad_sample",
    "GRAD_SAMPLERS",
    "LAYER_RULES",
    "LayerRule",
    "register_layer_rule",
    "NORM_SAMPLERS",
    "register_grad_sampler",
    "register_norm_sampler",
    "get_gsm_class",
    "register_grad_sample_mode",
    "prepare_module",
    "wrap_model",
]
