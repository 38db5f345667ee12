"""Multi-pass training (GANs): several backward passes per optimizer step (docs/multi_pass.md).

A DP optimizer built with a multi-pass option (``accum_passes``, ``num_private_passes`` or
``auto_clip_and_accum_on_step=False``) is an instance of its class's multi-pass variant,
``class MultiPass<Cls>(MultiPassDPOptimizerMixin, Cls)`` (:func:`multi_pass_variant`, chosen by
``DPOptimizer.__new__``). The mixin plugs into the core :class:`DPOptimizer` by overriding:

* ``_unit_grad_samples``: with ``accum_passes=True`` each sample's gradient is summed over the
  passes before it is clipped ("basic" clipping); otherwise every (pass, sample) unit is clipped
  on its own ("split" clipping);
* ``_check_grad_sample_layout``: the pass axis, the pass sizes and the number of passes not
  declared public must match the settings the noise is calibrated to;
* ``noise_scale_factor``: ``num_private_passes`` with split clipping (noise ``σ·C·k``);
* ``accumulated_iterations``: the passes of one step are over one batch and count once;
* ``clip_and_accumulate``: with ``auto_clip_and_accum_on_step=False``, only checks that the
  manual stages ran;
* ``zero_grad``: also starts the manual stages over;

and adds the manual stages :meth:`~MultiPassDPOptimizerMixin.clip`,
:meth:`~MultiPassDPOptimizerMixin.accum_grads_across_passes` and
:meth:`~MultiPassDPOptimizerMixin.accumulate_batch`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..clipping import CLIP_EPS
from .unit_grads import (
    UnitGrads,
    _check_processed_flag,
    _has_pass_axis,
    _mark_as_processed,
    flat_norms,
)

if TYPE_CHECKING:
    from .optimizer import DPOptimizer

__all__ = ["MultiPassDPOptimizerMixin", "multi_pass_variant", "validate_multi_pass_args"]

# manual stages of one step, in order (auto_clip_and_accum_on_step=False)
_NOTHING_DONE, _CLIPPED, _FOLDED, _ACCUMULATED = 0, 1, 2, 3


class MultiPassDPOptimizerMixin:
    """Makes a :class:`DPOptimizer` subclass handle multi-pass per-sample gradients
    ``(n_passes, B, *p.shape)`` and the manual clipping stages; put it first in the bases.

    Extra keyword arguments:
        accum_passes: ``True`` sums each sample's gradient over the passes and clips once
            (noise ``σ·C``; every pass must have the same batch size); ``False`` clips every
            (pass, sample) unit (noise ``σ·C·num_private_passes``); ``None``: single-pass
            per-sample gradients only.
        num_private_passes: with ``accum_passes=False``, the number of passes per step that may
            touch private data (the passes not run inside ``GradSampleModule.public_pass()``).
        auto_clip_and_accum_on_step: ``False`` leaves clipping and accumulation to
            :meth:`clip`, :meth:`accum_grads_across_passes` (optional) and
            :meth:`accumulate_batch`, called by hand before ``step()``.
    """

    def __init__(
        self,
        *args: Any,
        accum_passes: bool | None = None,
        num_private_passes: int | None = None,
        auto_clip_and_accum_on_step: bool = True,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        _validate_multi_pass(accum_passes, num_private_passes)
        if accum_passes is False and not getattr(type(self), "supports_split_clipping", True):
            raise ValueError(
                f"{type(self).__name__} does not support split multi-pass clipping "
                "(accum_passes=False): one record would change a released statistic once per "
                "pass. Use accum_passes=True."
            )
        self.accum_passes = accum_passes
        self.num_private_passes = num_private_passes
        self.auto_clip_and_accum_on_step = auto_clip_and_accum_on_step
        self._manual_stage = _NOTHING_DONE
        self._folded_passes = 0  # passes summed by accum_grads_across_passes (bound C x this)

    # ------------------------------------------------------------------ stages of the core
    @property
    def accumulated_iterations(self) -> int:
        """1 with multi-pass slices (passes over one batch, not accumulated iterations), else
        the core's count."""
        if self.accum_passes is not None:
            return 1
        return super().accumulated_iterations

    @property
    def noise_scale_factor(self) -> int:
        """Sensitivity of the clipped sum in units of ``max_grad_norm``: ``num_private_passes``
        with split clipping (one record adds a unit to each private pass), else 1."""
        if self.accum_passes is False:
            return self.num_private_passes
        return super().noise_scale_factor

    def _unit_grad_samples(self) -> UnitGrads:
        """The core's units ``(P, B, *p.shape)``, with the passes summed into ``(1, B, ...)``
        when ``accum_passes=True``."""
        units = super()._unit_grad_samples()
        if self.accum_passes:
            units = [(p, gs.sum(0, keepdim=True)) for p, gs in units]
        return units

    def _check_grad_sample_layout(self, params: list[nn.Parameter]) -> None:
        """Refuses per-sample gradients whose layout contradicts the multi-pass settings.

        * ``(n_passes, B, ...)`` gradients need ``accum_passes`` (the noise calibration depends
          on it), and ``accum_passes`` needs them (else the model is not in multi-pass mode);
        * ``accum_passes=True`` pairs the passes by sample index, which is only sound when every
          pass has the same batch size (docs/multi_pass.md);
        * split clipping: the passes not declared public (``GradSampleModule.public_pass()``)
          must not outnumber ``num_private_passes``, which the noise is calibrated to, and
          public passes run only in a step that releases or ends a logical batch (not in the
          other physical batches of BatchMemoryManager, whose number depends on the data).
        """
        if self.accum_passes is None:
            super()._check_grad_sample_layout(params)
            return
        for p in params:
            if not _has_pass_axis(p.grad_sample, p):
                raise ValueError(
                    f"accum_passes={self.accum_passes} is set but the per-sample gradients are "
                    "single-pass (B, ...): wrap the model with GradSampleModule(..., "
                    "multi_pass=True) or call make_private(..., multi_pass=True)."
                )
        passes = [r for rec in self.records for r in rec.passes]
        sizes = {r.batch_size for r in passes if r.batch_size is not None}
        if self.accum_passes and len(sizes) > 1:
            raise ValueError(
                f"accum_passes=True sums per-sample gradients across passes by batch index, but "
                f"the passes had different batch sizes {sorted(sizes)}. Pairing sample i of one "
                "pass with sample i of another is only private when every pass has as many "
                "samples as the real batch (e.g. generate len(real_batch) fake samples), see "
                "docs/multi_pass.md. Otherwise use accum_passes=False (split clipping)."
            )
        n_private = len(passes) - sum(r.public for r in passes)
        if self.accum_passes is False and n_private > self.num_private_passes:
            raise ValueError(
                f"Split clipping: {n_private} backward passes may touch private data but "
                f"num_private_passes={self.num_private_passes}, so the noise would not cover "
                "them. Run each pass that depends neither on the private data nor on its batch "
                "size (e.g. a fixed number of generated samples) inside `with "
                "model.public_pass():`, or raise num_private_passes. See docs/multi_pass.md."
            )
        if self.accum_passes is False and n_private < len(passes) and self._splits_logical_batch():
            raise ValueError(
                "Split clipping: a public pass (model.public_pass()) ran in a physical batch that "
                "does not end its logical batch (BatchMemoryManager). The number of physical "
                "batches follows the size of the private Poisson batch, so public passes run in "
                "every physical batch would make the released sum depend on it, beyond the "
                f"num_private_passes x max_grad_norm = {self.num_private_passes} x C the noise "
                "covers. Run the public passes once per logical batch, in its last physical "
                "batch: `if not optimizer.skip_requested:` before `with model.public_pass():`. "
                "See docs/multi_pass.md."
            )

    def clip_and_accumulate(self) -> None:
        """The core's clipping and accumulation; with ``auto_clip_and_accum_on_step=False``
        only checks that :meth:`accumulate_batch` ran (``RuntimeError`` otherwise). Either way
        the next step's manual stages start over."""
        if self.auto_clip_and_accum_on_step:
            super().clip_and_accumulate()
        elif self._manual_stage != _ACCUMULATED:
            raise RuntimeError(
                "auto_clip_and_accum_on_step=False: call clip(), optionally "
                "accum_grads_across_passes(), then accumulate_batch() before step()."
            )
        self._reset_manual_stages()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """The core's ``zero_grad``; the manual stages start over."""
        self._reset_manual_stages()
        super().zero_grad(set_to_none)

    def _reset_manual_stages(self) -> None:
        """Back to "nothing done" for the manual stages of the next step."""
        self._manual_stage = _NOTHING_DONE
        self._folded_passes = 0

    # ------------------------------------------------------------------ manual stages
    # With auto_clip_and_accum_on_step=False the user runs, once per step and in this order:
    # clip(), optionally accum_grads_across_passes(), accumulate_batch(), then step(). Between
    # the stages p.grad_sample holds clipped gradients that may be inspected or edited; the
    # edits are re-checked against the clipping bound before they reach p.summed_grad.
    def clip(self) -> None:
        """Manual stage 1: replaces every ``p.grad_sample`` by its clipped version, each unit
        scaled to norm <= C (with ``accum_passes=True`` the passes are folded first, so
        ``p.grad_sample`` becomes ``(1, B, ...)``). Accumulated (list) per-sample gradients keep
        their list layout."""
        if self.auto_clip_and_accum_on_step:
            raise RuntimeError(
                "clip() is a manual stage: build the optimizer with "
                "auto_clip_and_accum_on_step=False, or let step() clip and accumulate."
            )
        if self._manual_stage != _NOTHING_DONE:
            raise RuntimeError(
                "clip() was already called for this step: call accumulate_batch(), then step()."
            )
        self._check_not_consumed()
        params = self._params_with_grad_sample()
        self._check_grad_sample_layout(params)
        for p in params:
            _check_processed_flag(p.grad_sample)
        views = self._unit_views(params)
        unit_grads = [(p, v) for p, v, _ in views]
        if self.accum_passes:
            unit_grads = [(p, gs.sum(0, keepdim=True)) for p, gs in unit_grads]
        factors = self.compute_clip_factors(unit_grads)
        for (p, gs), f, (_, _, old) in zip(unit_grads, factors, views):
            scaled = gs * f.to(gs.dtype).view(*f.shape, *([1] * (gs.dim() - 2)))
            p.grad_sample = _restore_layout(scaled, p, old)
        for rec in self.records:
            rec.mark_clipped_in_place()
        self._manual_stage = _CLIPPED

    def accum_grads_across_passes(self) -> None:
        """Optional manual stage 2: folds the pass axis of the clipped per-sample gradients,
        ``(P, B, ...)`` becomes ``(1, B, ...)`` (each sample's clipped passes summed). The noised
        sum, and so the privacy, are unchanged."""
        if self._manual_stage != _CLIPPED:
            raise RuntimeError(
                "accum_grads_across_passes() folds clipped per-sample gradients: call it once, "
                "after clip() and before accumulate_batch()."
            )
        params = self._params_with_grad_sample()
        self._check_clipped(params)
        for p in params:
            gs = p.grad_sample
            if _has_pass_axis(gs, p):
                self._folded_passes = max(self._folded_passes, gs.shape[0])
                p.grad_sample = gs.sum(0, keepdim=True)
        self._manual_stage = _FOLDED

    def accumulate_batch(self) -> None:
        """Manual last stage: adds ``Σ_units p.grad_sample`` (already clipped) to ``p.summed_grad``.

        Raises ``ValueError`` if edits since :meth:`clip` pushed a unit above the clipping bound
        (the noise would no longer cover it). Terms added to ``p.summed_grad`` by hand are not
        checked: they must not depend on private data.
        """
        if self._manual_stage not in (_CLIPPED, _FOLDED):
            raise RuntimeError(
                "accumulate_batch() must follow clip() (and optionally "
                "accum_grads_across_passes()), once per step."
                if self._manual_stage == _NOTHING_DONE
                else "accumulate_batch() was already called for this step; call step() next."
            )
        self._begin_physical_step()  # before adding to the pending sums of skipped steps
        params = self._params_with_grad_sample()
        self._check_clipped(params)
        for p, gs, _ in self._unit_views(params):
            _check_processed_flag(p.grad_sample)
            self._add_to_summed_grad(p, gs.sum(dim=(0, 1)))
            _mark_as_processed(p.grad_sample)
        for rec in self.records:
            rec.mark_consumed()
        self._manual_stage = _ACCUMULATED

    def _check_clipped(self, params: list[nn.Parameter]) -> None:
        """Raises ``ValueError`` if a unit of the (clipped) ``p.grad_sample`` exceeds the bound
        its noise is calibrated to: C, or C times the number of folded passes."""
        unit_grads = [(p, v) for p, v, _ in self._unit_views(params)]
        if not unit_grads:
            return
        folds = self._folded_passes if self._manual_stage == _FOLDED else 1
        bound = float(self.max_grad_norm) * max(folds, 1)
        # the flat norm of a unit, whatever a subclass computes for its clip factors
        norms = flat_norms(unit_grads)
        worst = float(norms.max()) if norms.numel() else 0.0
        if worst > bound * (1 + 1e-4) + CLIP_EPS:
            raise ValueError(
                f"A clipped per-sample gradient now has norm {worst:.6g} > {bound:.6g}: it was "
                "changed after clip() and the noise no longer covers it. Clip what you add to "
                "p.grad_sample, or add data-independent terms to p.summed_grad instead."
            )


