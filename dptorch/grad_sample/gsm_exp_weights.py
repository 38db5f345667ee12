"""Per-sample gradients through PyTorch's ExpandedWeights (``grad_sample_mode="ew"``)."""

from __future__ import annotations

import torch
from torch import nn

from .gsm_base import AbstractGradSampleModule


class GradSampleModuleExpandedWeights(AbstractGradSampleModule):
    """ExpandedWeights-based implementation of :class:`AbstractGradSampleModule`.

    Each forward runs under ``torch.nn.utils._per_sample_grad.call_for_per_sample_grads``, which
    makes PyTorch's own kernels fill ``p.grad_sample`` (``(B, *p.shape)``).

    Limits (each raises rather than returning wrong numbers): ``batch_first=False``, recurrent
    layers, empty batches.
    """

    def __init__(
        self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean", **kwargs
    ):
        if not batch_first:
            raise NotImplementedError(
                "ExpandedWeights (grad_sample_mode='ew') supports only batch_first=True; "
                "use grad_sample_mode='hooks' or 'functorch'."
            )
        for name, sub in m.named_modules():
            if isinstance(sub, nn.RNNBase) or type(sub).__name__ in ("DPLSTM", "DPGRU", "DPRNN"):
                raise NotImplementedError(
                    f"{name or '<root>'} ({type(sub).__name__}) is recurrent; ExpandedWeights "
                    "cannot compute its per-sample gradients. Use grad_sample_mode='hooks'."
                )
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

        batch_size = x.shape[0]
        if batch_size == 0:
            raise ValueError(
                "ExpandedWeights cannot process an empty batch (Poisson sampling can produce one). "
                "Use grad_sample_mode='hooks', which handles empty batches."
            )
        if not self.training or not torch.is_grad_enabled():
            return self._module(x, *args, **kwargs)
        return call_for_per_sample_grads(
            self._module, batch_size=batch_size, loss_reduction=self.loss_reduction
        )(x, *args, **kwargs)
