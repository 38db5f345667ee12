"""Loss wrapper of fast gradient clipping: ``loss.backward()`` runs the whole clipping.

``criterion = DPLossFastGradientClipping(model, optimizer, nn.CrossEntropyLoss())`` returns, for
``criterion(output, target)``, a :class:`DPTensorFastGradientClipping` holding the per-sample
losses ``(B,)``. Its :meth:`~DPTensorFastGradientClipping.backward`:

* ``grad_sample_mode="ghost"``: (1) back-propagates the reduced loss to the layers' outputs only,
  which computes the per-sample gradient norms; (2) back-propagates ``Σ_b c_b loss_b`` with the
  clip factors ``c_b`` and the hooks off, which adds the clipped sum to ``p.grad``.
* ``grad_sample_mode="bk"``: one ordinary backward pass of the reduced loss (the module does the
  rest); the wrapper is optional there.
"""

from __future__ import annotations

import logging

import torch

from .grad_sample_module_bk import GradSampleModuleBookKeeping
from .grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
)

logger = logging.getLogger(__name__)

__all__ = ["DPLossFastGradientClipping", "DPTensorFastGradientClipping"]


def _reduce(loss_per_sample: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    if loss_reduction == "mean":
        return loss_per_sample.mean(0) if loss_per_sample.numel() else loss_per_sample.sum(0)
    return loss_per_sample.sum(0)


class DPTensorFastGradientClipping:
    """Per-sample losses ``(B,)`` whose :meth:`backward` performs fast gradient clipping.

    Supports ``item()``, ``detach()``, scalar ``*``, ``/``, ``+``, ``-``, negation and ``+``/``-``
    of another per-sample loss of the same batch (e.g. a sum of loss terms).
    """

    def __init__(
        self,
        module: GradSampleModuleFastGradientClipping,
        optimizer,
        loss_per_sample: torch.Tensor,
        loss_reduction: str = "mean",
    ):
        self.module = module
        self.optimizer = optimizer
        self.loss_per_sample = loss_per_sample
        self.loss_reduction = loss_reduction

    def _new(self, loss_per_sample: torch.Tensor) -> DPTensorFastGradientClipping:
        return DPTensorFastGradientClipping(
            self.module, self.optimizer, loss_per_sample, self.loss_reduction
        )

    def _other(self, other):
        if isinstance(other, DPTensorFastGradientClipping):
            if other.loss_per_sample.shape != self.loss_per_sample.shape:
                raise ValueError("Cannot combine per-sample losses of different batches")
            return other.loss_per_sample
        if isinstance(other, (int, float)) or (
            isinstance(other, torch.Tensor) and other.numel() == 1 and not other.requires_grad
        ):
            return other
        raise TypeError(
            "A DP loss can only be combined with numbers or with another DP loss of the same "
            "batch: a term that is not a per-sample loss cannot be attributed to samples."
        )

    def item(self) -> float:
        return self.detach().item()

    def detach(self) -> torch.Tensor:
        """The reduced loss, detached."""
        return _reduce(self.loss_per_sample, self.loss_reduction).detach()

    def __mul__(self, other):
        return self._new(self.loss_per_sample * self._other(other))

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._new(self.loss_per_sample / self._other(other))

    def __add__(self, other):
        return self._new(self.loss_per_sample + self._other(other))

    __radd__ = __add__

    def __sub__(self, other):
        return self._new(self.loss_per_sample - self._other(other))

    def __rsub__(self, other):
        return self._new(self._other(other) - self.loss_per_sample)

    def __neg__(self):
        return self._new(-self.loss_per_sample)

    def __repr__(self) -> str:
        return f"DPTensorFastGradientClipping({self.detach()!r})"

    __str__ = __repr__

    def backward(self) -> None:
        """Computes the clipped sum of per-sample gradients into ``p.grad`` (see module doc)."""
        reduced = _reduce(self.loss_per_sample, self.loss_reduction)
        if isinstance(self.module, GradSampleModuleBookKeeping):
            reduced.backward()
            return
        if reduced.requires_grad:
            self.module.check_param_uses(reduced)
        self.module.check_grads_untouched()
        self.module.norm_backward(reduced)
        bound = self.module.clipping.snapshot()
        coef = self.module.get_clipping_coef()
        b = self.loss_per_sample.shape[0]
        coef = coef[:b].to(self.loss_per_sample.device, self.loss_per_sample.dtype)
        weighted = (coef * self.loss_per_sample).sum()
        self.module.disable_hooks()
        try:
            if weighted.requires_grad:
                weighted.backward()
        finally:
            self.module.enable_hooks()
        for p in self.module.trainable_parameters():
            # nn.Embedding(sparse=True): the clipped sum as the other modes release it (dense:
            # the noise covers every row), which the optimizer's noise can be added to
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        self.module.mark_clipped_pass(bound)


class DPLossFastGradientClipping:
    """Wraps a criterion so that its result's ``backward()`` performs fast gradient clipping.

    Args:
        module: the :class:`GradSampleModuleFastGradientClipping` (``"ghost"``) or
            :class:`GradSampleModuleBookKeeping` (``"bk"``) being trained.
        optimizer: its ``DPOptimizerFastGradientClipping``; the module adopts the optimizer's
            :class:`~dptorch.clipping.ClippingContract` (one C for both, by reference).
        criterion: a loss with a ``reduction`` attribute (set to ``"none"`` while called).
        loss_reduction: ``"mean"`` or ``"sum"``; must equal the module's, optimizer's and
            criterion's.

    ``criterion(output, target, shape=(B, T, V))`` supports token-level losses of generative
    models: the ``B·T`` token losses are reduced per sequence (``mean`` over non-ignored tokens,
    or ``sum``), since the privacy unit is the sequence.
    """

    def __init__(self, module, optimizer, criterion, loss_reduction: str = "mean"):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(module, GradSampleModuleFastGradientClipping):
            raise TypeError(
                "DPLossFastGradientClipping needs a module wrapped with grad_sample_mode='ghost' "
                f"or 'bk', got {type(module).__name__}"
            )
        if not hasattr(criterion, "reduction"):
            criterion.reduction = loss_reduction
        found = {
            "loss_reduction": loss_reduction,
            "criterion": criterion.reduction,
            "module": module.loss_reduction,
            "optimizer": optimizer.loss_reduction,
        }
        if len(set(found.values())) != 1:
            raise ValueError(f"loss_reduction must agree everywhere, got {found}")
        clipping = getattr(optimizer, "clipping", None)
        if clipping is not None and module.clipping is not clipping:
            module.bind_clipping(clipping)
        self.module = module
        self.optimizer = optimizer
        self.criterion = criterion
        self.loss_reduction = loss_reduction

    def __call__(self, *args, shape=None, **kwargs) -> DPTensorFastGradientClipping:
        old = self.criterion.reduction
        self.criterion.reduction = "none"
        try:
            loss = self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = old
        if shape is not None and loss.dim() == 1 and loss.shape[0] == shape[0] * shape[1]:
            loss = loss.view(shape[0], shape[1])
            if self.loss_reduction == "mean":
                ignore = getattr(self.criterion, "ignore_index", None)
                target = kwargs.get("target", args[1] if len(args) > 1 else None)
                if ignore is not None and target is not None:
                    valid = (target.view(shape[0], shape[1]) != ignore).sum(1).clamp(min=1)
                    loss = loss.sum(1) / valid.to(loss.dtype)
                else:
                    loss = loss.mean(1)
            else:
                loss = loss.sum(1)
        if loss.dim() > 1:  # element-wise losses: reduce each sample's elements like the batch
            flat = loss.flatten(1)
            loss = flat.mean(1) if self.loss_reduction == "mean" else flat.sum(1)
        return DPTensorFastGradientClipping(self.module, self.optimizer, loss, self.loss_reduction)
