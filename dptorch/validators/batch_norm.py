"""BatchNorm: mixes the samples of a batch (no per-sample gradient, leaks through its running
statistics). Fixed by GroupNorm (or InstanceNorm with ``replace_bn_with_in=True``).

Default group count: the largest divisor of ``num_features`` that is at most 32, so GroupNorm is
always constructible (Opacus uses ``gcd(32, num_features)``, which collapses to one group for odd
channel counts). For ``BatchNorm1d``, which may see ``(B, C)`` inputs without spatial extent,
the count is also at most ``num_features // 2`` so that no group normalises a single value to 0.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .errors import ShouldReplaceModuleError, UnsupportedModuleError
from .utils import copy_norm_state, register_module_fixer, register_module_validator

BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_INSTANCENORM = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
INSTANCENORM = tuple(_INSTANCENORM.values())  # the replacements with replace_bn_with_in=True


def default_num_groups(num_features: int, max_groups: int = 32) -> int:
    """The largest divisor of ``num_features`` that is ``<= max_groups`` (at least 1)."""
    for g in range(min(max_groups, num_features), 0, -1):
        if num_features % g == 0:
            return g
    return 1


@register_module_validator(BATCHNORM)
def validate(module: nn.modules.batchnorm._BatchNorm) -> list[UnsupportedModuleError]:
    return [
        ShouldReplaceModuleError(
            "BatchNorm normalises each sample with statistics of the whole batch, so a sample's "
            "gradient depends on the other samples and its running statistics leak them. "
            "Replace it with GroupNorm / LayerNorm / InstanceNorm: "
            "model = ModuleValidator.fix(model) swaps in GroupNorm."
        )
    ]


@register_module_fixer(BATCHNORM)
def fix(module: nn.modules.batchnorm._BatchNorm, **kwargs) -> nn.Module:
    """GroupNorm over the same channels (``num_groups``: int or ``f(num_features) -> int``), or
    InstanceNorm with ``replace_bn_with_in=True``; affine parameters are copied. Raises
    ``ValueError`` for both ``replace_bn_with_in=True`` and ``num_groups`` (as Opacus: they
    exclude each other)."""
    c = module.num_features
    if kwargs.get("replace_bn_with_in", False) and kwargs.get("num_groups") is not None:
        raise ValueError(
            "replace_bn_with_in=True and num_groups are mutually exclusive: num_groups applies "
            "only to the GroupNorm replacement; pass one or the other."
        )
    if kwargs.get("replace_bn_with_in", False):
        dim = _bn_dim(module)
        new: nn.Module = _INSTANCENORM[dim](c, eps=module.eps, affine=module.affine)
    else:
        num_groups = _num_groups(module, kwargs.get("num_groups"))
        new = nn.GroupNorm(num_groups, c, eps=module.eps, affine=module.affine)
    return copy_norm_state(module, new)


def _num_groups(module, num_groups: int | Callable[[int], int] | None) -> int:
    c = module.num_features
    if num_groups is None:
        cap = 32 if not isinstance(module, nn.BatchNorm1d) else max(1, min(32, c // 2))
        return default_num_groups(c, cap)
    g = num_groups(c) if callable(num_groups) else num_groups
    if not isinstance(g, int) or g < 1 or c % g != 0:
        raise ValueError(
            f"num_groups={g!r} does not divide num_features={c}; pass a divisor of {c} "
            "(or a function of num_features returning one)"
        )
    return g


def _bn_dim(module) -> int:
    for dim, cls in ((1, nn.BatchNorm1d), (2, nn.BatchNorm2d), (3, nn.BatchNorm3d)):
        if isinstance(module, cls):
            return dim
    raise ValueError(
        f"replace_bn_with_in: cannot tell the dimension of {type(module).__name__}; "
        "use GroupNorm (the default)"
    )
