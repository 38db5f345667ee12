"""Fast gradient clipping: per-sample gradient *norms* without per-sample gradients
(``grad_sample_mode="ghost"``).

:class:`GradSampleModuleFastGradientClipping` reuses the capture machinery of
:class:`~dptorch.grad_sample.GradSampleModule` (forward hooks keep each call's inputs ``A``, tensor
hooks deliver the output gradients ``G``) but turns ``(A, G)`` into squared per-sample norms
``(B,)`` per parameter instead of ``(B, *p.shape)`` gradients:

* a registered **norm sampler** (:mod:`dptorch.grad_sample.norm_samplers`: ghost norms by Gram
  matrices for Linear/Conv, grouped indices for Embedding, cheap instantiation for the norm
  layers), when the layer's parameters are used by this one call only;
* otherwise **instantiation**: the per-sample gradient of every call is computed (grad sampler
  or ``torch.func``), summed over the calls of the pass (recurrent use, tied parameters: the
  per-sample gradient is the *sum* over calls, whose norm is not the sum of the calls' norms),
  and reduced to its norm at the end of the backward pass. This is always exact.

How many calls touch a parameter is counted in the forward hooks; over-counting (a forward
without backward) only makes the result take the (exact) instantiation path.

The clipped update needs a second backward pass of ``Σ_b c_b · loss_b`` with the clip factors
``c_b = min(1, C / (‖g_b‖ + 1e-6))`` (hooks off): :class:`~dptorch.grad_sample.fast_clipping_loss.DPLossFastGradientClipping`
packages both passes in ``loss.backward()``. The first pass differentiates only with respect
to the layers' outputs (``torch.autograd.grad(loss, outputs)``), so autograd skips every weight
gradient there and ``p.grad`` is untouched: gradient accumulation over several physical batches
composes. The book-keeping mode (``"bk"``, one backward pass) is the subclass in
:mod:`dptorch.grad_sample.grad_sample_module_bk`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..clipping import ClippingContract
from .grad_sample_module import GradSampleModule
from .gsm_base import ACCUMULATION_FORBIDDEN_MESSAGE, weak_method
from .norm_samplers import Factors, factor_inner, sq_norms
from .registry import derived, replaced_forward, rule_for
from .step_record import PassRecord, grad_state

logger = logging.getLogger(__name__)


def _pad_to(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` zero-padded along dim 0 to ``n`` rows (layers that declare ``max_batch_len``)."""
    if t.shape[0] >= n:
        return t
    return torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))])


def _pad_factors(f: Factors, n: int) -> Factors:
    """``f`` with zero rows appended up to ``n`` samples (zero gradients)."""
    return Factors(
        v=_pad_to(f.v, n),
        u=None if f.u is None else _pad_to(f.u, n),
        ids=None if f.ids is None else _pad_to(f.ids, n),
    )