@functools.cache
def multi_pass_variant(cls: type[DPOptimizer]) -> type[DPOptimizer]:
    """``class MultiPass<Cls>(MultiPassDPOptimizerMixin, cls)``, one per class; ``cls`` itself
    when it already has the mixin. ``DPOptimizer.__new__`` builds instances of it when the
    constructor gets a multi-pass option."""
    if issubclass(cls, MultiPassDPOptimizerMixin):
        return cls
    name = f"MultiPass{cls.__name__}"
    return type(
        name,
        (MultiPassDPOptimizerMixin, cls),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f":class:`{cls.__name__}` with multi-pass training "
            "(:class:`MultiPassDPOptimizerMixin`).",
        },
    )


def _restore_layout(
    units: torch.Tensor, p: nn.Parameter, old: torch.Tensor | list[torch.Tensor]
) -> torch.Tensor | list[torch.Tensor]:
    """Gives clipped ``units`` ``(P, B', ...)`` the layout of ``old`` (the aligned
    ``p.grad_sample``: a list, a single-pass ``(B, ...)`` or a multi-pass tensor)."""
    if isinstance(old, list):
        sizes = [g.shape[0] for g in old]
        return list(units[0, : sum(sizes)].split(sizes))
    if old.dim() == p.dim() + 1:
        return units[0, : old.shape[0]]
    return units[:, : old.shape[1]]


