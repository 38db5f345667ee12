"""Hooks-based per-sample gradients (``grad_sample_mode="hooks"`` and ``"functorch"``).

Mechanism: a forward hook on every module that owns trainable parameters keeps that call's
inputs and registers a tensor hook on its output. When autograd delivers the gradient of the
output (the *backprops*), the layer's grad sampler (or ``torch.func`` as a fallback) turns
inputs and backprops into per-sample gradients, which are summed over every call of the layer
in the same backward pass (recurrent use, tied weights). At the end of the backward pass a
callback queued on the autograd engine publishes them as ``p.grad_sample``.

Multi-pass mode (``multi_pass=True``): every backward pass between two optimizer steps adds one
slice, so ``p.grad_sample`` has shape ``(n_passes, B, *p.shape)``; batches shorter than the
longest pass are zero-padded (a zero per-sample gradient contributes nothing after clipping).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from .functorch import ft_compute_per_sample_gradient
from .gsm_base import ACCUMULATION_FORBIDDEN_MESSAGE, AbstractGradSampleModule
from .registry import GRAD_SAMPLERS
from .unit_params import trainable_units

logger = logging.getLogger(__name__)


def create_or_accumulate_grad_sample(
    *, param: torch.Tensor, grad_sample: torch.Tensor, max_batch_len: int
) -> None:
    """Adds ``grad_sample`` ``(b, *param.shape)`` to ``param._current_grad_sample``, creating it
    on the first call of the backward pass; both are zero-padded along the batch to the longer
    of them, and at least to ``max_batch_len`` (a layer fed shrinking batches). No-op for a
    frozen parameter."""
    if not param.requires_grad:
        return
    cur = getattr(param, "_current_grad_sample", None)
    if cur is None:
        n = max(grad_sample.shape[0], max_batch_len)
        cur = grad_sample if grad_sample.shape[0] == n else _pad_batch(grad_sample, n)
    else:
        n = max(cur.shape[0], grad_sample.shape[0])
        if grad_sample.shape[0] < n:
            grad_sample = _pad_batch(grad_sample, n)
        if cur.shape[0] < n:
            cur = _pad_batch(cur, n)
        cur = cur + grad_sample  # out of place: ``cur`` may alias a gradient owned by autograd
    param._current_grad_sample = cur


def promote_current_grad_sample(p: nn.Parameter) -> None:
    """Publishes ``p._current_grad_sample`` (one backward pass) as ``p.grad_sample``; a second
    pass without ``zero_grad`` makes ``p.grad_sample`` a list, one entry per pass."""
    if not p.requires_grad:
        return
    gs = p._current_grad_sample
    del p._current_grad_sample
    prev = getattr(p, "grad_sample", None)
    if prev is None:
        p.grad_sample = gs
    elif isinstance(prev, list):
        prev.append(gs)
    else:
        p.grad_sample = [prev, gs]


class GradSampleModule(AbstractGradSampleModule):
    """Hooks-based implementation of :class:`AbstractGradSampleModule`.

    Args:
        m: the module to wrap.
        batch_first: whether the batch is dimension 0 of every layer's input/output (else 1).
        loss_reduction: ``"mean"`` or ``"sum"``, the reduction of the loss over the batch; with
            ``"mean"`` the per-sample gradients are rescaled so that their mean equals ``p.grad``.
        strict: raise ``NotImplementedError`` if the model cannot get exact per-sample gradients
            (BatchNorm, an unsupported layer). With ``False`` the problems are only logged.
        force_functorch: use ``torch.func`` for every layer instead of the registered samplers.
        multi_pass: keep one slice per backward pass: ``p.grad_sample`` is ``(n_passes, B, ...)``.
            A second backward before the step is then legitimate, so
            :meth:`forbid_grad_accumulation` no longer applies; every pass between two steps
            must come from one logical batch (docs/multi_pass.md).
    """

    GRAD_SAMPLERS = GRAD_SAMPLERS

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        multi_pass: bool = False,
    ):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        errors = self.validate(module=m, strict=strict)
        for e in errors:
            logger.warning("GradSampleModule: %s", e)
        self.multi_pass = multi_pass
        self._public_depth = 0
        self._pass_public: list[bool] = []
        self.hooks_enabled = False
        self.forward_hooks_enabled = True
        self.backward_hooks_enabled = True
        self.autograd_grad_sample_hooks: list = []
        self._in_functorch = False
        self._pending: dict[int, nn.Parameter] = {}
        self._callback_queued = False
        self.add_hooks(
            loss_reduction=loss_reduction, batch_first=batch_first, force_functorch=force_functorch
        )

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    # ------------------------------------------------------------------ hooks management
    def add_hooks(
        self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False
    ) -> None:
        """Installs the forward hooks that capture activations and backprops of every layer that
        owns trainable parameters."""
        if self.autograd_grad_sample_hooks:
            raise ValueError("Hooks are already attached; call remove_hooks() first.")
        self.loss_reduction = loss_reduction
        self.batch_first = batch_first
        self.force_functorch = force_functorch
        for module in self.iterate_submodules(self._module):
            handle = module.register_forward_hook(self._forward_hook, with_kwargs=True)
            self.autograd_grad_sample_hooks.append(handle)
        self.enable_hooks()

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        """The submodules of ``module`` (itself included) that get a per-sample-gradient hook:
        those owning trainable parameters (parametrization originals count for the module they
        parametrize). Unlike Opacus, a layer without a grad sampler does not hide its
        submodules: ``torch.func`` computes the gradients of each such module's own parameters."""
        for _, m in trainable_units(module):
            yield m

    def remove_hooks(self) -> None:
        """Removes all hooks added by :meth:`add_hooks`."""
        self.disable_hooks()
        for h in self.autograd_grad_sample_hooks:
            h.remove()
        self.autograd_grad_sample_hooks = []

    def disable_hooks(self) -> None:
        """Turns every hook of this module off (graphs built earlier keep theirs, now inert)."""
        self.hooks_enabled = False

    def enable_hooks(self) -> None:
        """The opposite of :meth:`disable_hooks`."""
        self.hooks_enabled = True

    def disable_forward_hooks(self) -> None:
        """Forward passes stop recording activations (e.g. a generator update through D)."""
        self.forward_hooks_enabled = False

    def enable_forward_hooks(self) -> None:
        self.forward_hooks_enabled = True

    def disable_backward_hooks(self) -> None:
        """Backward passes stop producing per-sample gradients (e.g. an auxiliary ``autograd.grad``)."""
        self.backward_hooks_enabled = False

    def enable_backward_hooks(self) -> None:
        self.backward_hooks_enabled = True

    @contextlib.contextmanager
    def public_pass(self):
        """Multi-pass mode: the backward passes run inside this block are declared *public*: they
        do not depend on the private data, nor does their batch size (e.g. a fixed number of
        generated samples). Split clipping (``accum_passes=False``) only counts the other passes
        against ``num_private_passes``; see docs/multi_pass.md.
        """
        if not self.multi_pass:
            raise ValueError("public_pass() only applies to GradSampleModule(multi_pass=True).")
        self._public_depth += 1
        try:
            yield self
        finally:
            self._public_depth -= 1

    # ------------------------------------------------------------------ capture
    def _forward_hook(self, module, args, kwargs, output):
        self.capture_activations_hook(module, args, output, forward_kwargs=kwargs)

    def capture_activations_hook(
        self, module: nn.Module, forward_input, _forward_output, forward_kwargs: dict | None = None
    ) -> None:
        """Forward hook: remembers this call's inputs and hooks the gradient of its output."""
        if (
            not self.hooks_enabled
            or not self.forward_hooks_enabled
            or self._in_functorch
            or not module.training
            or not torch.is_grad_enabled()
        ):
            return
        out = _first_tensor(_forward_output)
        if out is None or not out.requires_grad:
            return
        activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in forward_input]
        kwargs = {
            k: (v.detach() if isinstance(v, torch.Tensor) else v)
            for k, v in (forward_kwargs or {}).items()
        }
        if kwargs:
            activations, kwargs = _kwargs_to_positional(module, activations, kwargs)
        out.register_hook(partial(self._on_backprops, module, activations, kwargs))

    def _on_backprops(self, module, activations, kwargs, grad):
        if not self.hooks_enabled or not self.backward_hooks_enabled:
            return None
        self.capture_backprops_hook(
            module, activations, grad, self.loss_reduction, self.batch_first, forward_kwargs=kwargs
        )
        return None

    def capture_backprops_hook(
        self,
        module: nn.Module,
        _forward_input,
        forward_output,
        loss_reduction: str,
        batch_first: bool,
        forward_kwargs: dict | None = None,
    ) -> None:
        """Computes the per-sample gradients of one call of ``module`` from its inputs
        (``_forward_input``) and the gradient of its output (``forward_output``), and adds them to
        ``p._current_grad_sample``; they become ``p.grad_sample`` at the end of the backward pass.
        """
        backprops = _first_tensor(forward_output)
        activations, backprops = self.rearrange_grad_samples(
            module=module,
            backprops=backprops,
            loss_reduction=loss_reduction,
            batch_first=batch_first,
            activations=_forward_input,
        )
        n = getattr(module, "max_batch_len", None) or backprops.shape[0]
        self._process_call(module, activations, backprops, forward_kwargs, n)
        self._queue_end_of_backward()

    def _process_call(self, module, activations, backprops, kwargs, max_batch_len: int) -> None:
        """One call's contribution from batch-first ``activations``/``backprops``: per-sample
        gradients summed into ``p._current_grad_sample`` (fast clipping overrides this)."""
        grad_samples = self._compute_grad_samples(module, activations, backprops, kwargs)
        for p, gs in grad_samples.items():
            self._accumulate_current(p, gs, max_batch_len)

    def _compute_grad_samples(self, module, activations, backprops, kwargs):
        sampler = None if self.force_functorch else self.GRAD_SAMPLERS.get(type(module))
        if sampler is not None:
            return sampler(module, activations, backprops)
        self._in_functorch = True
        try:
            return ft_compute_per_sample_gradient(
                module,
                activations,
                backprops,
                kwargs,
                batch_first=module_batch_first(module, self.batch_first),
            )
        finally:
            self._in_functorch = False

    def rearrange_grad_samples(
        self,
        *,
        module: nn.Module,
        backprops: torch.Tensor,
        loss_reduction: str,
        batch_first: bool,
        activations=None,
    ):
        """Moves the batch dimension first and undoes the ``1/B`` of a mean loss.

        Returns ``(activations, backprops)``; ``B`` is ``module.max_batch_len`` when the layer
        sets it (recurrent layers fed shrinking batches), else the batch size of ``backprops``.
        """
        if not module_batch_first(module, batch_first):
            backprops = backprops.movedim(1, 0)
            activations = [
                a.movedim(1, 0) if isinstance(a, torch.Tensor) and a.dim() > 1 else a
                for a in activations
            ]
        if loss_reduction == "mean":
            n = getattr(module, "max_batch_len", None) or backprops.shape[0]
            backprops = backprops * n
        return activations, backprops

    def _accumulate_current(self, p: nn.Parameter, gs: torch.Tensor, max_batch_len: int) -> None:
        if p.requires_grad:
            create_or_accumulate_grad_sample(param=p, grad_sample=gs, max_batch_len=max_batch_len)
            self._pending[id(p)] = p

    # ------------------------------------------------------------------ end of a backward pass
    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        pending, self._pending = list(self._pending.values()), {}
        if self.multi_pass:
            self._publish_pass(pending)
            return
        if not self.grad_accumulation_allowed and any(
            getattr(p, "grad_sample", None) is not None for p in pending
        ):
            for p in pending:
                del p._current_grad_sample
            raise ValueError(ACCUMULATION_FORBIDDEN_MESSAGE)
        for p in pending:
            promote_current_grad_sample(p)

    def _publish_pass(self, pending: list[nn.Parameter]) -> None:
        """Multi-pass mode: appends this backward pass as a new slice of every ``p.grad_sample``.

        Parameters the pass did not reach get a zero slice. Raises ``RuntimeError`` when the
        current per-sample gradients were already clipped or folded by the optimizer's manual
        stages (a pass recorded between ``clip()`` and ``step()`` would be restacked unclipped).
        A slice published after a step without ``zero_grad`` inherits the "processed" mark, so
        the optimizer refuses to spend those per-sample gradients a second time.
        """
        params = [p for p in self.trainable_parameters()]
        for p in params:
            if getattr(getattr(p, "grad_sample", None), "_dp_stage_applied", False):
                for q in pending:
                    del q._current_grad_sample
                raise RuntimeError(
                    "A backward pass recorded per-sample gradients after optimizer.clip(): they "
                    "would escape clipping. Run auxiliary passes between clip() and step() with "
                    "the hooks off (GradSampleModule.disable_backward_hooks()), or before clip()."
                )
        pass_idx = max((len(getattr(p, "_grad_sample_passes", ())) for p in params), default=0)
        self._pass_public = self._pass_public[:pass_idx] if pass_idx else []
        self._pass_public.append(self._public_depth > 0)
        processed = any(hasattr(getattr(p, "grad_sample", None), "_processed") for p in params)
        touched = {id(p) for p in pending}
        for p in pending:
            passes = getattr(p, "_grad_sample_passes", [])
            passes.extend([None] * (pass_idx - len(passes)))
            passes.append(p._current_grad_sample)
            del p._current_grad_sample
            p._grad_sample_passes = passes
        for p in params:
            passes = getattr(p, "_grad_sample_passes", None)
            if passes is None:
                continue
            if id(p) not in touched:
                passes.extend([None] * (pass_idx + 1 - len(passes)))
            p.grad_sample = _stack_passes(p, passes)
            p.grad_sample._pass_public = tuple(self._pass_public)
            if processed:
                p.grad_sample._processed = True

    # ------------------------------------------------------------------ validation
    @classmethod
    def is_supported(cls, module: nn.Module) -> bool:
        """Whether ``module`` (not its submodules) has a registered grad sampler."""
        return type(module) in cls.GRAD_SAMPLERS

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[NotImplementedError]:
        """Checks that exact per-sample gradients can be computed for ``module``.

        Returns the list of problems; with ``strict=True`` raises one ``NotImplementedError``
        listing all of them.
        """
        errors = per_sample_gradient_errors(module, cls.GRAD_SAMPLERS)
        if strict and errors:
            raise NotImplementedError(
                "Model is not supported for exact per-sample gradients:\n"
                + "\n".join(f"  - {e}" for e in errors)
            )
        return errors