class GradSampleModuleFastGradientClipping(GradSampleModule):
    """Computes per-sample gradient norms (``per_sample_gradient_norms``, ``(B,)``) with ghost
    norms where possible (Opacus-compatible ``grad_sample_mode="ghost"``).

    Args:
        m: the module to wrap.
        batch_first, loss_reduction, strict, force_functorch: as :class:`GradSampleModule`.
        max_grad_norm: C, when no ``clipping`` contract is given.
        use_ghost_clipping: ``False`` instantiates every layer's per-sample gradient (Opacus's
            "fast gradient clipping"); ``True`` uses the norm samplers where they apply.
        clipping: the :class:`~dptorch.clipping.ClippingContract` shared with the optimizer
            (``make_private`` and the loss wrapper pass the optimizer's; the module never keeps
            a copy of C).

    After a backward pass: ``p._norm_sample`` ``(B,)`` per parameter and
    ``per_sample_gradient_norms`` ``(B,)`` over all parameters. ``p.grad_sample`` is never set.
    """

    #: the second backward pass leaves the clipped sum to autograd (ghost); bk forms it itself
    autograd_forms_clipped_sum = True
    mode_name = "ghost"
    #: the second backward pass takes the gradient of every use of a parameter, hooked or not,
    #: while the clip factors come from the hooked calls' norms: a use outside its module that
    #: first appears after the first pass would be released unclipped, so every pass is traced
    TRACE_EVERY_PASS = True

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        max_grad_norm: float | Sequence[float] = 1,
        use_ghost_clipping: bool = True,
        clipping: ClippingContract | None = None,
    ):
        if clipping is None:
            clipping = ClippingContract(
                max_grad_norm, params=[p for p in m.parameters() if p.requires_grad]
            )
        self._check_contract(clipping)
        super().__init__(
            m,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            strict=strict,
            force_functorch=force_functorch,
        )
        self.clipping = clipping
        self.use_ghost_clipping = use_ghost_clipping
        self._norm_sq: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self._call_counts: dict[int, int] = {}
        self._callers: dict[int, list[nn.Module]] = {}
        self._factors: dict[int, list] = {}
        self._outputs: list[GradientEdge] = []
        #: the capture's tensor hooks on those outputs (see :meth:`_hook_output_grad`)
        self._output_hooks: list = []
        self._per_sample_gradient_norms: torch.Tensor | None = None
        self._keep_output_edges = True
        # torch DDP must not all-reduce p.grad in backward: it holds the local clipped sum, which
        # the distributed optimizer all-reduces itself; with bk, where autograd computes no weight
        # gradient, DDP's reducer would even overwrite it (zero gradients, silently)
        try:
            from ..distributed import disable_gradient_sync
        except ImportError:  # pragma: no cover - distributed support is built separately
            pass
        else:
            disable_gradient_sync(m)

    # ------------------------------------------------------------------ public API
    @property
    def max_grad_norm(self) -> float | list[float]:
        """The clipping bound of the shared contract (per-layer: the list of bounds)."""
        c = self.clipping
        return c.max_grad_norms if c.per_layer else c.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        if isinstance(value, (list, tuple)):
            self._check_contract(ClippingContract(value, params=self.trainable_parameters()))
            self.clipping.max_grad_norms = value
        else:
            self.clipping.max_grad_norm = value

    def bind_clipping(self, clipping: ClippingContract) -> None:
        """Adopts ``clipping`` (the optimizer's contract) as this module's, by reference."""
        self._check_contract(clipping)
        self.clipping = clipping

    def _check_contract(self, clipping: ClippingContract) -> None:
        if clipping.per_layer:
            raise ValueError(
                "Per-layer clipping (a list of max_grad_norm) is impossible with "
                "grad_sample_mode='ghost': its second backward pass weights each sample's loss by "
                "one factor shared by all layers. Use grad_sample_mode='bk' (per-layer clip "
                "factors are applied layer by layer) or 'hooks'."
            )

    @property
    def per_sample_gradient_norms(self) -> torch.Tensor:
        """L2 norm over all trainable parameters of each sample's gradient in the last backward
        pass, ``(B,)``."""
        if self._per_sample_gradient_norms is None:
            # not AttributeError: nn.Module.__getattr__ would replace the message
            raise RuntimeError(
                "per_sample_gradient_norms is only available after a backward pass through a "
                "forward pass run in training mode, with gradients enabled and the hooks on "
                "(model.train(), no torch.no_grad(), no disable_hooks())."
            )
        return self._per_sample_gradient_norms

    @per_sample_gradient_norms.setter
    def per_sample_gradient_norms(self, value: torch.Tensor | None) -> None:
        self._per_sample_gradient_norms = value

    def get_norm_sample(self) -> torch.Tensor:
        """Alias of :attr:`per_sample_gradient_norms` (Opacus name)."""
        return self.per_sample_gradient_norms

    def get_clipping_coef(self) -> torch.Tensor:
        """Flat clip factors ``min(1, C / (‖g_b‖ + 1e-6))`` of the last backward pass, ``(B,)``."""
        return self.clipping.flat_factors(self.per_sample_gradient_norms)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Also drops the kept outputs of forward passes that were never back-propagated."""
        super().zero_grad(set_to_none=set_to_none)
        self._outputs = []
        self._output_hooks = []

    def del_grad_sample(self) -> None:
        """Removes per-sample norms, pass counters and kept outputs (see ``gsm_base``)."""
        super().del_grad_sample()
        self._outputs = []
        self._output_hooks = []

    def cleanup(self) -> None:
        super().cleanup()
        self._outputs.clear()
        self._output_hooks.clear()
        self._call_counts.clear()
        self._callers.clear()
        self._factors.clear()

    # ------------------------------------------------------------------ capture
    def capture_activations_hook(
        self, module: nn.Module, forward_input, _forward_output, forward_kwargs: dict | None = None
    ) -> None:
        """Counts the calls touching each parameter and keeps the output's gradient edge (a
        target of the norm pass, :meth:`norm_backward`; released at the end of the next
        backward pass or by ``zero_grad``). Refuses a layer whose batch gradient autograd would
        not form as the clipped sum (:attr:`autograd_forms_clipped_sum`)."""
        if self.autograd_forms_clipped_sum:
            self._refuse_if_batch_grad_not_a_sum(module)
        for p in self.sampled_params(module):
            self._call_counts[id(p)] = self._call_counts.get(id(p), 0) + 1
            callers = self._callers.setdefault(id(p), [])
            if not any(m is module for m in callers):
                callers.append(module)
        if self._keep_output_edges:
            self._outputs.append(get_gradient_edge(_forward_output))

    def _hook_output_grad(self, module: nn.Module, hooked: torch.Tensor, on_grad) -> None:
        """Ghost's norm pass (:meth:`norm_backward`) stops at the hooked outputs' gradient
        edges: autograd runs the tensor hooks of a node it stops at, not its node pre-hooks
        (bk, one ordinary backward pass, uses those). The capture is a tensor hook, which
        :meth:`norm_backward` moves after every other hook of its tensor (registered during or
        after the forward pass: ``Tensor.register_hook``, ``retain_grad``, torch's
        ``FlopCounterMode``) so that it sees the gradient the layer's backward gets; one
        registered during the norm pass itself, after that, is refused."""
        if not self._keep_output_edges:
            super()._hook_output_grad(module, hooked, on_grad)
            return
        place: list = []
        handle = hooked.register_hook(
            partial(weak_method(self._last_tensor_hook, module), place, on_grad)
        )
        place.append(handle)
        self._output_hooks.append(handle)

    def _last_tensor_hook(self, module, place: list, on_grad, grad):
        """The capture's tensor hook in the norm pass; ``place[0]`` its handle. Tensor hooks
        run in the order of registration, each on the previous one's result, and the layer's
        backward gets the last result: the norms must come from that one."""
        if self.hooks_enabled and self.backward_hooks_enabled and place:
            hooks = place[0].hooks_dict_ref()
            keys = list(dict.__iter__(hooks)) if hooks is not None else []  # autograd's order
            later = keys[keys.index(place[0].id) + 1:] if place[0].id in keys else []
            if not all(_is_capture_tensor_hook(hooks[key]) for key in later):
                raise ValueError(
                    f"{self.module_name(module)} ({type(module).__name__}): a tensor hook "
                    "(Tensor.register_hook) was registered on this layer's output during the "
                    "backward pass. It runs after dptorch's per-sample capture hook and may "
                    "change the gradient the layer's backward receives, which the per-sample "
                    "norms would then not match (and their clipping would not bound each "
                    "sample's contribution). Register it before the backward pass."
                )
        return on_grad(grad)

    def _refuse_if_batch_grad_not_a_sum(self, module: nn.Module) -> None:
        rule = rule_for(module)
        check = rule.batch_grad_not_a_sum if rule is not None else None
        reason = check(module) if check is not None and self.sampled_params(module) else None
        if reason:
            name = self.module_name(module)
            raise NotImplementedError(
                f"{type(module).__name__} '{name}': ghost clipping lets autograd form the clipped "
                f"sum in its second backward pass, but {reason}; the released gradient would not "
                "be a sum of clipped per-sample gradients. Use grad_sample_mode='bk' or 'hooks', "
                "which compute this layer's per-sample contribution exactly."
            )

    def _process_call(
        self, module, activations, backprops, kwargs, max_batch_len: int, scale: float = 1.0
    ) -> None:
        """Adds this call's squared per-sample norms (norm sampler; the per-sample gradients are
        ``scale`` times those of ``backprops``, so the norms ``scale²`` times) or per-sample
        gradients (instantiation, summed over calls) to the pass's state."""
        if self._use_norm_sampler(module, activations, backprops):
            ids = self.sampled_ids(module)
            rule = rule_for(module)
            for p, sq in rule.norm_sq(module, activations, backprops).items():
                if id(p) in ids:
                    self._add_norm_sq(p, _pad_to(sq * (scale * scale), max_batch_len))
                    self._pass.covered.add(id(p))
            if not self._single_call(module):
                self._add_cross_terms(
                    module, rule, activations, backprops, ids, max_batch_len, scale
                )
            self._record_call(module, activations, backprops, kwargs, scale)
        else:
            super()._process_call(module, activations, backprops, kwargs, max_batch_len, scale)

    def _single_call(self, module: nn.Module) -> bool:
        """Whether every sampled parameter of ``module`` was used by exactly one call."""
        counts = self._call_counts
        for p in self.sampled_params(module):
            if counts.get(id(p), 0) > 1:
                return False
        return True

    #: a parameter used by more calls than this (a recurrent cell's T steps) is instantiated:
    #: the cross terms grow with the number of pairs of calls
    MAX_FACTORED_CALLS = 4

    def _factorable(self, module: nn.Module) -> bool:
        """Whether the parameters of ``module`` used by several calls (tied weights, a layer
        called twice) take the factored path: every layer that shares a parameter with
        ``module``, directly or through another shared parameter, has a rule with ``norm_sq``
        and ``factors``, and no such parameter has more than :attr:`MAX_FACTORED_CALLS` calls.
        The decision is the same for every call of the group (a group never mixes the factored
        and the instantiated path). The squared norm of a summed per-sample gradient is then the
        calls' norms plus their cross terms (:meth:`_add_cross_terms`), with nothing of size
        ``(B, *p.shape)`` built."""
        seen_modules: set[int] = set()
        todo = [module]
        while todo:
            m = todo.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            rule = rule_for(m)
            if (rule is None or derived(rule, "factors") is None or rule.norm_sq is None
                    or replaced_forward(m)):
                return False
            for p in self.sampled_params(m):
                n = self._call_counts.get(id(p), 0)
                if n > self.MAX_FACTORED_CALLS:
                    return False
                if n > 1:
                    todo.extend(self._callers.get(id(p), ()))
        return True

    def _grouped(self) -> bool:
        """Whether the current batch has units of several rows (user level): their norms need
        the per-row gradients, summed per unit."""
        layout = self.clipping.layouts.current
        return layout is not None and not layout.one_row_per_group

    def _use_norm_sampler(self, module: nn.Module, activations, backprops) -> bool:
        return (
            not self._grouped()
            and self.use_ghost_clipping
            and not self.force_functorch
            and getattr(rule_for(module), "norm_sq", None) is not None
            and not replaced_forward(module)
            and (self._single_call(module) or self._factorable(module))
        )

    def _add_cross_terms(
        self, module, rule, activations, backprops, ids, max_batch_len, scale: float = 1.0
    ) -> None:
        """For each parameter of this call used by several calls: ``2⟨G_this, G_k⟩`` per sample
        with every earlier call ``k`` of the pass, from the calls' factors (each call's
        per-sample gradient is its ``scale`` times its factors')."""
        shared = {i for i in ids if self._call_counts.get(i, 0) > 1}
        for p, f in derived(rule, "factors")(module, activations, backprops).items():
            if id(p) not in shared:
                continue
            earlier = self._factors.setdefault(id(p), [])
            for h, h_scale in earlier:
                cross = factor_inner(f, h) if f.v.shape[0] == h.v.shape[0] else None
                if cross is None:  # padded (recurrent) calls: align the rows first
                    n = max(f.v.shape[0], h.v.shape[0])
                    cross = factor_inner(_pad_factors(f, n), _pad_factors(h, n))
                self._add_norm_sq(p, _pad_to(cross * (2 * scale * h_scale), max_batch_len))
            earlier.append((f, scale))

    def _record_call(self, module, activations, backprops, kwargs, scale: float = 1.0) -> None:
        """Hook for subclasses that need the call's ``(A, G)`` after the norms (book-keeping)."""

    def _add_norm_sq(self, p: nn.Parameter, sq: torch.Tensor) -> None:
        prev = self._norm_sq.get(id(p))
        if prev is not None:
            sq = prev[1] + sq
        self._norm_sq[id(p)] = (p, sq)

    # ------------------------------------------------------------------ end of the pass
    def _end_of_backward(self) -> None:
        """Reduces instantiated per-sample gradients to norms and publishes the norms."""
        rec = self._take_pass()
        pending, self._pending = list(self._pending.values()), {}
        layout = self.clipping.layout(rec.batch_size, type(self).__name__) if pending else None
        for p in pending:
            gs = p._current_grad_sample
            if layout is None or layout.one_row_per_group:
                self._add_norm_sq(p, sq_norms(gs))
            else:  # a user's rows: the norm of their summed gradient
                self._add_norm_sq(p, layout.unit_norm_sq(gs))
            if not self._keep_instantiated():
                del p._current_grad_sample
        norm_sq, self._norm_sq = list(self._norm_sq.values()), {}
        self._call_counts.clear()
        self._callers.clear()
        self._factors.clear()
        self._outputs.clear()
        self._output_hooks.clear()
        self._publish_norms(norm_sq, rec.batch_size)
        self._after_norms(norm_sq, rec)

    def _keep_instantiated(self) -> bool:
        return False

    def _after_norms(self, norm_sq: list[tuple[nn.Parameter, torch.Tensor]], rec: PassRecord) -> None:
        """Hook for subclasses: runs at the end of every backward pass, after the norms."""

    def _publish_norms(self, norm_sq: list[tuple[nn.Parameter, torch.Tensor]], b: int | None) -> None:
        total = None
        layout = self.clipping.layouts.training_layout()
        if layout is not None and norm_sq:  # padding rows: norm 0
            valid = layout.valid.to(norm_sq[0][1].device)
            norm_sq = [(p, sq * valid[: sq.shape[0]].to(sq.dtype)) for p, sq in norm_sq]
        for p, sq in norm_sq:
            p._norm_sample = sq.sqrt()
            total = sq if total is None else total + sq
        if total is None:
            ref = next(iter(self.trainable_parameters()), None)
            n = b or 0
            total = torch.zeros(n) if ref is None else ref.new_zeros(n)
        self.per_sample_gradient_norms = total.sqrt()

    # ------------------------------------------------------------------ the norm pass
    def norm_backward(self, loss: torch.Tensor) -> None:
        """First pass of ghost clipping: back-propagates ``loss`` (keeping the graph) only as far
        as the hooked layers' outputs (their gradient edges), which fires the hooks (norms)
        without computing any weight gradient or touching ``p.grad``."""
        targets, self._outputs = self._outputs, []
        hooks, self._output_hooks = self._output_hooks, []
        _last_of_their_tensors(hooks)
        if not targets or not loss.requires_grad:
            return
        params = list(self.trainable_parameters())
        before = [grad_state(p) for p in params]
        try:
            torch.autograd.grad(loss, targets, retain_graph=True, allow_unused=True)
            # identities and versions only (no host sync): a backward run inside the norm pass
            # (a reentrant checkpoint other than torch's, which calls torch.autograd.backward
            # in its own backward) writes raw gradients to p.grad, released with the clipped sum
            written = [p for p, s in zip(params, before) if grad_state(p) != s]
            if written:
                raise ValueError(
                    f"{', '.join(self._param_name(p) for p in written[:4])}: p.grad was written "
                    "during ghost clipping's norm pass, which computes no weight gradient: a "
                    "backward run inside it (a reentrant activation checkpoint that calls "
                    "torch.autograd.backward in its backward, a hook) wrote unclipped "
                    "gradients. Use non-reentrant checkpointing (torch.utils.checkpoint with "
                    "use_reentrant=False), or grad_sample_mode='hooks' or 'bk'."
                )
        except RuntimeError as e:
            if "use_reentrant" not in str(e):
                raise
            raise ValueError(
                "grad_sample_mode='ghost' computes the per-sample norms with a first, partial "
                "backward pass (torch.autograd.grad), which reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True) does not support. Use "
                "non-reentrant checkpointing (Hugging Face: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), or "
                "grad_sample_mode='bk' or 'hooks', which support both."
            ) from e

    def check_can_clip(self) -> None:
        """Raises ``ValueError`` when a new clipped sum may not be added to ``p.grad``: the
        optimizer released it since the last ``zero_grad``, or accumulation is forbidden and a
        clipped pass is already there."""
        if self.record.released:
            raise ValueError(
                "optimizer.step() ran since the last optimizer.zero_grad(): p.grad still holds the "
                "released (noisy) gradient, and this backward pass added the new clipped sum to "
                "it. Call optimizer.zero_grad() before every backward pass (zero_grad, backward, "
                "step)."
            )
        if not self.grad_accumulation_allowed and sum(r.clipped for r in self.record.passes) > 1:
            raise ValueError(ACCUMULATION_FORBIDDEN_MESSAGE)

    def _param_name(self, p: nn.Parameter) -> str:
        for name, q in self._module.named_parameters():
            if q is p:
                return f"parameter {name}"
        return f"a parameter of shape {tuple(p.shape)}"

    def check_grads_untouched(self) -> None:
        """Before a clipped sum is added to ``p.grad``: ``p.grad`` must be what the step's last
        clipped pass left there, or (first pass of the step) ``None`` or zero. Anything else was
        written by a backward pass no per-sample hook clipped (hooks off, a plain ``backward()``
        of another loss) and would be released with the clipped sum."""
        last = next(
            (r.grad_state for r in reversed(self.record.passes)
             if r.clipped and r.grad_state is not None),
            None,
        )
        expected = self.record.zeroed if last is None else last
        # without a host sync when p.grad is unset or as zero_grad / the last pass left it
        unknown = [p for p in self.trainable_parameters() if p.grad is not None and (
            id(p) not in expected or grad_state(p) != expected[id(p)])]
        if last is not None:
            bad = [p for p in unknown if id(p) in last]
        else:
            bad = [p for p in unknown if bool(p.grad.any())]
        if bad:
            raise ValueError(
                f"{', '.join(self._param_name(p) for p in bad[:4])} already had a gradient when "
                "this DP backward pass began (a backward pass with the hooks disabled, or a plain "
                "loss.backward() of another loss): it was not clipped per sample and would be "
                "released with the clipped sum. Call optimizer.zero_grad() before the DP "
                "backward pass, and back-propagate every loss term through the DP loss."
            )

    def mark_clipped_pass(self, bound=None) -> None:
        """Records that ``p.grad`` now holds the clipped sum of the last pass, clipped with
        ``bound`` (default: the contract's current bound)."""
        if not self.record.passes:
            self.record.add_pass(PassRecord(batch_size=0))
        rec = self.record.passes[-1]
        rec.clipped = True
        rec.clip_bound = self.clipping.snapshot() if bound is None else bound
        rec.grad_state = {id(p): grad_state(p) for p in self.trainable_parameters()}
        self.check_can_clip()


