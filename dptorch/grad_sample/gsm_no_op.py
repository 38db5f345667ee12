"""``grad_sample_mode="no_op"``: a GradSampleModule that computes nothing.

For pipelines that fill ``p.grad_sample`` themselves (for instance with ``torch.func`` outside
the model): the wrapper only runs the model and keeps the bookkeeping methods of
:class:`AbstractGradSampleModule`, so a DP optimizer clips and noises whatever the user put in
``p.grad_sample``.
"""

from __future__ import annotations

from torch import nn

from .gsm_base import AbstractGradSampleModule

__all__ = ["GradSampleHooksNoOp", "GradSampleModuleNoOp"]


class GradSampleModuleNoOp(AbstractGradSampleModule):
    """Wraps ``m`` without any per-sample-gradient machinery; ``p.grad_sample`` is the user's.

    ``strict`` / ``force_functorch`` (passed by ``wrap_model``) are accepted and ignored.
    """

    def __init__(
        self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean", **kwargs
    ):
        unknown = set(kwargs) - {"strict", "force_functorch"}
        if unknown:
            raise TypeError(f"GradSampleModuleNoOp got unexpected arguments {sorted(unknown)}")
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)

    def forward(self, x, *args, **kwargs):
        return self._module(x, *args, **kwargs)


class GradSampleHooksNoOp(GradSampleModuleNoOp):
    """Opacus 1.6's in-place name (``wrap_model=False``): no_op has no hooks to attach, the
    user fills ``p.grad_sample`` and keeps calling the model."""

