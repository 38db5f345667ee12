"""Data-parallel DP training over ``torch.distributed`` (see docs/distributed.md).

In DP-SGD the gradient that updates the model is built by the optimizer from per-sample
gradients (``p.grad_sample``): clipped per sample, summed over the ranks and noised once
(:class:`dptorch.optimizers.DistributedDPOptimizer`). The averaged ``p.grad`` that
``torch.nn.parallel.DistributedDataParallel`` all-reduces during ``backward`` is never used, so
that communication is wasted. Two ways to train:

* :class:`DifferentiallyPrivateDistributedDataParallel` (``DPDDP``): broadcasts rank 0's
  parameters and buffers once, then runs the module as is; no gradient communication in
  ``backward``. Recommended.
* ``torch.nn.parallel.DistributedDataParallel``: supported as well; ``PrivacyEngine.make_private``
  turns its gradient synchronisation off (:func:`disable_gradient_sync`, what ``no_sync()`` does
  for one step) so that ``backward`` does not communicate either.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .utils.fsdp_utils import is_fsdp_model

logger = logging.getLogger(__name__)

__all__ = [
    "DPDDP",
    "DifferentiallyPrivateDistributedDataParallel",
    "average_gradients",
    "disable_gradient_sync",
    "is_distributed_module",
]


def _check_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group(...) "
            "(e.g. under torchrun) before wrapping the model for distributed training."
        )


class DifferentiallyPrivateDistributedDataParallel(nn.Module):
    """Data-parallel wrapper for DP training: same starting model on every rank, no gradient
    synchronisation in ``backward`` (the distributed DP optimizer does it, once, after clipping).

    At construction the parameters and buffers of ``model`` are broadcast from rank 0 of
    ``process_group``; the forward pass is ``model``'s. ``module`` is the wrapped model, as with
    ``DistributedDataParallel``.

    Args:
        model: the model, already on this rank's device.
        process_group: the group to synchronise over (default: the world).
    """

    def __init__(self, model: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        _check_initialized()
        self.module = model
        self.process_group = process_group
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=src, group=process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


DPDDP = DifferentiallyPrivateDistributedDataParallel


def is_distributed_module(module: nn.Module) -> bool:
    """Whether ``module`` (or the module a dptorch GradSampleModule wraps) is a
    ``DistributedDataParallel`` or :class:`DPDDP` model, or is sharded by FSDP2
    (``torch.distributed.fsdp.fully_shard`` applied to it or to one of its submodules)."""
    candidates = (module, getattr(module, "_module", None))
    if any(isinstance(m, (DDP, DPDDP)) for m in candidates):
        return True
    return is_fsdp_model(module)


def disable_gradient_sync(module: nn.Module) -> None:
    """Stops a ``DistributedDataParallel`` module (or the one a GradSampleModule wraps) from
    all-reducing ``p.grad`` in ``backward`` (permanently, as its ``no_sync()`` context does for
    one step); a no-op for other modules.

    DP-SGD does not use that averaged gradient: the distributed DP optimizer all-reduces the
    clipped per-sample gradient sums instead. Buffers are still broadcast in ``forward``
    (``broadcast_buffers``), so every rank must run the same number of forward passes unless the
    model has no buffers or ``broadcast_buffers=False``.
    """
    for m in (module, getattr(module, "_module", None)):  # a GradSampleModule wraps the DDP
        if isinstance(m, DDP):
            if m.require_backward_grad_sync:
                logger.info(
                    "DistributedDataParallel gradient all-reduce disabled: the DP optimizer "
                    "all-reduces the clipped gradient sums instead."
                )
            m.require_backward_grad_sync = False


def average_gradients(model: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Averages ``p.grad`` over the ranks, in place, for every parameter that has one (plain,
    non-private data-parallel training with :class:`DPDDP`)."""
    _check_initialized()
    world_size = dist.get_world_size(process_group)
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=process_group)
            p.grad /= world_size