def validate_multi_pass_args(
    multi_pass: bool, accum_passes: bool | None, num_private_passes: int | None
) -> None:
    """Checks the multi-pass arguments of ``make_private`` together (docs/multi_pass.md).

    Raises ``ValueError`` for ``multi_pass=True`` without ``accum_passes``, for
    ``accum_passes``/``num_private_passes`` without ``multi_pass``, and for the inconsistent
    ``accum_passes``/``num_private_passes`` pairs rejected by the optimizer.
    """
    if multi_pass and accum_passes is None:
        raise ValueError(
            "multi_pass=True needs accum_passes: True (sum each sample's gradient over the "
            "passes, clip once, noise sigma*C) or False with num_private_passes (clip every "
            "pass, noise sigma*C*num_private_passes). See docs/multi_pass.md."
        )
    if not multi_pass and (accum_passes is not None or num_private_passes is not None):
        raise ValueError(
            "accum_passes/num_private_passes only apply to multi-pass training: pass "
            "multi_pass=True as well."
        )
    _validate_multi_pass(accum_passes, num_private_passes)


def _validate_multi_pass(accum_passes: bool | None, num_private_passes: int | None) -> None:
    """Raises ``ValueError`` for an ``accum_passes`` / ``num_private_passes`` pair the
    optimizer cannot calibrate noise for (wrong types, split clipping without a positive count,
    a count without split clipping)."""
    if accum_passes is not None and not isinstance(accum_passes, bool):
        raise ValueError(f"accum_passes must be True, False or None, got {accum_passes!r}.")
    if num_private_passes is not None and (
        isinstance(num_private_passes, bool) or not isinstance(num_private_passes, int)
    ):
        raise ValueError(f"num_private_passes must be an int, got {num_private_passes!r}.")
    if accum_passes is False and (num_private_passes is None or num_private_passes < 1):
        raise ValueError(
            "accum_passes=False (split clipping) needs num_private_passes >= 1: the number of "
            "backward passes per step that touch private data (the noise is scaled by it)."
        )
    if accum_passes is not False and num_private_passes is not None:
        raise ValueError(
            "num_private_passes is only meaningful with accum_passes=False (split clipping); "
            "with accum_passes=True each sample is clipped once and the noise is sigma*C."
        )