@dataclass(frozen=True)
class GradSampleProblem:
    """One reason why exact per-sample gradients of a model are impossible.

    ``kind`` is ``"batch_mixing"`` (the layer mixes the samples of a batch: BatchNorm),
    ``"needs_dp_layer"`` (a torch layer with fused kernels that has a dptorch replacement) or
    ``"buffers_no_sampler"`` (a trainable layer with buffers and no registered grad sampler).
    ``message`` names the module path and the fix.
    """

    path: str
    module: nn.Module
    kind: str
    message: str


def per_sample_gradient_problems(module: nn.Module, samplers: dict) -> list[GradSampleProblem]:
    """Every layer of ``module`` whose per-sample gradients would be wrong or impossible.

    Shared by :meth:`GradSampleModule.validate` (which raises them as ``NotImplementedError``)
    and :class:`dptorch.validators.ModuleValidator` (which reports them with its own error types).
    """
    problems: list[GradSampleProblem] = []
    for name, m in module.named_modules():
        path = name or "<root>"
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            problems.append(
                GradSampleProblem(
                    path,
                    m,
                    "batch_mixing",
                    f"{path} ({type(m).__name__}) mixes samples of a batch, so per-sample "
                    "gradients are undefined. Replace it, e.g. with GroupNorm: "
                    "model = dptorch.validators.ModuleValidator.fix(model).",
                )
            )
    for name, m in trainable_units(module):
        path = name or "<root>"
        if type(m) in samplers:
            continue
        if isinstance(m, (nn.RNNBase, nn.MultiheadAttention)):
            problems.append(
                GradSampleProblem(
                    path,
                    m,
                    "needs_dp_layer",
                    f"{path} ({type(m).__name__}) has no per-sample gradient. Use dptorch's DP "
                    "layer (DPLSTM/DPGRU/DPRNN/DPMultiheadAttention): "
                    "model = dptorch.validators.ModuleValidator.fix(model).",
                )
            )
        elif any(True for _ in m.buffers(recurse=False)) and not isinstance(
            m, nn.modules.batchnorm._BatchNorm
        ):
            problems.append(
                GradSampleProblem(
                    path,
                    m,
                    "buffers_no_sampler",
                    f"{path} ({type(m).__name__}) is trainable, has buffers and no registered "
                    "grad sampler: its buffers may depend on the batch. Register one with "
                    "dptorch.grad_sample.register_grad_sampler, or freeze it.",
                )
            )
    return problems


