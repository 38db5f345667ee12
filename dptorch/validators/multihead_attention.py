"""``nn.MultiheadAttention`` computes its projections with fused kernels (no per-sample
gradients). Fixed by ``DPMultiheadAttention`` with the same configuration and weights."""

from __future__ import annotations

from torch import nn

from ..layers import DPMultiheadAttention
from .errors import ShouldReplaceModuleError, UnsupportedModuleError
from .utils import register_module_fixer, register_module_validator

# nn.MultiheadAttention state-dict key -> DPMultiheadAttention parameters it becomes
_PARAM_MAP = {
    "in_proj_weight": ("qlinear.weight", "klinear.weight", "vlinear.weight"),
    "q_proj_weight": ("qlinear.weight",),
    "k_proj_weight": ("klinear.weight",),
    "v_proj_weight": ("vlinear.weight",),
    "in_proj_bias": ("qlinear.bias", "klinear.bias", "vlinear.bias"),
    "bias_k": ("seq_bias_k.bias",),
    "bias_v": ("seq_bias_v.bias",),
    "out_proj.weight": ("out_proj.weight",),
    "out_proj.bias": ("out_proj.bias",),
}


@register_module_validator(nn.MultiheadAttention)
def validate(module: nn.MultiheadAttention) -> list[UnsupportedModuleError]:
    if not any(p.requires_grad for p in module.parameters()):
        return []
    return [
        ShouldReplaceModuleError(
            "nn.MultiheadAttention has no per-sample gradients (fused projections). Use "
            "dptorch.layers.DPMultiheadAttention, a drop-in replacement: "
            "model = ModuleValidator.fix(model)."
        )
    ]


@register_module_fixer(nn.MultiheadAttention)
def fix(module: nn.MultiheadAttention, **kwargs) -> DPMultiheadAttention:
    """``DPMultiheadAttention`` with the same arguments, weights, ``requires_grad``, mode."""
    p0 = module.out_proj.weight
    new = DPMultiheadAttention(
        module.embed_dim,
        module.num_heads,
        dropout=module.dropout,
        bias=module.in_proj_bias is not None,
        add_bias_kv=module.bias_k is not None,
        add_zero_attn=module.add_zero_attn,
        kdim=module.kdim,
        vdim=module.vdim,
        batch_first=module.batch_first,
        device=p0.device,
        dtype=p0.dtype,
    )
    new.load_state_dict(module.state_dict())
    dp_params = dict(new.named_parameters())
    for name, p in module.named_parameters():
        for target in _PARAM_MAP.get(name, ()):
            dp_params[target].requires_grad_(p.requires_grad)
    new.train(module.training)
    return new
