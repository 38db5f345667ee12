"""DP optimizers for the fast-clipping modes (``grad_sample_mode="ghost"`` and ``"bk"``).

In those modes the module computes per-sample gradient *norms* and the backward pass leaves the
clipped sum ``Σ_b c_b ∇ loss_b`` in ``p.grad`` (ghost: second backward pass of the loss wrapper;
bk: end of the single backward pass), adding to what ``p.grad`` already held. The module marks
every trainable parameter with the number of clipped passes accumulated since the last step.

Only the first DP-SGD stage differs from :class:`DPOptimizer`: :meth:`clip_and_accumulate`
moves the clipped sum from ``p.grad`` to ``p.summed_grad``. Noise, scaling, skip-steps
(``BatchMemoryManager``), step hooks and the accumulated-iterations count are the base class's,
so gradient accumulation over physical batches works (Opacus's ghost optimizer hard-codes one
iteration).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..grad_sample.step_record import grad_state
from .ddpoptimizer import DistributedDPOptimizerMixin
from .optimizer import DPOptimizer, _has_nonzero_grad
from .perlayeroptimizer import DPPerLayerOptimizer


class DPOptimizerFastGradientClipping(DPOptimizer):
    """:class:`DPOptimizer` whose clipped per-sample sum comes from ``p.grad`` (ghost / bk).

    Args: those of :class:`DPOptimizer`; multi-pass options (``accum_passes``,
    ``num_private_passes``, manual clipping) are not supported: their per-pass clipping needs
    per-sample gradients, use ``grad_sample_mode="hooks"``.
    """

    #: the multi-pass options are refused by ``__init__`` rather than handled by a variant
    supports_multi_pass = False

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        **kwargs,
    ):
        for k in ("accum_passes", "num_private_passes"):
            if kwargs.get(k) is not None:
                raise ValueError(
                    f"{k} (multi-pass clipping) is not supported by the fast-clipping optimizers "
                    "(grad_sample_mode 'ghost'/'bk'); use grad_sample_mode='hooks'."
                )
        if kwargs.get("auto_clip_and_accum_on_step", True) is False:
            raise ValueError(
                "auto_clip_and_accum_on_step=False needs per-sample gradients; use "
                "grad_sample_mode='hooks'."
            )
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )
        self._fast_iterations = 1

    @property
    def accumulated_iterations(self) -> int:
        """Clipped backward passes accumulated into ``p.grad`` before the last
        :meth:`clip_and_accumulate` (1 without accumulation)."""
        return self._fast_iterations

    def clip_and_accumulate(self) -> None:
        """``p.summed_grad += p.grad`` (the clipped sum left by the backward pass(es)), then
        ``p.grad = None``: the sum is moved, so the next pass starts from no gradient.

        Before anything is moved, the step record must show that every pass was clipped, with
        the contract's current bound, and that every parameter with a gradient was covered by a
        hook; otherwise ``ValueError``."""
        self._check_not_consumed()
        recs = self.records
        passes = [r for rec in recs for r in rec.passes]
        unclipped = [r for r in passes if not r.clipped]
        if unclipped:
            raise ValueError(
                "A backward pass ran without fast gradient clipping: p.grad holds unclipped "
                "gradients. With grad_sample_mode='ghost' call backward() on the loss returned by "
                "the DPLossFastGradientClipping criterion (make_private returns it), not on a "
                "plain loss."
            )
        current = self.clipping.snapshot()
        for r in passes:
            if r.clip_bound != current:
                raise ValueError(
                    f"max_grad_norm changed from {_fmt(r.clip_bound)} to {_fmt(current)} between "
                    "the backward pass and optimizer.step(): the backward pass clipped with the "
                    "old bound and the noise would be calibrated to the new one. Change "
                    "max_grad_norm (or step a grad-clip scheduler) after optimizer.step() and "
                    "before the next backward pass."
                )
        covered = set().union(*(rec.covered for rec in recs)) if recs else set()
        last = passes[-1].grad_state if passes else None
        for p in self.params:
            if last is not None and id(p) in last and grad_state(p) != last[id(p)]:
                raise ValueError(
                    f"p.grad of a parameter of shape {tuple(p.shape)} changed after the last "
                    "clipped backward pass (a backward pass with the hooks disabled, or an edit "
                    "of p.grad): that contribution was not clipped per sample. Run every "
                    "backward pass through the DP loss with the hooks enabled, and leave p.grad "
                    "alone until optimizer.step()."
                )
        for p in self.params:
            if id(p) not in covered:
                if _has_nonzero_grad(p):
                    raise ValueError(
                        f"A parameter of shape {tuple(p.shape)} has a gradient that no "
                        "fast-clipping hook covered (it is used outside the forward of the "
                        "module that owns it, unfrozen without a forward pass since, or the "
                        "model is not wrapped): it would be released unclipped. Call the module "
                        "that owns it, and call optimizer.zero_grad() after every step."
                    )
                continue
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            self._add_to_summed_grad(p, g)
            # moved, not copied: ``summed_grad`` may share ``g``'s storage, which a later
            # ``zero_grad(set_to_none=False)`` would otherwise zero in place
            p.grad = None
        self._fast_iterations = max(len(passes), 1)
        for rec in recs:
            rec.mark_consumed()

    def _manual_unsupported(self, *_, **__):
        """The manual stages of multi-pass training (``clip``, ``accumulate_batch``,
        ``accum_grads_across_passes``) need per-sample gradients: ``NotImplementedError``."""
        raise NotImplementedError(
            "Manual clipping stages need per-sample gradients, which the fast-clipping modes do "
            "not materialise; use grad_sample_mode='hooks'."
        )

    clip = _manual_unsupported
    accumulate_batch = _manual_unsupported
    accum_grads_across_passes = _manual_unsupported


class DPPerLayerOptimizerFastGradientClipping(DPOptimizerFastGradientClipping, DPPerLayerOptimizer):
    """Per-layer clipping with ``grad_sample_mode="bk"`` (the module applies one clip factor per
    parameter; ``max_grad_norm`` is the list of per-parameter norms, the noise is calibrated to
    ``sqrt(Σ C_i²)``). Not available with ``"ghost"``, whose second backward pass can only weight
    a sample's whole loss."""


class DistributedDPOptimizerFastGradientClipping(
    DistributedDPOptimizerMixin, DPOptimizerFastGradientClipping
):
    """:class:`DPOptimizerFastGradientClipping` over ``torch.distributed``: local clipped sums,
    noise drawn once on rank 0, all-reduce (see :class:`DistributedDPOptimizerMixin`)."""


class DistributedDPPerLayerOptimizerFastGradientClipping(
    DistributedDPOptimizerMixin, DPPerLayerOptimizerFastGradientClipping
):
    """Distributed per-layer clipping for ``grad_sample_mode="bk"``."""


def _fmt(bound: float | tuple[float, ...]) -> str:
    """A bound (or per-layer bounds) for an error message."""
    if isinstance(bound, tuple):
        return "(" + ", ".join(f"{c:g}" for c in bound) + ")"
    return f"{bound:g}"