def per_sample_gradient_errors(module: nn.Module, samplers: dict) -> list[NotImplementedError]:
    """:func:`per_sample_gradient_problems` as ``NotImplementedError`` instances."""
    return [NotImplementedError(p.message) for p in per_sample_gradient_problems(module, samplers)]


def _kwargs_to_positional(module: nn.Module, args: list, kwargs: dict) -> tuple[list, dict]:
    """Moves the keyword arguments of a call that ``module.forward`` also accepts positionally
    into ``args`` (signature order, skipped ones filled with their defaults), so that grad
    samplers, which only see positional inputs, get them (e.g. ``EmbeddingBag(x, offsets=o)``).
    Keyword-only arguments stay in ``kwargs``; an unbindable call is left unchanged."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    bound.apply_defaults()
    return list(bound.args), dict(bound.kwargs)


def module_batch_first(module: nn.Module, batch_first: bool) -> bool:
    """Whether ``module``'s inputs/outputs have the batch in dimension 0.

    A layer may fix its own layout with an attribute ``grad_sample_batch_first`` (``True``: always
    batch first, ``False``: always ``(T, B, ...)``), e.g. ``dptorch.layers.dp_rnn.RNNLinear``,
    whose calls are batch first whatever the ``batch_first`` of the ``GradSampleModule``; without
    it (or with ``None``) the module follows ``batch_first``.
    """
    own = getattr(module, "grad_sample_batch_first", None)
    return batch_first if own is None else bool(own)


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _pad_batch(t: torch.Tensor, n: int) -> torch.Tensor:
    out = t.new_zeros((n, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _stack_passes(p: nn.Parameter, passes: list) -> torch.Tensor:
    """Stacks the per-pass gradients of ``p`` into ``(n_passes, B_max, *p.shape)``, zero padded.

    The result carries ``_pass_batch_sizes``: the batch size of each pass (``None`` where the
    pass did not reach ``p``), which the optimizer checks in ``accum_passes=True`` mode.
    """
    b = max((g.shape[0] for g in passes if g is not None), default=0)
    ref = next(g for g in passes if g is not None)
    out = ref.new_zeros((len(passes), b, *p.shape))
    for i, g in enumerate(passes):
        if g is not None:
            out[i, : g.shape[0]] = g
    out._pass_batch_sizes = tuple(None if g is None else g.shape[0] for g in passes)
    return out
