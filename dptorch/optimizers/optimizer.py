"""DPOptimizer: the clipping/noising core of DP-SGD, wrapping any ``torch.optim.Optimizer``.

Every variant (per-layer clipping, adaptive clipping, distributed, multi-pass, fast clipping)
extends this class by overriding one stage of :meth:`DPOptimizer.pre_step`. Multi-pass training
(several backward passes per step, manual clipping stages) is a mixin of its own,
:mod:`dptorch.optimizers.multi_pass`: a DP optimizer built with a multi-pass option is an
instance of its class's multi-pass variant (see :class:`_MultiPassDispatch`).

Per-sample gradients are read from ``p.grad_sample``: ``(B, *p.shape)`` for one backward pass,
or a list of those when gradients were accumulated over several passes (``(P, B, *p.shape)``
in multi-pass mode). Internally everything is viewed as ``(P, B, *p.shape)``; a *unit* is one
(pass, sample) pair and is what gets clipped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from ..accountants.accountant import release_event
from ..accountants.events import GaussianEvent, PrivacyEvent
from ..clipping import ClippingContract
from ..grad_sample.gsm_base import _check_loss_reduction, clear_grad_sample
from ..grad_sample.step_record import StepRecord, records_for, records_version
from ..utils.randomness import generate_noise
from .arguments import check_noise_generator, check_noise_multiplier
from .multi_pass import multi_pass_variant
from .unit_grads import (
    UnitGrads,
    _as_passes,
    _check_processed_flag,
    _has_pass_axis,
    _mark_as_processed,
    flat_norms,
    multi_pass_requested,
)
from .utils import params as optimizer_params

__all__ = ["DPOptimizer"]


def _generate_noise(
    std: float,
    reference: torch.Tensor,
    generator: torch.Generator | None = None,
    secure_mode: bool = False,
) -> torch.Tensor:
    """``N(0, std²)`` noise shaped like ``reference`` (OS CSPRNG when ``secure_mode``)."""
    return generate_noise(std, reference, generator=generator, secure_mode=secure_mode)


def _draw_flat_noise(
    owner: Any, params: list[nn.Parameter], std: float
) -> dict[int, torch.Tensor]:
    """``{id(p): N(0, std²) noise of p.summed_grad's shape}``: one ``normal_`` of the owner's
    generator per (dtype, device) into a flat buffer kept on ``owner`` (grown when needed)."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.summed_grad.dtype, p.summed_grad.device), []).append(p)
    buffers = owner.__dict__.setdefault("_noise_buffers", {})
    out = {}
    for key, ps in groups.items():
        n = sum(p.summed_grad.numel() for p in ps)
        buf = buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = buffers[key] = torch.empty(n, dtype=key[0], device=key[1])
        flat = buf[:n].normal_(0.0, std, generator=owner.generator)
        for p, chunk in zip(ps, flat.split([p.summed_grad.numel() for p in ps])):
            out[id(p)] = chunk.view(p.summed_grad.shape)
    return out


def _wrapped(name: str, doc: str) -> property:
    """An attribute of the wrapped optimizer, read and written through by the DP optimizer."""
    return property(
        lambda self: getattr(self.original_optimizer, name),
        lambda self, value: setattr(self.original_optimizer, name, value),
        doc=doc,
    )


def _has_nonzero_grad(p: torch.Tensor) -> bool:
    """Whether ``p.grad`` holds a gradient: ``zero_grad(set_to_none=False)`` leaves zeros on a
    parameter that the next backward pass may not reach, which is no gradient."""
    return p.grad is not None and bool(p.grad.any())


def _get_flat_grad_sample(p: torch.Tensor) -> torch.Tensor:
    """``p.grad_sample`` as one tensor: accumulated lists are concatenated along the batch."""
    gs = getattr(p, "grad_sample", None)
    if gs is None:
        raise ValueError(
            "Per-sample gradient not found for a trainable parameter. Wrap the model in "
            "dptorch.GradSampleModule (or use PrivacyEngine.make_private) and run backward "
            "before optimizer.step()."
        )
    if isinstance(gs, list):
        return torch.cat(gs, dim=0)
    return gs


class _StepHooks:
    """Several step hooks called in order, as one callable."""

    def __init__(self, hooks: tuple[Callable[[Any], None], ...]):
        self.hooks = hooks

    def __call__(self, optimizer: Any) -> None:
        for hook in self.hooks:
            hook(optimizer)


class _MultiPassDispatch(Optimizer):
    """Base of :class:`DPOptimizer` that picks the class of a new instance: a multi-pass option
    among the constructor's keyword arguments gives the class's multi-pass variant,
    ``class MultiPass<Cls>(MultiPassDPOptimizerMixin, Cls)``
    (:func:`dptorch.optimizers.multi_pass.multi_pass_variant`), so that
    ``DPOptimizer(..., accum_passes=True)`` works while the core holds no multi-pass code.

    ``__new__`` lives here rather than on DPOptimizer so that ``inspect.signature`` of the
    optimizer classes still shows their ``__init__``.
    """

    #: False for optimizers without per-sample gradients (fast clipping); their ``__init__``
    #: refuses the multi-pass options.
    supports_multi_pass: ClassVar[bool] = True

    def __new__(cls, *args: Any, **kwargs: Any) -> _MultiPassDispatch:
        if cls.supports_multi_pass and multi_pass_requested(kwargs):
            cls = multi_pass_variant(cls)
        return super().__new__(cls)


class DPOptimizer(_MultiPassDispatch):
    """Wraps ``optimizer`` so that ``step()`` performs a DP-SGD step.

    ``step()`` = :meth:`pre_step` (clip each sample's gradient to norm ``max_grad_norm``, sum,
    add ``N(0, (noise_multiplier · max_grad_norm)²)`` noise, divide by the expected batch size
    for ``loss_reduction="mean"``, run step hooks) then the wrapped optimizer's ``step``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        noise_multiplier: σ, the ratio of the noise std to the clipping norm (>= 0).
        max_grad_norm: C, the per-sample gradient L2 clipping norm (> 0).
        expected_batch_size: the expected (logical) batch size, ``q · N``; required for "mean".
        loss_reduction: ``"mean"`` or ``"sum"``, as in the loss.
        generator: ``torch.Generator`` for the noise (ignored in secure mode).
        secure_mode: draw noise from the OS CSPRNG.
        accum_passes / num_private_passes / auto_clip_and_accum_on_step: multi-pass training, see
            docs/multi_pass.md. ``accum_passes=True`` sums each sample's gradient over passes and
            clips once; ``False`` clips every pass and multiplies the noise by
            ``num_private_passes``; ``auto_clip_and_accum_on_step=False`` leaves clipping and
            accumulation to the manual stages. Any of them makes the new optimizer an instance
            of the class's multi-pass variant (:mod:`dptorch.optimizers.multi_pass`), which
            handles them; they are named here so that the signature lists them.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        accum_passes: bool | None = None,
        num_private_passes: int | None = None,
        auto_clip_and_accum_on_step: bool = True,
        **kwargs,
    ):
        _check_loss_reduction(loss_reduction)
        check_noise_multiplier(noise_multiplier, max_grad_norm)
        check_noise_generator(generator, secure_mode=secure_mode)
        self.clipping = self._make_contract(optimizer, max_grad_norm)
        if loss_reduction == "mean" and (expected_batch_size is None or expected_batch_size <= 0):
            raise ValueError(
                "expected_batch_size must be a positive integer with loss_reduction='mean' "
                f"(got {expected_batch_size}); it is sample_rate * len(dataset)."
            )
        if multi_pass_requested(
            dict(
                accum_passes=accum_passes,
                num_private_passes=num_private_passes,
                auto_clip_and_accum_on_step=auto_clip_and_accum_on_step,
            )
        ):
            # the multi-pass variant consumes these; here they reached a class without it
            why = (
                "it does not support multi-pass clipping; train with one backward pass per step"
                if not type(self).supports_multi_pass
                else "pass it to the optimizer's constructor (not to DPOptimizer.__init__), or "
                "derive from dptorch.optimizers.multi_pass.MultiPassDPOptimizerMixin"
            )
            raise ValueError(
                f"{type(self).__name__} got a multi-pass option (accum_passes, "
                f"num_private_passes or auto_clip_and_accum_on_step=False): {why}."
            )
        self.original_optimizer = optimizer
        self.noise_multiplier = noise_multiplier
        self.loss_reduction = loss_reduction
        self.expected_batch_size = expected_batch_size
        self.generator = generator
        self.secure_mode = secure_mode
        #: run in order at every real step (the accountant's first); see :attr:`step_hook`
        self.step_hooks: list[Callable[[DPOptimizer], None]] = []
        #: ``(do_skip, physical_batch)`` of each :meth:`signal_skip_step` request not yet used
        self._skip_requests: list[tuple[bool, bool]] = []
        #: ``[logical batch id, is last, stepped, zeroed]`` of the physical batch being trained on
        #: (:meth:`begin_physical_batch`, BatchMemoryManager's loader); ``None`` outside one
        self._physical_batch: list | None = None
        self._pending_logical: int | None = None  # the logical batch of the pending sums
        self._skipped_batches = 0  # loader batches in the pending sums (non-physical skips)
        self.grad_accumulation_allowed = True
        self._is_last_step_skipped = False
        self._step_hooks_deferred = False
        self._summed_bound: float | tuple[float, ...] | None = None  # C of the pending sum
        for p in self.params:
            p.summed_grad = None

    # ------------------------------------------------------------------ the clipping contract
    def _make_contract(
        self, optimizer: Optimizer, max_grad_norm: float | list[float]
    ) -> ClippingContract:
        """The :class:`ClippingContract` this optimizer owns (flat here)."""
        if isinstance(max_grad_norm, (list, tuple)):
            raise ValueError(
                "A list of max_grad_norm is per-layer clipping: use clipping='per_layer' "
                "(DPPerLayerOptimizer)."
            )
        return ClippingContract(max_grad_norm)

    @property
    def max_grad_norm(self) -> float:
        """C, the sensitivity of one sample's clipped gradient (the shared contract's)."""
        return self.clipping.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self.clipping.max_grad_norm = value

    @property
    def records(self) -> list[StepRecord]:
        """The step records of the modules that wrap this optimizer's parameters.

        Looked up again whenever the trainable parameters of the groups or the links between
        parameters and records (:func:`~dptorch.grad_sample.step_record.records_version`)
        change; the cache holds the parameters themselves, so their ids cannot be reused."""
        params = self.params
        key = (records_version(), tuple(map(id, params)))
        cached = self.__dict__.get("_records_cache")
        if cached is None or cached[0] != key:
            cached = self._records_cache = (key, params, records_for(params))
        return list(cached[2])

    # ------------------------------------------------------------------ torch.optim plumbing

    def __getattr__(self, item: str) -> Any:
        # torch.optim internals (hooks dicts, _opt_called, ...) live on the wrapped optimizer
        if item == "original_optimizer":
            raise AttributeError(item)
        return getattr(self.original_optimizer, item)

    # read and written through at every access, never copied: the wrapped optimizer's
    # load_state_dict replaces its param_groups list, and a copy taken earlier would miss the
    # groups added afterwards (their parameters would be updated unclipped)
    param_groups = _wrapped("param_groups", "The wrapped optimizer's param groups.")
    defaults = _wrapped("defaults", "The wrapped optimizer's defaults.")
    state = _wrapped("state", "The wrapped optimizer's per-parameter state.")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict`` (the DP settings are saved by the engine)."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state."""
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a param group to the wrapped optimizer (whose ``param_groups`` this one reads)."""
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.original_optimizer!r})"

    # ------------------------------------------------------------------ views
    @property
    def params(self) -> list[nn.Parameter]:
        """Trainable parameters of every param group."""
        return optimizer_params(self)

    def _params_with_grad_sample(self) -> list[nn.Parameter]:
        """Parameters that took part in the backward pass(es) since the last step."""
        out = []
        for p in self.params:
            if getattr(p, "grad_sample", None) is not None:
                out.append(p)
            elif _has_nonzero_grad(p):
                _get_flat_grad_sample(p)  # raises: a gradient without per-sample gradient
        return out

    @property
    def grad_samples(self) -> list[torch.Tensor]:
        """Per-sample gradients of every parameter that has them (lists concatenated)."""
        return [_get_flat_grad_sample(p) for p in self._params_with_grad_sample()]

    @property
    def accumulated_iterations(self) -> int:
        """Number of backward passes accumulated since the last step (1 without accumulation)."""
        recs = self.records
        if len(recs) == 1 and len(recs[0].passes) > 1:
            return len(recs[0].passes)
        vals = set()
        for p in self._params_with_grad_sample():
            gs = p.grad_sample
            vals.add(len(gs) if isinstance(gs, list) else 1)
        if len(vals) > 1:
            raise ValueError(
                "Parameters accumulated different numbers of backward passes; call "
                "optimizer.zero_grad() before each logical batch."
            )
        return vals.pop() if vals else 1

    @property
    def noise_scale_factor(self) -> int:
        """Sensitivity of the clipped sum in units of ``max_grad_norm``: one sample changes it by
        at most one clipped unit (multi-pass split clipping overrides this)."""
        return 1

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise added to the clipped sum: ``σ · C · noise_scale_factor``."""
        if self.noise_multiplier == 0:
            return 0.0
        return self.noise_multiplier * self.max_grad_norm * self.noise_scale_factor

    # ------------------------------------------------------------------ the DP-SGD stages
    def _unit_grad_samples(self) -> UnitGrads:
        """``(p, per-unit gradient (P, B, *p.shape))`` of every parameter with per-sample
        gradients, aligned by the step record; the units are what gets clipped."""
        params = self._params_with_grad_sample()
        self._check_grad_sample_layout(params)
        return [(p, v) for p, v, _ in self._unit_views(params)]

    def _check_grad_sample_layout(self, params: list[nn.Parameter]) -> None:
        """Refuses multi-pass per-sample gradients ``(n_passes, B, ...)``: their noise
        calibration depends on multi-pass settings this optimizer does not have."""
        for p in params:
            if _has_pass_axis(p.grad_sample, p):
                raise ValueError(
                    "Per-sample gradients have a pass axis (n_passes, B, ...) (GradSampleModule("
                    "multi_pass=True)) but the optimizer has accum_passes=None. Choose "
                    "accum_passes=True (sum each sample's passes, clip once) or accum_passes=False "
                    "with num_private_passes (clip every pass, noise x num_private_passes)."
                )

    def per_sample_norms(self, unit_grads: UnitGrads | None = None) -> torch.Tensor:
        """L2 norm over all parameters of each unit's gradient, ``(P, B)``. With a batch layout
        (fixed-shape or user-level loader), a row's norm is that of its unit's summed gradient
        (its own for a record) and a padding row's is 0."""
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        norms = flat_norms(unit_grads)
        layout = self.clipping.layout(norms.shape[-1], "DPOptimizer") if unit_grads else None
        if layout is None:
            return norms
        if layout.one_row_per_group:
            return norms * layout.valid.to(norms.device, norms.dtype)
        return sum(layout.unit_norm_sq(gs, dim=1) for _, gs in unit_grads).sqrt()

    def compute_clip_factors(self, unit_grads: UnitGrads | None = None) -> list[torch.Tensor]:
        """Per-parameter clip factors ``(P, B)``: ``min(1, C / (norm + 1e-6))``."""
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        norms = self.per_sample_norms(unit_grads)
        factor = self.clipping.flat_factors(norms)
        return [factor] * len(unit_grads)

    def clip_and_accumulate(self) -> None:
        """Clips each unit's gradient and adds the sum over units to ``p.summed_grad``."""
        self._check_not_consumed()
        unit_grads = self._unit_grad_samples()
        for p, _ in unit_grads:
            _check_processed_flag(p.grad_sample)
        factors = self.compute_clip_factors(unit_grads)
        for (p, gs), f in zip(unit_grads, factors):
            self._add_to_summed_grad(p, torch.einsum("pb,pb...->...", f.to(gs.dtype), gs))
            _mark_as_processed(p.grad_sample)
        for rec in self.records:
            rec.mark_consumed()

    def _check_not_consumed(self) -> None:
        """Raises when the module's per-sample results were already spent by a step (no
        ``zero_grad`` since)."""
        if any(rec.consumed for rec in self.records):
            raise ValueError(
                "Gradients haven't been cleared since the last optimizer step. Call "
                "optimizer.zero_grad() after every optimizer.step(), or the same per-sample "
                "gradients would be used (and their privacy spent) twice."
            )

    def _add_to_summed_grad(self, p: nn.Parameter, g: torch.Tensor) -> None:
        """``p.summed_grad += g`` (``g`` itself when nothing is pending)."""
        if getattr(p, "summed_grad", None) is None:  # (absent: unfrozen after construction)
            p.summed_grad = g
        else:
            p.summed_grad = p.summed_grad + g

    # noise, scaling, step --------------------------------------------------------------------
    def add_noise(self) -> None:
        """``p.grad = p.summed_grad + N(0, (σ · C · noise_scale_factor)²)``.

        Without secure mode the noise of all parameters (of one dtype and device) is one draw
        of torch's generator into a flat buffer allocated once, added in place to the clipped
        sum, which becomes ``p.grad`` (never a view of the noise buffer): the step allocates no
        parameter-sized tensor. So after the step ``p.summed_grad`` holds the noisy sum, as
        ``p.grad`` does; read the clipped sum between ``backward()`` and ``step()``. Secure
        mode draws each tensor from the OS CSPRNG."""
        std = self.noise_std
        params = self.params
        for p in params:
            _check_processed_flag(p.summed_grad)
        flat = None if self.secure_mode or std == 0 else _draw_flat_noise(self, params, std)
        if flat is None:
            for p in params:
                noise = _generate_noise(std, p.summed_grad, self.generator, self.secure_mode)
                p.grad = noise.add_(p.summed_grad).view_as(p)  # in place: one tensor, not two
        elif params:  # one fused add for all parameters (few kernel launches on a GPU)
            # in place where the sum owns its memory: contiguous, so no element is shared
            inplace = [p for p in params if p.summed_grad.is_contiguous()]
            copied = [p for p in params if not p.summed_grad.is_contiguous()]
            if inplace:
                torch._foreach_add_([p.summed_grad for p in inplace], [flat[id(p)] for p in inplace])
            for p in copied:
                p.summed_grad = p.summed_grad + flat[id(p)]
            for p in params:
                g = p.summed_grad
                p.grad = g if g.shape == p.shape else g.view_as(p)
        for p in params:
            _mark_as_processed(p.summed_grad)

    def scale_grad(self) -> None:
        """Divides ``p.grad`` by ``expected_batch_size × accumulated_iterations`` for "mean"."""
        if self.loss_reduction == "mean":
            denom = self.expected_batch_size * self.accumulated_iterations
            grads = [p.grad for p in self.params]
            if grads:
                torch._foreach_div_(grads, denom)

    def signal_skip_step(self, do_skip: bool = True, *, physical_batch: bool = False) -> None:
        """Asks the next ``step()`` to only clip and accumulate (a physical batch of a logical
        one): no noise, no parameter update, no accounting.

        After :meth:`forbid_grad_accumulation` (``make_private`` with Poisson sampling) a skip
        must come from a splitter of *one* drawn batch (``physical_batch=True``: what
        DPTrainer passes); a skip across the loader's batches raises
        ``ValueError``: two Poisson batches summed and noised once are not one Poisson batch
        (a record drawn into both counts twice, and the step would be charged as one)."""
        if do_skip and not physical_batch and not self.grad_accumulation_allowed:
            raise ValueError(
                "optimizer.signal_skip_step(True) would add this batch's clipped gradients to "
                "the next batch's and release them with one draw of noise, but the batches are "
                "Poisson samples: two Poisson batches are not one (a record drawn into both "
                "contributes up to 2·max_grad_norm while the noise covers max_grad_norm, and the "
                "accountant would charge one step at the sample rate of one batch). For large "
                "logical batches under a memory limit use "
                "dptorch.utils.batch_memory_manager.BatchMemoryManager, which splits one Poisson "
                "batch into physical batches; or raise the batch size (sample rate)."
            )
        self._skip_requests.append((do_skip, physical_batch))

    @property
    def _step_skip_queue(self) -> list[bool]:
        """The pending :meth:`signal_skip_step` requests (a copy, oldest first)."""
        return [do_skip for do_skip, _ in self._skip_requests]

    def begin_physical_batch(self, logical_id: int, is_last: bool) -> None:
        """Called by BatchMemoryManager's loader as it yields a physical batch: the next
        ``step()`` is that batch's, skipped unless ``is_last`` (the batch ends logical batch
        ``logical_id``), and adds only to clipped sums of the same logical batch.

        The previous physical batch must be done with, stepped or dropped with ``zero_grad()``:
        a loop that fetches the next batch before stepping the current one (a prefetching
        wrapper, two loaders zipped) would step each batch under the next one's tag, mixing
        two Poisson batches in one release. That raises ``ValueError``."""
        prev = self._physical_batch
        if prev is not None and not (prev[2] or prev[3]):
            self._physical_batch = None
            raise ValueError(
                "BatchMemoryManager's loader yielded a physical batch before the previous one "
                "was stepped or dropped (a wrapper that fetches batches ahead, such as a GPU "
                "prefetcher, Lightning's or Accelerate's fetchers, or two loaders iterated at "
                "once): the optimizer ties each step to the batch yielded last, so the steps "
                "would be taken under the wrong batch's tag and release records of two Poisson "
                "batches together. Iterate the BatchMemoryManager loader directly, one batch at "
                "a time, calling optimizer.step() (or optimizer.zero_grad() to drop a batch) "
                "before taking the next."
            )
        self._physical_batch = [logical_id, is_last, False, False]

    def end_physical_batches(self) -> None:
        """No physical batch is being trained on any more (a BatchMemoryManager pass ended)."""
        self._physical_batch = None

    def forbid_grad_accumulation(self) -> None:
        """Refuse skipped steps across the loader's batches (see :meth:`signal_skip_step`);
        ``make_private`` calls it under Poisson sampling."""
        self.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        """Undoes :meth:`forbid_grad_accumulation`. A ``step()`` that would release the sum of
        several Poisson batches is still refused (``ValueError``, see :meth:`privacy_event`);
        with fixed-size batches accumulation is charged per pass."""
        self.grad_accumulation_allowed = True

    @property
    def skip_requested(self) -> bool:
        """Whether the next ``step()`` is asked to skip (:meth:`signal_skip_step`, or a
        physical batch of BatchMemoryManager that does not end its logical batch)."""
        return self._check_skip_next_step(pop_next=False)

    def take_skip_request(self) -> bool:
        """Consumes the next :meth:`signal_skip_step` request, as ``step()`` does; returns it
        (``False`` without one)."""
        return self._check_skip_next_step()

    def discard_step(self) -> None:
        """Drops every gradient, per-sample gradient and pending clipped sum (a skipped step's
        included): for a step whose computation never ran (a failed CUDA-graph capture)."""
        self._is_last_step_skipped = False
        self.zero_grad(set_to_none=True)

    def _drop_pending(self) -> None:
        """Forgets the clipped sums kept by skipped steps (never released), leaving the
        gradients of the step under way."""
        for p in self.params:
            p.summed_grad = None
        self._summed_bound = None
        self._is_last_step_skipped = False
        self._pending_logical = None
        self._skipped_batches = 0

    def _next_skip(self, pop_next: bool = True) -> tuple[bool, bool]:
        """``(skip, physical)`` for the next step: the physical batch being trained on decides
        (skip unless it ends its logical batch), else the oldest :meth:`signal_skip_step`
        request; ``physical``: the skip splits one drawn batch. ``pop_next`` consumes it."""
        tag = self._physical_batch
        if tag is not None and not tag[2]:
            if pop_next:
                tag[2] = True
            return not tag[1], True
        if self._skip_requests:
            return self._skip_requests.pop(0) if pop_next else self._skip_requests[0]
        return False, False

    def _check_skip_next_step(self, pop_next: bool = True) -> bool:
        """Whether the next step is to be skipped (``signal_skip_step``, or a physical batch of
        BatchMemoryManager that does not end its logical batch); ``pop_next`` consumes it."""
        return self._next_skip(pop_next)[0]

    def _splits_logical_batch(self) -> bool:
        """Whether the next step is a physical batch that does not end its logical batch."""
        skip, physical = self._next_skip(pop_next=False)
        return skip and physical

    def _begin_physical_step(self) -> None:
        """Ties a step to the physical batch of BatchMemoryManager trained on. Refuses a second
        step for it and skip requests inside the loop; drops pending clipped sums of another
        logical batch (its last physical batch was dropped by the training loop, so it was never
        released): added to this one, they would release records of two Poisson draws as one."""
        tag = self._physical_batch
        if tag is None:
            return
        logical_id, _, stepped, _ = tag
        if stepped:
            raise ValueError(
                "optimizer.step() was called twice for one physical batch of BatchMemoryManager: "
                "each physical batch is one step (skipped unless it ends its logical batch). "
                "Call step() and zero_grad() once per batch the loader yields."
            )
        if self._skip_requests:
            raise ValueError(
                "optimizer.signal_skip_step() inside a BatchMemoryManager loop: the loader decides "
                "which physical batches are skipped (all but the last of each logical batch), "
                "and a request of yours would be applied to another batch. Remove the call; "
                "for larger logical batches raise the data loader's batch size."
            )
        if self._is_last_step_skipped and self._pending_logical != logical_id:
            warnings.warn(
                "BatchMemoryManager: a logical batch ended without its last physical batch being "
                "stepped (the training loop dropped it, e.g. `zero_grad(); continue`), so it was "
                "never released: its clipped gradients are dropped rather than added to the next "
                "logical batch (a different Poisson draw).",
                RuntimeWarning,
                stacklevel=4,
            )
            self._drop_pending()

    @property
    def batches_in_step(self) -> int:
        """Loader batches summed into the pending release: this step's
        :attr:`accumulated_iterations` plus those of the steps skipped by
        ``signal_skip_step`` since the last release (physical batches of BatchMemoryManager or
        DPTrainer are parts of one batch and add nothing)."""
        return self._skipped_batches + self.accumulated_iterations

    def privacy_event(self, sample_rate: float, steps_per_epoch: int | None = None) -> PrivacyEvent:
        """The privacy event of one released step (what the accountant hook composes): a
        Gaussian with noise ``σ·k`` and sensitivity ``k`` clipped units (``k`` =
        ``noise_scale_factor``: the private passes of split multi-pass clipping, else 1; public
        passes add nothing) on the :attr:`batches_in_step` loader batches summed into the
        release (:func:`~dptorch.accountants.accountant.release_event`): one Poisson batch of
        rate ``sample_rate`` (several raise ``ValueError``: independent Poisson draws summed
        are not one Poisson step), or, with ``steps_per_epoch`` (fixed-size batches), a batch
        of a pass of ``steps_per_epoch // batches_in_step`` releases."""
        k = self.noise_scale_factor
        gaussian = GaussianEvent(self.noise_multiplier * k, sensitivity=k)
        batches = self.batches_in_step
        return release_event(gaussian, sample_rate, batches=batches,
                             steps_per_epoch=steps_per_epoch)

    def _check_release(self) -> None:
        """Raises, before any noise is drawn, the ``ValueError`` of a step hook that could not
        charge this release (its ``check_release``: the accountant's hook, see
        :meth:`~dptorch.accountants.accountant.IAccountant.get_optimizer_hook_fn`)."""
        for hook in self.step_hooks:
            check = getattr(hook, "check_release", None)
            if callable(check):
                check(self)

    def attach_step_hook(self, fn: Callable[[DPOptimizer], None]) -> None:
        """``fn(optimizer)`` runs at every real (non-skipped) step, after noise, after the hooks
        attached before it. Unlike Opacus, where a second hook replaces the first, attaching a
        hook never detaches the accountant's: a replaced accountant hook would stop counting
        steps and under-report epsilon without a word."""
        self.step_hooks.append(fn)

    @property
    def step_hook(self) -> Callable[[DPOptimizer], None] | None:
        """Opacus's attribute: the step hooks as one callable (``None`` without hooks).
        Assigning it replaces every hook, the accountant's included, as in Opacus: wrap the
        previous value to keep it."""
        hooks = tuple(self.step_hooks)
        if len(hooks) <= 1:
            return hooks[0] if hooks else None
        return _StepHooks(hooks)

    @step_hook.setter
    def step_hook(self, fn: Callable[[DPOptimizer], None] | None) -> None:
        self.step_hooks = [] if fn is None else [fn]

    def pre_step(self, closure: Callable | None = None) -> bool:
        """Clip, accumulate, noise, scale and run hooks; ``False`` when the step is skipped."""
        self._check_frozen_grads()
        self._begin_physical_step()
        self._check_pending_bound()
        self.clip_and_accumulate()
        tag = self._physical_batch
        skip, physical = self._next_skip()
        if skip:
            if not physical:
                self._skipped_batches += self.accumulated_iterations
            self._pending_logical = tag[0] if tag is not None else None
            self._is_last_step_skipped = True
            return False
        self._check_release()
        self._ensure_summed_grads()
        self.add_noise()
        self.scale_grad()
        for rec in self.records:
            rec.mark_released()
        if not self._step_hooks_deferred:
            self.run_step_hooks()
        self._is_last_step_skipped = False
        return True

    def run_step_hooks(self) -> None:
        """Runs the step hooks (the accountant's first), as every real step does."""
        for hook in tuple(self.step_hooks):
            hook(self)

    @contextmanager
    def deferred_step_hooks(self) -> Iterator[None]:
        """Inside, a real step runs no step hook: for a caller that executes the step later
        (a CUDA graph captures it, :mod:`dptorch.graphed_step`) and then calls
        :meth:`run_step_hooks` once per execution."""
        self._step_hooks_deferred = True
        try:
            yield
        finally:
            self._step_hooks_deferred = False

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` only clipped and accumulated (``signal_skip_step``)."""
        return self._is_last_step_skipped

    def _check_frozen_grads(self) -> None:
        """The wrapped optimizer updates every parameter of its groups that has a ``.grad``, but
        only trainable ones are clipped and noised: a parameter frozen after the backward pass
        gave it a gradient would be released raw."""
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad and _has_nonzero_grad(p):
                    raise ValueError(
                        f"A parameter of shape {tuple(p.shape)} was frozen (requires_grad=False) "
                        "after the backward pass gave it a gradient: optimizer.step() would "
                        "apply that gradient unclipped and without noise. Freeze or unfreeze "
                        "parameters between optimizer.zero_grad() and the next forward pass."
                    )

    def _check_pending_bound(self) -> None:
        """The clipped sums kept over skipped steps (a logical batch of several physical ones)
        must all be clipped with one bound, the one the noise is calibrated to."""
        snap = self.clipping.snapshot()
        pending = any(getattr(p, "summed_grad", None) is not None for p in self.params)
        if pending and self._summed_bound is not None and self._summed_bound != snap:
            raise ValueError(
                f"max_grad_norm changed from {self._summed_bound} to {snap} within a logical "
                "batch (between the physical steps of BatchMemoryManager or signal_skip_step): "
                "the clipped sum mixes two bounds and the noise would be calibrated to the last "
                "one only. Change max_grad_norm (or step a grad-clip scheduler) after a real "
                "optimizer.step()."
            )
        self._summed_bound = snap

    def _ensure_summed_grads(self) -> None:
        """Every trainable parameter is released with noise at every step, even when no sample
        reached it (an empty Poisson batch): skipping the noise would reveal that the batch was
        empty, which the DP guarantee does not allow."""
        for p in self.params:
            if getattr(p, "summed_grad", None) is None:
                p.summed_grad = torch.zeros_like(p)

    def step(self, closure: Callable | None = None) -> Any:
        """One DP-SGD step (skipped steps only accumulate)."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.pre_step():
            return self.original_optimizer.step()
        return None

    def _unit_views(
        self, params: list[nn.Parameter]
    ) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | list[torch.Tensor]]]:
        """:func:`_unit_views` aligned by the step record's passes."""
        recs = self.records
        passes = recs[0].passes if len(recs) == 1 else None
        return _unit_views(params, passes)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clears gradients (``p.grad`` zeroed, or ``None`` with ``set_to_none=True``) and sets
        ``p.grad_sample = None`` whatever ``set_to_none`` (as Opacus); keeps ``summed_grad`` after
        a skipped step so that physical batches accumulate into one logical batch. Starts a new
        step record."""
        if self._physical_batch is not None:
            self._physical_batch[3] = True  # the batch may be dropped now (see begin_physical_batch)
        for rec in self.records:
            rec.reset()
        for p in self.params:
            clear_grad_sample(p)
            p.grad_sample = None
            if not self._is_last_step_skipped:
                p.summed_grad = None
        if not self._is_last_step_skipped:
            self._summed_bound = None
            self._pending_logical = None
            self._skipped_batches = 0
        self.original_optimizer.zero_grad(set_to_none)
        for rec in self.records:
            rec.mark_zeroed(self.params)


def _aligned(p: nn.Parameter, passes: list) -> torch.Tensor | list[torch.Tensor]:
    """``p.grad_sample`` of accumulated single-pass backward passes as one entry per recorded
    pass, zeros ``(B_pass, *p.shape)`` where a pass did not reach ``p``: sample ``i`` of a pass
    must line up with sample ``i`` of the same pass in every parameter."""
    gs = p.grad_sample
    if len(passes) < 2 or _has_pass_axis(gs, p):
        return gs
    entries = gs if isinstance(gs, list) else [gs]
    if len(entries) == len(passes):
        return gs
    it = iter(entries)
    out = []
    for r in passes:
        if id(p) in r.covered:
            out.append(next(it))
        else:
            out.append(entries[0].new_zeros((r.batch_size or 0, *p.shape)))
    return out


def _unit_views(
    params: list[nn.Parameter], passes: list | None = None
) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | list[torch.Tensor]]]:
    """``(p, per-unit view (P, B, *p.shape), aligned grad_sample)``: accumulated lists aligned
    by the step record's passes (:func:`_aligned`) and concatenated. Every view must have the same
    ``(P, B)``: row ``i`` of each parameter is sample ``i``, so rows are never padded."""
    views = []
    for p in params:
        gs = _aligned(p, passes or [])
        flat = torch.cat(gs, dim=0) if isinstance(gs, list) else gs
        views.append((p, _as_passes(flat, p), gs))
    shapes = {tuple(v.shape[:2]) for _, v, _ in views}
    if len(shapes) > 1:
        raise ValueError(
            "Per-sample gradients of this step have different numbers of rows (passes, samples): "
            f"{sorted(shapes)}. Row i of every parameter must be sample i of one batch, so they "
            "cannot be clipped together. Run one forward and backward pass of one batch through "
            "the wrapped model (or models of equal batch size) per optimizer step, and call "
            "optimizer.zero_grad() between steps."
        )
    return views
