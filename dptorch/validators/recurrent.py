"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` run fused kernels that hide their per-step inputs, so
they get no per-sample gradients. Fixed by ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` with the same
configuration and weights (frozen layers are fine as they are)."""

from __future__ import annotations

from torch import nn

from ..layers import DPGRU, DPLSTM, DPRNN
from .errors import ShouldReplaceModuleError, UnsupportedModuleError
from .utils import register_module_fixer, register_module_validator

_REPLACEMENT = {nn.LSTM: DPLSTM, nn.GRU: DPGRU, nn.RNN: DPRNN}


@register_module_validator(tuple(_REPLACEMENT))
def validate(module: nn.RNNBase) -> list[UnsupportedModuleError]:
    if not any(p.requires_grad for p in module.parameters()):
        return []
    dp = _REPLACEMENT[type(module)].__name__
    return [
        ShouldReplaceModuleError(
            f"nn.{type(module).__name__} has no per-sample gradients (fused kernels). Use "
            f"dptorch.layers.{dp}, a drop-in replacement: model = ModuleValidator.fix(model)."
        )
    ]


@register_module_fixer(tuple(_REPLACEMENT))
def fix(module: nn.RNNBase, **kwargs) -> nn.Module:
    """The DP layer with the same arguments, weights, ``requires_grad``, device, dtype, mode."""
    extra = {}
    if isinstance(module, nn.LSTM):
        extra["proj_size"] = module.proj_size
    if type(module) is nn.RNN:
        extra["nonlinearity"] = module.nonlinearity
    new = _REPLACEMENT[type(module)](
        module.input_size,
        module.hidden_size,
        num_layers=module.num_layers,
        bias=module.bias,
        batch_first=module.batch_first,
        dropout=module.dropout,
        bidirectional=module.bidirectional,
        **extra,
    )
    p0 = next(module.parameters())
    new.to(device=p0.device, dtype=p0.dtype)
    new.load_state_dict(module.state_dict())
    dp_params = dict(new.named_parameters())
    for name, p in module.named_parameters():
        dp_params[name].requires_grad_(p.requires_grad)
    new.train(module.training)
    return new