def _is_capture_tensor_hook(hook) -> bool:
    """Whether a tensor hook is a ghost capture hook (it returns ``None``)."""
    return isinstance(hook, partial) and isinstance(hook.func, weak_method) and (
        hook.func.__func__ is GradSampleModuleFastGradientClipping._last_tensor_hook
    )


def _last_of_their_tensors(handles: list) -> None:
    """Moves the tensor hooks ``handles`` after every other hook of their tensors (removed and
    inserted again: autograd calls a tensor's hooks in the order of its dict's storage, which
    ``OrderedDict.move_to_end`` does not change)."""
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and len(hooks) > 1 and handle.id in hooks:
            hooks[handle.id] = hooks.pop(handle.id)


class GradSampleHooksFastGradientClipping(GradSampleModuleFastGradientClipping):
    """Opacus 1.6's in-place form of :class:`GradSampleModuleFastGradientClipping`
    (``wrap_model=False``): hooks on ``m`` itself, which the user keeps calling."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        self.attach_to_module()



def create_norm_sample(
    *, param: torch.Tensor, grad_sample: torch.Tensor, max_batch_len: int
) -> None:
    """Sets ``param._norm_sample`` to the per-sample L2 norms (``(B,)``) of ``grad_sample``
    (``(B, *param.shape)``) when ``param`` requires a gradient; an empty tensor for an empty
    batch (``max_batch_len == 0``). Opacus's helper of this name."""
    if not param.requires_grad:
        return
    if max_batch_len == 0:
        param._norm_sample = grad_sample.new_empty((0,))
    else:
        param._norm_sample = grad_sample.reshape(len(grad_sample), -1).norm(2, dim=-1)
