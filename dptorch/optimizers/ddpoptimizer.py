"""DP-SGD across ``torch.distributed`` processes: :class:`DistributedDPOptimizer`.

Every rank clips the per-sample gradients of its own samples and sums them
(:meth:`DPOptimizer.clip_and_accumulate`, unchanged). The world's gradient is then released once:

1. ``add_noise``: rank 0 adds ``N(0, (σ·C)²)`` to its local clipped sum; the other ranks add
   nothing. The ranks' ``p.grad`` are then summed by one all-reduce, so every rank holds
   ``Σ_ranks clipped sums + one draw of noise`` — noise is added exactly once for the world,
   whatever the generators (or secure mode) on the ranks.
2. ``scale_grad``: with ``loss_reduction="mean"`` the result is divided by
   ``expected_batch_size × world_size × accumulated_iterations``.

``expected_batch_size`` is **per rank** (Opacus semantics): the global expected batch size
``q · N`` divided by the world size. ``PrivacyEngine.make_private`` passes it that way.

The two stage overrides live in :class:`DistributedDPOptimizerMixin`, which any
:class:`DPOptimizer` subclass (per-layer clipping, fast gradient clipping, ...) can put first in
its bases to become distributed::

    class DistributedFooOptimizer(DistributedDPOptimizerMixin, FooOptimizer): ...

Skipped steps (``signal_skip_step``, e.g. physical batches of ``BatchMemoryManager``) only clip
and accumulate locally and do not communicate, so ranks may run different numbers of physical
batches per logical batch; every rank must run the same number of real steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..distributed_settings import optimizer_settings, settings_must_agree
from .optimizer import DPOptimizer

#: Largest number of elements all-reduced in one flat buffer (bounds the extra memory).
BUCKET_NUMEL = 1 << 24


def _require_process_group(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``process_group``; raises if torch.distributed is not set up."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "Distributed DP optimizers need an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) (e.g. under torchrun) before creating the "
            "optimizer, or use the non-distributed DPOptimizer."
        )
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _buckets(tensors: list[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    """Groups ``tensors`` (in order) by device and dtype into lists of at most ``cap`` elements
    (a single larger tensor forms its own bucket)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            if bucket and size + t.numel() > cap:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel()
        if bucket:
            yield bucket


def all_reduce_sum_(tensors: list[torch.Tensor], process_group=None, cap: int = BUCKET_NUMEL) -> None:
    """Sums each tensor of ``tensors`` in place over the ranks of ``process_group``.

    Tensors are packed into flat buffers (per device and dtype, at most ``cap`` elements) so that a
    model costs a few collectives rather than one per parameter. Every rank must pass tensors of
    the same shapes in the same order.
    """
    for bucket in _buckets(tensors, cap):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], op=dist.ReduceOp.SUM, group=process_group)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


class DistributedDPOptimizerMixin:
    """Makes a :class:`DPOptimizer` subclass distributed by overriding two of its stages.

    * :meth:`add_noise`: the wrapped class's ``add_noise`` runs on every rank, with the noise
      multiplier set to 0 except on rank 0, then :meth:`reduce_gradients` sums ``p.grad`` over
      the ranks. Noise is thus drawn once, on rank 0, for the whole world.
    * :meth:`scale_grad`: the wrapped class's scaling, then a division by ``world_size`` for
      ``loss_reduction="mean"`` (``expected_batch_size`` is per rank).

    Extra keyword argument: ``process_group`` (default: the world).

    Construction is a collective (like ``DistributedDataParallel``'s): the ranks all-gather their
    σ, C, expected batch size, reduction, secure mode and class and every rank raises the same
    ``ValueError`` if they differ (:mod:`dptorch.distributed_settings`).
    """

    #: The rank that adds the noise.
    NOISE_RANK = 0

    def __init__(self, *args, process_group: dist.ProcessGroup | None = None, **kwargs):
        self.process_group = process_group
        self.rank, self.world_size = _require_process_group(process_group)
        with settings_must_agree(True, process_group=process_group,
                                 where=type(self).__name__) as agree:
            super().__init__(*args, **kwargs)
            agree(optimizer_settings(self))

    @property
    def is_noise_rank(self) -> bool:
        """Whether this rank draws the world's noise."""
        return self.rank == self.NOISE_RANK

    def add_noise(self) -> None:
        """Noise on rank 0 only, then the all-reduce of ``p.grad``: every rank ends with
        ``Σ_ranks summed_grad + N(0, (σ·C)²)``."""
        if self.is_noise_rank:
            super().add_noise()
        else:
            sigma = self.noise_multiplier
            self.noise_multiplier = 0.0
            try:
                super().add_noise()
            finally:
                self.noise_multiplier = sigma
        self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Sums ``p.grad`` of every trainable parameter over the ranks (in place)."""
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            raise RuntimeError(
                "A trainable parameter has no gradient after add_noise(); every rank must release "
                "every parameter at every step for the all-reduce to line up."
            )
        all_reduce_sum_(grads, self.process_group)

    def scale_grad(self) -> None:
        """Divides by ``expected_batch_size × world_size × accumulated_iterations`` for "mean"."""
        super().scale_grad()
        if self.loss_reduction == "mean":
            for p in self.params:
                p.grad /= self.world_size


class DistributedDPOptimizer(DistributedDPOptimizerMixin, DPOptimizer):
    """:class:`DPOptimizer` for data-parallel training over ``torch.distributed``.

    Each rank clips its own samples; the clipped sums are all-reduced and Gaussian noise of std
    ``noise_multiplier × max_grad_norm`` is added once for the whole world (drawn on rank 0). After
    ``step()`` every rank holds the same gradient and, from identical parameters, the same model.

    Args: those of :class:`DPOptimizer`, plus ``process_group``. ``expected_batch_size`` is the
    expected batch size **of one rank** (``q · N / world_size``); the gradient is divided by it
    and by the world size.
    """
