"""InstanceNorm with ``track_running_stats=True``: its running statistics are computed from the
private batch without noise. Fixed by turning them off (normalisation in training is unchanged:
it always uses the per-instance statistics)."""

from __future__ import annotations

from torch import nn

from .errors import IllegalModuleConfigurationError, UnsupportedModuleError
from .utils import copy_norm_state, register_module_fixer, register_module_validator

INSTANCENORM = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@register_module_validator(INSTANCENORM)
def validate(module: nn.modules.instancenorm._InstanceNorm) -> list[UnsupportedModuleError]:
    if not module.track_running_stats:
        return []
    return [
        IllegalModuleConfigurationError(
            "track_running_stats=True keeps statistics of the private data that no noise "
            "protects. Build it with track_running_stats=False, or run "
            "model = ModuleValidator.fix(model)."
        )
    ]


@register_module_fixer(INSTANCENORM)
def fix(module: nn.modules.instancenorm._InstanceNorm, **kwargs) -> nn.Module:
    """The same layer with ``track_running_stats=False`` (affine parameters copied)."""
    new = type(module)(
        module.num_features,
        eps=module.eps,
        momentum=module.momentum,
        affine=module.affine,
        track_running_stats=False,
    )
    return copy_norm_state(module, new)
