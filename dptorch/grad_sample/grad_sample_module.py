"""Hooks-based per-sample gradients (``grad_sample_mode="hooks"`` and ``"functorch"``).

Mechanism: a forward hook on every module that owns trainable parameters keeps that call's
inputs and hooks the gradient of its output (a pre-hook of the output's autograd node, which
runs after the output's tensor hooks). When autograd delivers the gradient of the output (the
*backprops*), the layer's grad sampler (or ``torch.func`` as a fallback) turns
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
import sys
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.nn.utils.rnn import PackedSequence

from ..utils.fsdp_utils import refuse_fsdp_model
from .escapes import escaped_tensors, escaped_use, guard_escapes, is_escape_guard, mark_escapes
from .functorch import ft_compute_per_sample_gradient, module_batch_first
from .gsm_base import ACCUMULATION_FORBIDDEN_MESSAGE, AbstractGradSampleModule, weak_method
from .hf_adapters import install_adapters
from .param_edges import is_sanctioned, next_sequence_nr, param_consumers, sanction
from .recompute_state import forward_fingerprint, run_with_fingerprint
from .registry import GRAD_SAMPLERS, replaced_forward
from .step_record import PassRecord, StepRecord, register_record, unregister_record
from .unit_params import own_parameters, sampled_parameters, trainable_signature, trainable_units
from .use_trace import UseTrace, non_overlapping, tensors_in

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

    Guarantees (checked, else ``ValueError`` naming the module and the fix):

    * every per-sample tensor of a pass has exactly ``B`` rows, ``B`` the batch size of the
      wrapped module's output (else of its input), the same for every call; a layer called on a batch-independent input with a batch
      dimension of size 1 (Hugging Face ``position_ids`` of shape ``[1, T]``) has its output
      expanded to ``B``, which makes its per-sample gradients exact;
    * the first forward pass (and the first after the set of trainable parameters changes) is
      traced (:class:`~dptorch.grad_sample.use_trace.UseTrace`): every use of a trainable
      parameter must be seen by a hook, and every hooked call must take its rows from the batch;
    * parameters unfrozen after wrapping get hooks at the next forward pass.
    """

    GRAD_SAMPLERS = GRAD_SAMPLERS
    #: whether this class handles models sharded by FSDP2 (the ``*FSDP`` subclasses)
    supports_fsdp = False
    #: the grad_sample_mode this class implements, for messages
    mode_name = "hooks"
    #: trace every training forward pass, not only the first: where a use that appears later
    #: would be released unclipped (ghost's second backward pass takes every use's gradient)
    TRACE_EVERY_PASS = False
    #: whether a second backward pass leaves the clipped sum to autograd (ghost), which then
    #: takes the gradient of every use: the uses are checked (:meth:`check_param_uses`)
    autograd_forms_clipped_sum = False

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
        if not self.supports_fsdp:
            refuse_fsdp_model(m, "functorch" if force_functorch else self.mode_name)
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        errors = self.validate(module=m, strict=strict)
        for e in errors:
            logger.warning("GradSampleModule: %s", e)
        self.multi_pass = multi_pass
        self._public_depth = 0
        self.hooks_enabled = False
        self.forward_hooks_enabled = True
        self.backward_hooks_enabled = True
        self.autograd_grad_sample_hooks: list = []
        self._in_functorch = False
        self._pending: dict[int, nn.Parameter] = {}
        self._pass: PassRecord | None = None
        self._callback_queued = False
        # graph-task number of the last pass opened (see _queue_end_of_backward)
        self._last_pass_task = -1
        self._expected_rows: int | None = None
        self._forward: _ForwardBatch | None = None
        self._trace: UseTrace | None = None
        self._consumer_generation = 0  # ghost: see _sanction_call
        self._escape_floor: int | None = None  # ghost: see _check_escapes
        self._call_floors: dict[int, list[int]] = {}
        self._trace_hooks: list = []
        self._trace_bsz: int | None = None
        self._trace_armed = True
        self._root_handles: list = []
        self._sampled: dict[int, list[tuple[str, nn.Parameter]]] = {}
        self._sampled_views: tuple | None = None
        self._trainable_signature: tuple = ()
        #: torch.func-sampled layers: {position or keyword: shape} of inputs not from the batch
        self._shared_inputs: dict[int, dict] = {}
        #: {id(layer): id of its capture hook's handle}: the first of the layer's forward hooks
        self._capture_ids: dict[int, int] = {}
        #: while a global forward hook of someone else is registered: the global hook that runs
        #: first (:class:`_OutputWitness`) and what it saw, {id(layer): (output, version)}
        self._witness: _OutputWitness | None = None
        self._raw_outputs: dict[int, tuple] = {}
        self.record = StepRecord()
        self._adapters = install_adapters(m)
        self.add_hooks(
            loss_reduction=loss_reduction, batch_first=batch_first, force_functorch=force_functorch
        )

    def forward(self, *args, **kwargs):
        if self._root_handles:  # attached in place: the module's own hooks do the work
            return self._module(*args, **kwargs)
        self._begin_forward(args, kwargs)
        try:
            out = self._module(*args, **kwargs)
        except BaseException:
            self._end_forward(None, failed=True)
            raise
        return self._end_forward(out, failed=False)

    def _begin_forward(self, args, kwargs) -> None:
        """Before a forward pass of the wrapped module: hooks for parameters unfrozen since the
        last pass, the input's batch size, and (first pass) the use trace."""
        if self._callback_queued and torch._C._current_graph_task_id() == -1:
            # a backward pass that raised (a refusal caught by the caller) never ended: its
            # end-of-pass callback died with it; drop what it left
            pending, self._pending = list(self._pending.values()), {}
            self._drop_pass(pending)
        training = self._module.training and torch.is_grad_enabled() and self.hooks_enabled
        if (
            training
            and _in_function_backward()
            and not _in_non_reentrant_recompute()
        ):
            # the model's forward run by an autograd Function's backward: a reentrant
            # checkpoint of the whole wrapped model (its recompute's nested backward belongs to
            # the enclosing pass), or user code training the model inside a custom Function's
            # backward (a pass of its own): the two cannot be told apart, and taking one for
            # the other clips one backward as two passes or two as one (2·C per sample)
            raise ValueError(
                "The wrapped model's forward pass ran inside an autograd Function's backward "
                "(reentrant activation checkpointing of the whole wrapped model, "
                "checkpoint(model, x, use_reentrant=True), or the model trained inside a "
                "custom Function's backward): dptorch cannot tell which backward pass its "
                "per-sample gradients belong to. Checkpoint the model's blocks instead (Hugging "
                "Face: model.gradient_checkpointing_enable()), use use_reentrant=False, or "
                "train the model outside the Function's backward."
            )
        if training and self._trainable_signature != trainable_signature(self._module):
            self._refresh_units()
        if training:
            self._order_capture_hooks()
        self._forward = _ForwardBatch(
            infer_batch_size(args, kwargs, self.batch_first), seq_floor=next_sequence_nr()
        )
        if training and self._trace_armed:
            self._start_trace(args, kwargs)

    def _end_forward(self, out, *, failed: bool):
        """After the forward pass: the trace's verdict (raises on a problem) and the output's
        batch size; returns ``out``."""
        try:
            trace = self._trace
            if trace is not None:
                self._finish_trace(check=not failed)
                if not failed:
                    out = self._check_escapes(trace, out)
            if not failed:
                self._forward.output_rows = output_batch_size(out, self.batch_first)
            return out
        finally:
            self._forward = None
            self._call_floors.clear()
            if self._witness is not None and not _foreign_global_forward_hooks():
                self._remove_witness()  # nothing left to watch (torch.compile warns about it)

    def _check_escapes(self, trace: UseTrace, out):
        """Rule 2 after a traced pass (dptorch/grad_sample/escapes.py): a tensor computed in a
        hooked call from its parameters that left the call other than through its first output
        is refused if the loss is differentiated through it. In the output or on a module it is
        replaced by a guard whose backward raises; ghost also marks its autograd node, so that
        :meth:`check_param_uses` finds any later use of it, wherever it was kept, before the DP
        loss's first backward pass. Returns the output."""
        escaped = escaped_tensors(trace)
        if not escaped:
            return out
        if self.autograd_forms_clipped_sum:
            end = next_sequence_nr()
            mark_escapes(trace, escaped, self, end)
            floor = self._escape_floor
            self._escape_floor = end if floor is None else min(floor, end)
        return guard_escapes(trace, out, self._module, escaped)

    def _sanction_call(self, module: nn.Module, out, floor: int) -> None:
        """Ghost: marks the autograd nodes created during this hooked call of ``module`` through
        which its sampled parameters receive gradients (:meth:`check_param_uses` accepts only
        those, once). A use anywhere else (the training loop, the model's input, a parent's
        forward or custom Function, an eval-mode call) is not marked."""
        if not (self.hooks_enabled and torch.is_grad_enabled()):
            return
        # the first output only: the hooks see no other output's gradient (escapes.py)
        first = _first_tensor(out)
        if first is None:
            return
        nodes = param_consumers([first], set(self.sampled_ids(module)), floor)
        sanction(nodes, self, self._consumer_generation)

    def check_param_uses(self, loss: torch.Tensor) -> None:
        """Ghost, before the DP loss's backward passes: every operation through which a trainable
        parameter receives a gradient from ``loss`` must come from a traced, hooked forward pass
        of the module. A use elsewhere (the training loop, the criterion, an eval-mode call) has
        no per-sample norm, and the second backward pass would release its gradient unclipped."""
        trainable = [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]
        names = {id(p): n for n, p in trainable}
        hooked = [n for n, p in trainable if getattr(p, "_backward_hooks", None)
                  or getattr(p, "_post_accumulate_grad_hooks", None)]
        if hooked:
            raise ValueError(
                f"{', '.join(hooked)} has a gradient hook (register_hook or "
                "register_post_accumulate_grad_hook): in grad_sample_mode='ghost' it would run on "
                "the clipped sum, after clipping, and could change what is released. Remove the "
                "hook, or use grad_sample_mode='bk' or 'hooks'."
            )
        # a tensor that left a hooked call other than by its first output (escapes.py): its
        # guard, or (ghost marks them) a node made after the forward pass that takes it
        floor, self._escape_floor = self._escape_floor, None

        def escape(node) -> bool:
            return is_escape_guard(node) or (
                floor is not None and node._sequence_nr() >= floor
                and escaped_use(node, self) is not None
            )

        escapes: list = []
        found = param_consumers([loss], set(names), flagged=escape, found=escapes)
        generation = self._consumer_generation
        self._consumer_generation += 1  # spent: a second DP loss needs a new forward pass
        if escapes:
            node = escapes[0]
            raise ValueError(
                node.dptorch_escape if is_escape_guard(node) else escaped_use(node, self)
            )
        stray = [node for node in found if not is_sanctioned(node, self, generation)]
        if stray:
            params = sorted({names[id(nxt.variable)] for node in stray
                             for nxt, _ in node.next_functions
                             if nxt is not None and id(getattr(nxt, "variable", None)) in names})
            raise ValueError(
                f"The DP loss gets a gradient for {', '.join(params)} through "
                f"{type(stray[0]).__name__}, an operation outside the model's hooked forward pass "
                "(in the training loop, the criterion, the model's input, a call in eval mode or "
                "with the hooks off, or a forward pass whose loss was already back-propagated): "
                "no per-sample hook sees that use in this pass, so grad_sample_mode='ghost' would "
                "release its gradient unclipped. Use the parameter only inside the module that "
                "owns it, called in train mode, and one DP backward per forward pass (or detach "
                "it / use torch.no_grad())."
            )

    # ------------------------------------------------------------------ in place (wrap_model=False)
    def attach_to_module(self) -> None:
        """Opacus's ``wrap_model=False``: the user keeps calling the original module, whose class
        and identity are unchanged; a pre-hook and an always-called hook on it run what
        :meth:`forward` runs around the call, so every check of the wrapped path applies."""
        if self._root_handles:
            return
        m = self._module
        self._root_handles = [
            m.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True, prepend=True),
            m.register_forward_hook(self._root_post_hook, with_kwargs=True, always_call=True),
        ]

    def detach_from_module(self) -> None:
        for h in self._root_handles:
            h.remove()
        self._root_handles = []

    def _root_pre_hook(self, module, args, kwargs):
        if self._in_functorch:  # torch.func replaying the root (a layer with own parameters)
            return
        self._begin_forward(args, kwargs)
        if self._trace is not None:  # hooks registered now do not run for this very call
            self._trace_enter(module, args, kwargs)

    def _root_post_hook(self, module, args, kwargs, out):
        if self._forward is not None and not self._in_functorch:
            new = self._end_forward(out, failed=sys.exc_info()[0] is not None)
            if new is not out:  # an escaped tensor replaced by its guard
                return new

    # ------------------------------------------------------------------ hooks management
    def add_hooks(
        self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False
    ) -> None:
        """Installs the forward hooks that capture activations and backprops of every layer that
        samples trainable parameters (see :func:`~dptorch.grad_sample.unit_params.sampled_parameters`)."""
        if self.autograd_grad_sample_hooks:
            raise ValueError("Hooks are already attached; call remove_hooks() first.")
        self.loss_reduction = loss_reduction
        self.batch_first = batch_first
        self.force_functorch = force_functorch
        self._sampled = sampled_parameters(self._module)
        self._trainable_signature = trainable_signature(self._module)
        self._module_names = {id(m): name or "<root>" for name, m in self._module.named_modules()}
        self._capture_ids = {}
        for module in self.iterate_submodules(self._module):
            # the layer's first forward hook: the per-sample gradient formulas (and torch.func's
            # recompute of ``forward``) need the output of ``forward`` itself, before a user's
            # hook rescales or replaces it (see :meth:`_order_capture_hooks`)
            handle = module.register_forward_hook(
                self._forward_hook, with_kwargs=True, prepend=True
            )
            self.autograd_grad_sample_hooks.append(handle)
            self._capture_ids[id(module)] = handle.id
            _place_capture_hook(handle)
        register_record(self._module.parameters(), self.record)
        self._trace_armed = True
        self.enable_hooks()

    def _order_capture_hooks(self) -> None:
        """Before a training forward pass: every layer's capture hook is put back first among
        the layer's forward hooks (a hook registered after wrapping with ``prepend=True`` went
        before it), so that it gets the output of the layer's ``forward`` whatever the user's
        hooks do to it afterwards. While someone else's global forward hook is registered
        (``register_module_forward_hook``: those run before any module's own hooks), a global
        hook of this module runs before it and records each layer's output, which the capture
        hook compares with what it gets (:meth:`_check_forward_output`)."""
        for handle in self.autograd_grad_sample_hooks:
            _place_capture_hook(handle)
        self._raw_outputs.clear()
        if _foreign_global_forward_hooks():
            if self._witness is None:
                self._witness = _OutputWitness(self)
            self._witness.go_first()
        elif self._witness is not None:
            self._remove_witness()

    def _remove_witness(self) -> None:
        if self._witness is not None:
            self._witness.remove()
        self._witness = None
        self._raw_outputs.clear()

    def _witness_output(self, module: nn.Module, output) -> None:
        """:class:`_OutputWitness`: keeps the output of a call of a hooked layer, as its
        ``forward`` returned it (before any other global hook), for the capture hook (weakly:
        a call whose capture hook does not run leaves nothing alive)."""
        if (
            self._capture_ids.get(id(module)) in module._forward_hooks
            and self.hooks_enabled
            and self.forward_hooks_enabled
            and not self._in_functorch
            and module.training
            and torch.is_grad_enabled()
        ):
            out = _first_tensor(output)
            if out is not None and out.requires_grad:
                self._raw_outputs[id(module)] = (weakref.ref(out), out._version)

    def _check_forward_output(self, module: nn.Module, out: torch.Tensor) -> None:
        """Raises ``ValueError`` unless ``out``, the first output tensor the capture hook got, is
        that of the layer's ``forward`` itself: no forward hook of the layer ran before the
        capture hook, and no global forward hook of someone else replaced or modified it in
        place. The per-sample gradients are computed from the output of ``forward`` (a grad
        sampler's formula, torch.func's recompute of ``forward``); a hook that rescales it would
        make them wrong, and their clip factors would not bound what each sample contributes."""
        name = f"{self.module_name(module)} ({type(module).__name__})"
        if not _capture_hook_first(module._forward_hooks, self._capture_ids.get(id(module))):
            raise ValueError(
                f"{name}: a forward hook registered on this layer with prepend=True ran before "
                "dptorch's per-sample capture hook (it was registered during the forward pass, or "
                "the layer was called outside a forward pass of the wrapped model, where dptorch "
                "puts its own hook first). Per-sample gradients are computed from the output of "
                "the layer's forward; a hook that rescales or replaces it would make them wrong "
                "and their clipping would not bound each sample's contribution. Fix: register "
                "the hook before the forward pass or without prepend=True, or call the layer "
                "through the wrapped model."
            )
        raw = self._raw_outputs.pop(id(module), None)
        if raw is None:
            if _foreign_global_forward_hooks():
                raise ValueError(
                    f"{name}: a global forward hook (register_module_forward_hook) is "
                    "registered, and it runs before dptorch's per-sample capture hook; this call "
                    "of the layer came before any forward pass of the wrapped model since the "
                    "hook was added, so dptorch cannot check that the hook leaves the layer's "
                    "output unchanged (per-sample gradients are computed from the output of the "
                    "layer's forward). Fix: call the wrapped model (its forward pass installs "
                    "the check), or remove the global hook while training."
                )
            return
        if raw[0]() is not out or raw[1] != out._version:
            raise ValueError(
                f"{name}: a global forward hook (torch.nn.modules.module."
                "register_module_forward_hook) replaced this layer's output or modified it in "
                "place. Global hooks run before a module's own hooks, so dptorch's per-sample "
                "capture hook would take the gradient at the hook's result while the layer's "
                "per-sample gradient formula needs the output of its forward: the per-sample "
                "gradients would be wrong and their clipping would not bound each sample's "
                "contribution. Fix: register the hook on the module instead "
                "(module.register_forward_hook: dptorch runs its own hook first), apply the "
                "change inside a module's forward, or let the global hook only observe (return "
                "None, no in-place change)."
            )

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        """The submodules of ``module`` (itself included) that get a per-sample-gradient hook:
        those that sample trainable parameters (parametrization originals count for the module
        they parametrize). Unlike Opacus, a layer without a grad sampler does not hide its
        submodules: ``torch.func`` computes the gradients of each such module's own parameters."""
        sampled = self._sampled if module is self._module else sampled_parameters(module)
        for m in module.modules():
            if id(m) in sampled:
                yield m

    def sampled_params(self, module: nn.Module) -> tuple[nn.Parameter, ...]:
        """The trainable parameters whose per-sample gradients ``module``'s hook computes."""
        return self._sampled_view(module)[0]

    def sampled_ids(self, module: nn.Module) -> frozenset[int]:
        """``{id(p) for p in sampled_params(module)}``."""
        return self._sampled_view(module)[1]

    def _sampled_view(self, module: nn.Module) -> tuple[tuple[nn.Parameter, ...], frozenset[int]]:
        """``(sampled parameters, their ids)`` of ``module``, derived from :attr:`_sampled` once
        per assignment of it (:meth:`add_hooks`); a mapping other than a plain dict (FSDP's,
        whose lookups depend on what FSDP holds now) is read at every call."""
        sampled = self._sampled
        if type(sampled) is not dict:
            params = tuple(p for _, p in sampled.get(id(module), ()))
            return params, frozenset(map(id, params))
        views = self._sampled_views
        if views is None or views[0] is not sampled:
            table = {}
            for key, entries in sampled.items():
                params = tuple(p for _, p in entries)
                table[key] = (params, frozenset(map(id, params)))
            views = self._sampled_views = (sampled, table)
        return views[1].get(id(module), ((), frozenset()))

    def remove_hooks(self) -> None:
        """Removes every hook this module installed on the wrapped model: the per-layer hooks of
        :meth:`add_hooks` and the root pre-hook and hook of the in-place form
        (:meth:`attach_to_module`). The model can then be wrapped again."""
        self._remove_layer_hooks()
        self.detach_from_module()

    def _remove_layer_hooks(self) -> None:
        """Removes the per-layer hooks of :meth:`add_hooks` (and turns the module's hooks off)."""
        self.disable_hooks()
        for h in self.autograd_grad_sample_hooks:
            h.remove()
        self.autograd_grad_sample_hooks = []
        self._remove_witness()

    def cleanup(self) -> None:
        self.detach_from_module()
        super().cleanup()
        unregister_record(self._module.parameters(), self.record)
        for remove in self._adapters:
            remove()
        self._adapters = []

    def _refresh_units(self) -> None:
        """The trainable parameters changed since wrapping (``requires_grad`` flipped): hooks
        are installed anew for them, and the next forward pass is traced again."""
        if self._pending or self._callback_queued:
            raise ValueError(
                "Parameters were frozen or unfrozen during a backward pass; change "
                "requires_grad between steps."
            )
        self._remove_layer_hooks()
        self.add_hooks(
            loss_reduction=self.loss_reduction,
            batch_first=self.batch_first,
            force_functorch=self.force_functorch,
        )

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

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.record.reset()
        self.record.mark_zeroed(self._module.parameters())

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

    # ------------------------------------------------------------------ the traced forward
    def _start_trace(self, args, kwargs) -> None:
        """Starts a :class:`UseTrace` of the forward pass (ended by :meth:`_finish_trace`)."""
        params = {
            id(p): (name, p) for name, p in self._module.named_parameters() if p.requires_grad
        }
        batch_inputs = list(tensors_in((args, kwargs)))
        bsz = self._forward.input_rows if batch_inputs else None
        trace = UseTrace(params, self._module_names, batch_inputs, bsz, 0 if self.batch_first else 1)
        self._trace_hooks = [
            m.register_forward_pre_hook(self._trace_enter, with_kwargs=True)
            for m in self.iterate_submodules(self._module)
        ]
        for m in self._module.modules():  # DP layers fix their own layout (DPLSTM, DPMHA)
            if type(m).__module__.startswith("dptorch.layers") and isinstance(
                getattr(m, "batch_first", None), bool
            ):
                self._trace_hooks.append(
                    m.register_forward_pre_hook(self._trace_layout, with_kwargs=True)
                )
                self._trace_hooks.append(m.register_forward_hook(self._trace_layout_out))
        self._trace_bsz = bsz
        self._trace = trace
        trace.__enter__()

    def _finish_trace(self, *, check: bool) -> None:
        """Ends the trace; with ``check``, raises if it found a problem."""
        trace, self._trace = self._trace, None
        try:
            trace.__exit__(None, None, None)
        finally:
            for h in self._trace_hooks:
                h.remove()
            self._trace_hooks = []
        if not check:
            return
        trace.check()
        # a batch of 0 or 1 sample cannot tell batch data from shared data: trace again then
        if (self._trace_bsz is None or self._trace_bsz > 1) and not self.TRACE_EVERY_PASS:
            self._trace_armed = False

    def _trace_layout(self, module, args, kwargs):
        if self._trace is not None and module.training:
            with self._trace.paused():
                self._trace.check_layout(module, (args, kwargs), 0 if module.batch_first else 1)

    def _trace_layout_out(self, module, args, output):
        if self._trace is not None and module.training:
            with self._trace.paused():
                self._trace.layout_output(output, 0 if module.batch_first else 1)

    def _trace_enter(self, module, args, kwargs):
        if self.autograd_forms_clipped_sum and module.training and torch.is_grad_enabled():
            self._call_floors.setdefault(id(module), []).append(next_sequence_nr())
        if self._trace is not None and module.training:
            with self._trace.paused():
                self._trace.enter(
                    module, set(self.sampled_ids(module)), (args, kwargs),
                    0 if module_batch_first(module, self.batch_first) else 1,
                )

    # ------------------------------------------------------------------ capture
    def _forward_hook(self, module, args, kwargs, output):
        floors = self._call_floors.get(id(module))
        if floors:
            self._sanction_call(module, output, floors.pop())
        trace = self._trace
        if trace is None:
            return self._capture_call(module, args, kwargs, output)
        with trace.paused():
            new = self._capture_call(module, args, kwargs, output)
            if module.training:
                trace.exit(module, output, expanded=new is not None)
                if new is not None:
                    trace.mark_expanded(next(tensors_in(new)))
            return new

    def _capture_call(self, module, args, kwargs, output):
        """Keeps this call's inputs and hooks the gradient of its first output; returns the new
        output where a batch dimension of size 1 was expanded to the batch (else ``None``)."""
        if (
            self._forward is None
            and self.hooks_enabled
            and self.forward_hooks_enabled
            and not self._in_functorch
            and module.training
            and _in_function_backward()
        ):
            # a layer called by an autograd Function's backward outside a forward pass of the
            # model: a segment recomputed by reentrant activation checkpointing (the
            # checkpoints nested in it run their forward under no_grad), whose own backward is
            # a nested graph task. The pass must end with the enclosing backward, not with the
            # nested one, or one backward would be clipped as two passes (each sample up to
            # √2·C, the noise for C). A layer called by user code in a tensor hook of another
            # backward is not (its forward and backward are a pass of their own, as without a
            # backward around them); the model's own forward there is refused
            # (_begin_forward).
            self._queue_end_of_backward()
        if (
            not self.hooks_enabled
            or not self.forward_hooks_enabled
            or self._in_functorch
            or not module.training
            or not torch.is_grad_enabled()
        ):
            return None
        out = _first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        self._check_forward_output(module, out)
        activations = list(args)
        kwargs = dict(kwargs or {})
        new_output = None
        bdim = 0 if module_batch_first(module, self.batch_first) else 1
        b = self._forward.input_rows if self._forward is not None else None
        if b is not None and b > 1 and _batch_dim_is_one(out, bdim):
            if all(_batch_dim_is_one(a, bdim) for a in tensors_in((activations, kwargs), 2)
                   if a.dim() > bdim):
                out = _expand_batch(out, bdim, b)
                activations = [_expand_batch(a, bdim, b) for a in activations]
                kwargs = {k: _expand_batch(v, bdim, b) for k, v in kwargs.items()}
                new_output = _replace_first_tensor(output, out)
        hooked = _hookable(out, (activations, kwargs),
                           None if self._forward is None else self._forward.seq_floor)
        if self._trace is not None and self._uses_functorch(module):
            self._note_shared_inputs(module, activations, kwargs, expanded=new_output is not None)
        activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in activations]
        kwargs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        if kwargs:
            activations, kwargs = _kwargs_to_positional(module, activations, kwargs)
        self.capture_activations_hook(module, activations, hooked, forward_kwargs=kwargs)
        # the module and this object weakly: a module that keeps a tensor of its forward on
        # itself (``self.last = y``) holds that tensor's graph, whose node holds this hook; a
        # strong reference would be a cycle through autograd that the garbage collector does
        # not see, and the model would never be freed
        on_grad = partial(weak_method(self._on_backprops, module), [activations, kwargs],
                          self._forward, [])
        if hooked is not out:
            # the view's geometry only: a hook holding its own tensor (the base) is a cycle that
            # the garbage collector does not see, and one holding the view keeps the output's
            # memory alive until the end of the backward pass, which autograd frees when no
            # later op saves it (a Linear's (B, T, d) output feeding a residual sum)
            on_grad = partial(_view_grad, on_grad, tuple(out.shape), out.stride(),
                              out.storage_offset() - hooked.storage_offset())
        # its recompute must reproduce this output
        if self._uses_functorch(module) or self._fingerprint_output(module, activations, out, bdim):
            on_grad = partial(run_with_fingerprint, forward_fingerprint(module, out, bdim), on_grad)
        self._hook_output_grad(module, hooked, on_grad)
        return new_output

    def _fingerprint_output(self, module, activations, out, bdim) -> bool:
        """Whether a mode that recomputes ``module``'s forward outside torch.func (bk's clipped
        sums) needs this call's output fingerprint (``out``: the first output, batch in
        dimension ``bdim``; ``activations``: the positional inputs); none here."""
        return False

    def _hook_output_grad(self, module: nn.Module, hooked: torch.Tensor, on_grad) -> None:
        """Has ``on_grad`` called with the gradient of ``hooked`` (``module``'s output, or the
        base it reshapes) in the backward pass, after every tensor hook of ``hooked``
        (:func:`_hook_gradient`)."""
        _hook_gradient(hooked, on_grad)

    def module_name(self, module: nn.Module) -> str:
        """``module``'s path in the wrapped model (its class name if it is not a submodule)."""
        return self._module_names.get(id(module), type(module).__name__)

    def _uses_functorch(self, module: nn.Module) -> bool:
        return (self.force_functorch or type(module) not in self.GRAD_SAMPLERS
                or replaced_forward(module))

    def _note_shared_inputs(
        self, module: nn.Module, args: list, kwargs: dict, *, expanded: bool
    ) -> None:
        """Traced pass: records which tensor inputs of this call of a torch.func-sampled layer
        do not come from the batch (a ``[T, T]`` mask), with their shapes, by position after
        :func:`_kwargs_to_positional`; over several calls, those shared with the same shape in
        every call. Later passes do not slice a tensor of that shape at that position per sample
        (a shared tensor is never sliced when ``T = B``); another shape is batch data again. An ``expanded`` call (inputs of batch
        dimension 1 expanded to the batch) shares none."""
        trace = self._trace
        if expanded:
            self._shared_inputs[id(module)] = {}
            return

        def shape_if_shared(a):
            return a.shape if isinstance(a, torch.Tensor) and not trace.from_batch(a) else None

        flags = [shape_if_shared(a) for a in args]
        kw = {k: shape_if_shared(v) for k, v in kwargs.items()}
        if kw:
            flags, kw = _kwargs_to_positional(module, flags, kw)
        shared = {k: f for k, f in [*enumerate(flags), *kw.items()] if isinstance(f, torch.Size)}
        prev = self._shared_inputs.get(id(module))
        self._shared_inputs[id(module)] = shared if prev is None else {
            k: f for k, f in shared.items() if prev.get(k) == f
        }

    def capture_activations_hook(
        self, module: nn.Module, forward_input, _forward_output, forward_kwargs: dict | None = None
    ) -> None:
        """Runs once per hooked call in the forward pass, after its inputs were kept (fast
        clipping counts calls and keeps output edges here). ``_forward_output`` is the tensor
        whose gradient is hooked: the output, or the base it reshapes (see ``_hookable``)."""

    def _on_backprops(self, module, held: list, fwd, passes: list, grad):
        """The gradient of a hooked call's output arrived: its per-sample work, from
        ``held = [activations, kwargs]``, which is then dropped (outside multi-pass mode, where
        a second pass through the call is refused): as autograd frees a node's saved inputs
        once it ran, the inputs are not kept until the end of the backward pass (a mode that
        needs them later, bk, keeps its own reference)."""
        if torch.is_grad_enabled():  # even with the backward hooks off: nothing sees that use
            name = self.module_name(module)
            raise ValueError(
                f"A backward pass with create_graph=True went through {name} "
                f"({type(module).__name__}), a layer whose per-sample gradients are hooked. A "
                "loss built from that gradient (a gradient penalty, a double backward) reaches "
                "the layer's weights through the backward graph, which no per-sample hook "
                "sees, so its gradient cannot be clipped per sample. Compute such terms without "
                "create_graph (or on an unwrapped copy of the model), or train without them."
            )
        if not self.hooks_enabled or not self.backward_hooks_enabled:
            return None
        self._check_first_backward(module, passes)
        activations, kwargs = held
        if activations is None:
            raise ValueError(
                f"{self.module_name(module)} ({type(module).__name__}): a second backward pass "
                "reached this layer call, whose inputs were released after the first. Each "
                "backward pass is clipped on its own; call backward() once per forward pass, or "
                "wrap with multi_pass=True."
            )
        self._expected_rows = fwd.rows if fwd is not None else None
        self.capture_backprops_hook(
            module, activations, grad, self.loss_reduction, self.batch_first, forward_kwargs=kwargs
        )
        if not self.multi_pass:
            held[0] = held[1] = None
        return None

    def _check_first_backward(self, module: nn.Module, passes: list) -> None:
        """``passes`` (one per hooked call) holds the backward pass that first reached the
        call; a later pass through the same call is refused outside multi-pass mode: each pass
        is clipped on its own, so one forward pass back-propagated twice (``a.backward(
        retain_graph=True); b.backward()``) would let a sample contribute twice the bound."""
        # decided before this pass is opened: a refusal leaves no pass pending (autograd drops
        # the end-of-pass callback of a failed backward)
        current = self._pass if self._callback_queued else None
        if passes and passes[0] is not current and not self.multi_pass:
            name = self.module_name(module)
            raise ValueError(
                f"A second backward pass went through the same forward pass of {name} "
                f"({type(module).__name__}) (backward(retain_graph=True), then another "
                "backward of the same outputs). Each backward pass is clipped on its own, so a "
                "sample would contribute up to twice max_grad_norm while the noise covers it "
                "once. Add the loss terms and call backward() once per forward pass (or use "
                "multi_pass=True, whose passes are accounted as such)."
            )
        self._queue_end_of_backward()
        if not passes:
            passes.append(self._pass)

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
        # the 1/B of a mean loss is undone by ``scale``, applied where it is cheapest (a copy
        # of the backprops in hooks mode; the norms and clip factors in ghost and bk)
        activations, backprops = self.rearrange_grad_samples(
            module=module,
            backprops=backprops,
            loss_reduction="sum",
            batch_first=batch_first,
            activations=_forward_input,
        )
        scale = _mean_scale(module, backprops) if loss_reduction == "mean" else 1.0
        self._queue_end_of_backward()
        n = self._check_rows(module, backprops.shape[0])
        activations, backprops = _in_parameter_precision(module, activations, backprops)
        with torch.autocast(backprops.device.type, enabled=False):
            self._process_call(module, activations, backprops, forward_kwargs, n, scale)

    def _check_rows(self, module: nn.Module, rows: int) -> int:
        """The rows every per-sample tensor of this call must have, else ``ValueError``.

        Every call of a backward pass must have as many rows as the batch: the batch size of
        the wrapped module's input (for layers following the module's ``batch_first``), and
        the same for every call of the pass. A layer fed shrinking batches (recurrent layers)
        declares ``max_batch_len`` and is padded to it; nothing else is ever padded."""
        name = self.module_name(module)
        declared = getattr(module, "max_batch_len", None)
        if declared:
            if rows > declared:
                raise ValueError(
                    f"{name} declares max_batch_len={declared} but received {rows} rows."
                )
            rows = declared
        follows = getattr(module, "grad_sample_batch_first", None) is None
        expected = self._expected_rows if follows else None
        rec = self._pass
        if expected is None:
            expected = rec.batch_size
        if expected is not None and rows != expected:
            dim = "0" if module_batch_first(module, self.batch_first) else "1"
            raise ValueError(
                f"{name} ({type(module).__name__}) has {rows} rows in its batch dimension "
                f"({dim}) but the batch has {expected} samples: its per-sample gradients would "
                "mix samples (e.g. an input that does not come from the batch, such as an index "
                "of shape [T, T], or a wrong batch_first). Fix: check batch_first (the batch must "
                f"be dimension {dim} of this layer's input), or feed the layer per-sample inputs "
                "(expand a shared input to the batch)."
            )
        if rec.batch_size is None:
            rec.batch_size = rows
        return rows

    def _process_call(
        self, module, activations, backprops, kwargs, max_batch_len: int, scale: float = 1.0
    ) -> None:
        """One call's contribution from batch-first ``activations`` and ``scale · backprops``:
        per-sample gradients summed into ``p._current_grad_sample`` (fast clipping overrides
        this)."""
        if scale != 1.0:
            backprops = backprops * scale
        grad_samples = self._compute_grad_samples(module, activations, backprops, kwargs)
        for p, gs in grad_samples.items():
            self._accumulate_current(p, gs, max_batch_len)

    def _compute_grad_samples(self, module, activations, backprops, kwargs):
        sampled = self._sampled.get(id(module), ())
        sampler = None if self._uses_functorch(module) else self.GRAD_SAMPLERS.get(type(module))
        if sampler is not None:
            ids = self.sampled_ids(module)
            return {p: g for p, g in sampler(module, activations, backprops).items() if id(p) in ids}
        self._in_functorch = True
        try:
            return ft_compute_per_sample_gradient(
                module,
                activations,
                backprops,
                kwargs,
                batch_first=module_batch_first(module, self.batch_first),
                params=sampled,
                name=self._module_names.get(id(module)),
                shared=self._shared_inputs.get(id(module), {}),
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
            rows = backprops.shape[1]
            backprops = backprops.movedim(1, 0)
            # a tensor without the batch in dimension 1 is shared (a [T, T] mask): kept as is
            activations = [
                a.movedim(1, 0) if isinstance(a, torch.Tensor) and a.dim() > 1
                and a.shape[1] == rows else a
                for a in activations
            ]
        if loss_reduction == "mean":
            backprops = backprops * _mean_scale(module, backprops)
        return activations, backprops

    def _accumulate_current(self, p: nn.Parameter, gs: torch.Tensor, max_batch_len: int) -> None:
        if p.requires_grad:
            create_or_accumulate_grad_sample(param=p, grad_sample=gs, max_batch_len=max_batch_len)
            self._pending[id(p)] = p
            self._pass.covered.add(id(p))

    # ------------------------------------------------------------------ end of a backward pass
    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            task = torch._C._current_graph_task_id()
            if task != -1 and task <= self._last_pass_task:
                # graph tasks are numbered as they start: this one started before the last
                # pass's, which (no pass being open) ended inside it (a nested backward)
                raise ValueError(
                    "One backward pass would be clipped as two: a backward run inside this one "
                    "(a reentrant activation checkpoint's, or one called by an autograd "
                    "Function's backward) ended a per-sample pass before this backward reached "
                    "the other layers; each sample would contribute up to max_grad_norm per "
                    "part while the noise covers it once. Use non-reentrant checkpointing "
                    "(use_reentrant=False; Hugging Face: "
                    "gradient_checkpointing_kwargs={'use_reentrant': False}), or run the "
                    "model's backward passes one after the other."
                )
            self._last_pass_task = task
            self._callback_queued = True
            self._on_pass_start()
            self._pass = PassRecord(public=self._public_depth > 0)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_pass_start(self) -> None:
        """At the first hook of a backward pass (no parameter gradient of it accumulated yet)."""

    def _take_pass(self) -> PassRecord:
        """Ends the pass: its record is appended to :attr:`record`."""
        self._callback_queued = False
        rec, self._pass = self._pass, None
        self._expected_rows = None
        self.record.add_pass(rec)
        return rec

    def _drop_pass(self, pending: list[nn.Parameter]) -> None:
        """Ends a refused pass: nothing of it is recorded or published."""
        for p in pending:
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample
        self._callback_queued = False
        self._pass = None
        self._expected_rows = None

    def _end_of_backward(self) -> None:
        pending, self._pending = list(self._pending.values()), {}
        if self.multi_pass:
            self._publish_pass(pending)
            return
        if not self.grad_accumulation_allowed and any(
            getattr(p, "grad_sample", None) is not None for p in pending
        ):
            self._drop_pass(pending)
            raise ValueError(ACCUMULATION_FORBIDDEN_MESSAGE)
        self._take_pass()
        for p in pending:
            promote_current_grad_sample(p)

    def _publish_pass(self, pending: list[nn.Parameter]) -> None:
        """Multi-pass mode: appends this backward pass as a new slice of every ``p.grad_sample``.

        Parameters the pass did not reach get a zero slice. Raises ``RuntimeError`` when the
        current per-sample gradients were already clipped by the optimizer's manual stages (a
        pass recorded between ``clip()`` and ``step()`` would be restacked unclipped).
        """
        if self.record.clipped_in_place:
            self._drop_pass(pending)
            raise RuntimeError(
                "A backward pass recorded per-sample gradients after optimizer.clip(): they "
                "would escape clipping. Run auxiliary passes between clip() and step() with "
                "the hooks off (GradSampleModule.disable_backward_hooks()), or before clip()."
            )
        self._take_pass()
        pass_idx = len(self.record.passes) - 1
        touched = {id(p) for p in pending}
        for p in pending:
            passes = getattr(p, "_grad_sample_passes", [])
            passes.extend([None] * (pass_idx - len(passes)))
            passes.append(p._current_grad_sample)
            del p._current_grad_sample
            p._grad_sample_passes = passes
        for p in self.trainable_parameters():
            passes = getattr(p, "_grad_sample_passes", None)
            if passes is None:
                continue
            if id(p) not in touched:
                passes.extend([None] * (pass_idx + 1 - len(passes)))
            p.grad_sample = _stack_passes(p, passes)

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


@dataclass
class _ForwardBatch:
    """The batch size of one forward pass of the wrapped module, from the rows of its input and
    of its output (first tensor with a batch dimension). When both are known and disagree (an
    output of flattened tokens, or a wrong ``batch_first``) neither is taken: the calls of a
    backward pass must then only agree with each other."""

    input_rows: int | None
    output_rows: int | None = None
    #: :func:`next_sequence_nr` at the pass's start: autograd nodes below it are older
    seq_floor: int | None = None

    @property
    def rows(self) -> int | None:
        if self.output_rows is None:
            return self.input_rows
        if self.input_rows is None or self.input_rows == self.output_rows:
            return self.output_rows
        return None


def output_batch_size(out, batch_first: bool = True) -> int | None:
    """The batch dimension's size of the first non-scalar tensor of a model output (a tensor,
    a tuple or list, or a mapping such as a Hugging Face ``ModelOutput``), or ``None``."""
    if isinstance(out, Mapping):
        out = list(out.values())
    for t in tensors_in(out, 2):
        if t.dim() > 0:
            bdim = 0 if batch_first or t.dim() < 2 else 1
            return int(t.shape[bdim])
    return None


def infer_batch_size(args: tuple, kwargs: dict, batch_first: bool = True) -> int | None:
    """The batch size of a forward call: the batch dimension of its first tensor input (a
    ``PackedSequence``: its first time step's size), or ``None`` without a tensor input, or when
    the first input is a flat 1-d index with a second 1-d index beside it (``EmbeddingBag``'s
    ``(input, offsets)``, whose batch is the number of bags)."""
    values = list(args) + list(kwargs.values())
    for v in values:
        if isinstance(v, PackedSequence):
            return int(v.batch_sizes[0]) if len(v.batch_sizes) else 0
        t = next(tensors_in(v), None)
        if t is not None and t.dim() > 0:
            if t.dim() == 1 and not t.is_floating_point():
                flat = [u for u in tensors_in(values) if u.dim() == 1 and not u.is_floating_point()]
                if len(flat) > 1:
                    return None
            bdim = 0 if batch_first or t.dim() < 2 else 1
            return int(t.shape[bdim])
    return None


def _batch_dim_is_one(t, bdim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > bdim and t.shape[bdim] == 1


def _expand_batch(t, bdim: int, b: int):
    """``t`` with its batch dimension of size 1 expanded (a view) to ``b``."""
    if not _batch_dim_is_one(t, bdim):
        return t
    shape = list(t.shape)
    shape[bdim] = b
    return t.expand(shape)


def _replace_first_tensor(output, new: torch.Tensor):
    if isinstance(output, torch.Tensor):
        return new
    items = list(output)
    for i, v in enumerate(items):
        if isinstance(v, torch.Tensor):
            items[i] = new
            break
    return type(output)(items) if not hasattr(output, "_fields") else type(output)(*items)


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


def _mean_scale(module: nn.Module, backprops: torch.Tensor) -> float:
    """``B``, the factor that undoes a mean loss's ``1/B`` for batch-first ``backprops``:
    ``module.max_batch_len`` when the layer sets it (recurrent layers fed shrinking batches),
    else the batch size of ``backprops``."""
    return float(getattr(module, "max_batch_len", None) or backprops.shape[0])


def _in_parameter_precision(module: nn.Module, activations: list, backprops: torch.Tensor):
    """Mixed precision (``torch.autocast``): a layer's inputs and output gradient may be bf16 or
    fp16 while its parameters are float32. Per-sample gradients, norms and clipped sums are then
    computed in the parameters' precision (the low-precision values are upcast, never the
    parameters downcast), so that norms are not under-estimated by bf16 round-off and the
    released gradient has the parameters' dtype."""
    dtype = next((p.dtype for p in own_parameters(module) if p.is_floating_point()), None)
    if dtype is None:
        return activations, backprops

    def up(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            if torch.finfo(t.dtype).bits < torch.finfo(dtype).bits:
                return t.to(dtype)
        return t

    return [up(a) for a in activations], up(backprops)


def _hookable(out: torch.Tensor, inputs, floor: int | None) -> torch.Tensor:
    """The tensor whose gradient hook sees ``out``'s gradient even if ``out`` is modified in
    place later (``nn.ReLU(inplace=True)``, ``h += x``): ``out`` itself, or, when ``out`` is a
    view without overlap (a reshape, a transpose, a slice) of a contiguous tensor the call
    created (``nn.Linear`` on ``(B, T, d)`` returns a view of its 2-d ``addmm``), that base.
    An in-place op on a view drops the view's hooks, whereas a hook on the base keeps receiving
    the gradient of the value before the op. The base must be new in this forward pass (its
    node numbered from ``floor`` on) and be no input."""
    base = out._base if out._is_view() else None
    if (
        base is None
        or floor is None
        or base.grad_fn is None
        or base.grad_fn._sequence_nr() < floor
        or not base.is_contiguous()
        or not non_overlapping(out)
        or any(base is t or base is t._base for t in tensors_in(inputs))
    ):
        return out
    return base


def _in_function_backward() -> bool:
    """Whether a backward pass runs an autograd ``Function``'s Python ``backward`` that is on
    the call stack (where reentrant activation checkpointing recomputes its segment). Outside a
    backward pass (the usual forward) no frame is read."""
    if torch._C._current_graph_task_id() == -1:
        return False
    code = torch.autograd.function.BackwardCFunction.apply.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _in_non_reentrant_recompute() -> bool:
    """Whether torch's non-reentrant activation checkpointing is recomputing a segment (its
    recomputation's saved-tensor hooks are the innermost): the recompute only refills saved
    tensors of the original graph; no backward of its own follows. Any other saved-tensor hooks
    (``save_on_cpu``, a user's) do not count."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return False
    pack = hooks[0]
    return (getattr(pack, "__module__", None) == "torch.utils.checkpoint"
            and getattr(pack, "__qualname__", "").startswith("_recomputation_hook."))


def _view_grad(on_grad, shape: tuple, stride: tuple, offset: int, grad: torch.Tensor):
    """Calls ``on_grad`` with the part of ``grad`` (the gradient of a hooked view's contiguous
    base) that the view covers: ``shape`` and ``stride``, at ``offset`` elements from the
    base's start."""
    return on_grad(grad.contiguous().as_strided(shape, stride, offset))


class _OutputWitness:
    """A global forward hook (``register_module_forward_hook``) that a GradSampleModule keeps
    first among the global forward hooks while someone else's is registered: it records the
    output of every call of a hooked layer as the layer's ``forward`` returned it, before any
    other global hook (they run before a module's own hooks) can replace or modify it; the
    capture hook compares (:meth:`GradSampleModule._check_forward_output`). Holds its module
    weakly: the witness of a module dropped without ``cleanup()`` removes itself when the
    module is freed; the module removes it at the end of a forward pass when no other global
    forward hook is left (torch.compile warns about any global hook)."""

    def __init__(self, gsm: GradSampleModule):
        self._gsm = weakref.ref(gsm, self._gone)
        self.handle = _torch_module.register_module_forward_hook(self)

    def _gone(self, _ref) -> None:
        self.handle.remove()

    def go_first(self) -> None:
        hooks = _torch_module._global_forward_hooks
        if self.handle.id not in hooks:  # removed by someone else: registered again
            self.handle = _torch_module.register_module_forward_hook(self)
        if next(iter(hooks)) != self.handle.id:
            hooks.move_to_end(self.handle.id, last=False)

    def remove(self) -> None:
        self.handle.remove()

    def __call__(self, module: nn.Module, args, output) -> None:
        gsm = self._gsm()
        if gsm is None or not _foreign_global_forward_hooks():
            # its module is gone, or nothing is left to watch (the capture hook checks only
            # while another global hook is registered; a forward pass installs it again)
            self.handle.remove()
            if gsm is not None and gsm._witness is self:
                gsm._remove_witness()
            return
        gsm._witness_output(module, output)


def _hook_gradient(t: torch.Tensor, on_grad) -> None:
    """Calls ``on_grad`` with the gradient of ``t`` in the backward pass, as the autograd node
    that made ``t`` receives it: a pre-hook of ``t.grad_fn``, which autograd runs after every
    tensor hook of ``t`` (``Tensor.register_hook``, registered before or after this one,
    during or after the forward pass, ``retain_grad``), so the per-sample gradients come from
    the gradient that the layer's backward gets. A node pre-hook also sees the gradient of
    ``t``'s value when ``t`` is modified in place later (its hooks after the op are on the new
    node, upstream of this one). A node's gradients are indexed by output number (several
    outputs of one ``torch.autograd.Function``); ``None`` where ``t`` got none."""
    node = t.grad_fn
    if node is None:  # a leaf: no node to hook
        t.register_hook(on_grad)
        return
    node.register_prehook(partial(_node_grad, t.output_nr, on_grad))


def _node_grad(output_nr: int, on_grad, grad_outputs):
    grad = grad_outputs[output_nr]
    if grad is not None:
        on_grad(grad)
    return None  # the gradients pass on unchanged


def _runs_before_capture(hook) -> bool:
    """Whether a layer's forward hook stays before the capture hook: FSDP2's (``fully_shard``),
    which reshards the parameters and registers on the output the tensor hook that gathers them
    again for the layer's backward (it must run before the capture hook's, registered after
    it); it leaves the output's values unchanged (at most casts it to ``output_dtype``)."""
    while isinstance(hook, partial):
        hook = hook.func
    return (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp")


def _capture_hook_first(hooks: Mapping, hook_id: int | None) -> bool:
    """Whether the hooks of :func:`_runs_before_capture`, and only those, precede ``hook_id``
    in ``hooks``."""
    seen = False
    for key, hook in hooks.items():
        if key == hook_id:
            seen = True
        elif _runs_before_capture(hook) == seen:  # an FSDP hook after it, or another before it
            return False
    return seen


def _place_capture_hook(handle) -> None:
    """Puts the capture hook ``handle`` first among its layer's forward hooks, after those of
    :func:`_runs_before_capture` only."""
    hooks = handle.hooks_dict_ref()
    if not hooks or handle.id not in hooks or _capture_hook_first(hooks, handle.id):
        return
    early = [key for key, hook in hooks.items() if _runs_before_capture(hook)]
    hooks.move_to_end(handle.id, last=False)
    for key in reversed(early):
        hooks.move_to_end(key, last=False)


def _foreign_global_forward_hooks() -> bool:
    """Whether a global forward hook other than a GradSampleModule's :class:`_OutputWitness` is
    registered (``torch.nn.modules.module.register_module_forward_hook``)."""
    hooks = getattr(_torch_module, "_global_forward_hooks", None)
    return bool(hooks) and any(not isinstance(h, _OutputWitness) for h in hooks.values())


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

    The batch size of each pass is in the module's :class:`StepRecord`.
    """
    b = max((g.shape[0] for g in passes if g is not None), default=0)
    ref = next(g for g in passes if g is not None)
    out = ref.new_zeros((len(passes), b, *p.shape))
    for i, g in enumerate(passes):
        if g is not None:
            out[i, : g.shape[0]] = g
    return out


class GradSampleHooks(GradSampleModule):
    """Opacus 1.6's in-place form of :class:`GradSampleModule` (``wrap_model=False``): the
    hooks are attached to ``m`` itself, which the user keeps calling (its class and identity
    unchanged); this object holds the per-sample state, the step record and ``cleanup()``."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        self.attach_to_module()

