"""Book-keeping (BK) clipping, Bu et al. 2023: ``grad_sample_mode="bk"``, one backward pass.

During the ordinary ``loss.backward()`` the capture machinery of
:class:`GradSampleModuleFastGradientClipping` records, for every hooked layer call, its inputs
``A`` and output gradient ``G`` (or, where that is smaller and cheap, the instantiated per-sample
gradient) and the squared per-sample norms. At the end of the pass (autograd engine callback)
the clip factors ``c_b`` are known and each layer's clipped sum is one weighted contraction,
e.g. ``Σ_b c_b G_bᵀ A_b`` for Linear (the cost of one ordinary weight gradient), added to
``p.grad``.

Autograd must not also compute the (unclipped) weight gradients, or the step would pay for them
twice. Two mechanisms:

* Linear (and subclasses that keep its forward, e.g. ``RNNLinear``), Conv1d/2d/3d and Embedding
  run their forward through a custom ``torch.autograd.Function`` (an instance-level ``forward``
  override installed at wrapping time, removed by ``to_standard_module()``) whose backward
  returns the input gradient only; autograd never computes nor accumulates their parameter
  gradients.
* every other trainable parameter (normalisation layers, DP-layer biases, layers handled by
  ``torch.func``...) gets a tensor hook that replaces its autograd gradient by zeros, so
  ``p.grad`` keeps its previous value (gradient accumulation) and the clipped sum is added on top.

Both are active only while the hooks are (``disable_hooks()`` restores plain autograd).

Per-layer clipping is supported (``max_grad_norm`` a list, one norm per trainable parameter): the
factors are applied parameter by parameter.

A layer whose rule has norms but no clipped sum of its own (``EmbeddingBag``, the normalisation
layers, a user's rule registered with a norm function only) gets its clipped sum by calling its
``forward`` again at the end of the pass (:func:`~.norm_samplers.generic_clipped_sum`), while its
norms came from the forward's activations: a forward that depends on state (a counter, a
schedule, a buffer it updates, a value its parent sets after the call) would make that recompute
differentiate another function than the one whose norms were clipped. The recompute is guarded
as ``torch.func``'s is (:mod:`~dptorch.grad_sample.recompute_state`): any change of the layer's
state it makes, or any difference between its output and the forward's (a per-sample fingerprint
taken in the forward, for the calls that may take this path only), refuses the step with
``ValueError`` before anything is written to ``p.grad``.

A user's gradient hook on a sampled parameter (``p.register_hook``) gets autograd's gradient of
the batch, as in the other modes, and does not change what is released: a layer with an
input-gradient-only forward whose parameter has such a hook runs its own forward instead (so that
autograd computes the weight gradient the hook sees), and dptorch's hook, which replaces
autograd's gradient by zeros, runs after every other hook of the parameter
(:meth:`~GradSampleModuleBookKeeping._on_pass_start`). A hook registered on such a parameter
between the forward and the backward pass, which autograd would call with ``None``, is refused.
"""

from __future__ import annotations

import inspect
import logging
from functools import partial

import torch
from torch import nn

from .functorch import module_batch_first
from .grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
    _last_of_their_tensors,
)
from .gsm_base import weak_method
from .norm_samplers import generic_clipped_sum, rows_scaled
from .recompute_state import current_fingerprint, recompute_guard
from .registry import derived, input_grad_only_forward, prefer_ghost, rule_for

logger = logging.getLogger(__name__)


def weighted_sum(c: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """``Σ_b c_b gs_b``: the clipped sum of an instantiated per-sample gradient ``(B, ...)``."""
    return torch.tensordot(c, gs, dims=1)


def _recomputed(module: nn.Module, rule=None) -> bool:
    """Whether bk forms ``module``'s clipped sum, on the norm path, by recomputing its forward
    (:func:`~.norm_samplers.generic_clipped_sum`): its rule has ``norm_sq`` but neither
    ``clipped_sum`` nor ``weighted_clipped_sum``."""
    rule = rule_for(module) if rule is None else rule
    return (rule is not None and rule.norm_sq is not None and rule.clipped_sum is None
            and derived(rule, "weighted_clipped_sum") is None)


def _library_forward(module: nn.Module) -> bool:
    """Whether ``module`` runs a library's own ``forward`` (torch.nn's or dptorch's layers), not
    one replaced on the instance or defined by a subclass. Only such a forward's clipped sum is
    formed by a recompute: a user's forward may read state kept outside the module (a counter in
    a dict) that changes its derivative and not its value, which neither the state snapshot nor
    the output fingerprint sees, and the recomputed sum would then not be the one whose norms
    were clipped (2 C released). Another layer on the norm path of a norm-only rule takes its
    per-sample gradients (its rule's, or ``torch.func``'s), whose norms and sum are one
    computation."""
    if "forward" in module.__dict__:
        return False
    owner = getattr(type(module).forward, "__module__", None) or ""
    return owner.startswith(("torch.nn.", "dptorch.layers."))


def _first_of_their_hooks(handle) -> None:
    """Moves the hook of ``handle`` before every other hook of its dict (removed and the others
    inserted again after it: hooks run in the order of the dict's storage)."""
    hooks = handle.hooks_dict_ref()
    if hooks is None or len(hooks) < 2 or handle.id not in hooks or next(iter(hooks)) == handle.id:
        return
    others = [(k, hooks.pop(k)) for k in list(hooks) if k != handle.id]
    for k, v in others:
        hooks[k] = v


# ----------------------------------------------------------------------------- the module
class GradSampleModuleBookKeeping(GradSampleModuleFastGradientClipping):
    """One-backward-pass DP clipping: after ``loss.backward()``, ``p.grad`` holds (on top of its
    previous value) the clipped sum ``Σ_b c_b ∇_p loss_b`` of the batch, and
    ``per_sample_gradient_norms`` the per-sample norms.

    Args: as :class:`GradSampleModuleFastGradientClipping`; the contract may be per-layer
    (``max_grad_norm`` a list with one norm per trainable parameter). The clip factors are
    computed from the shared contract at the end of every backward pass, and the bound they
    used is recorded for the optimizer to check against the noise it adds.

    A gradient that autograd computes for a parameter outside the hooked calls (a weight used
    functionally) is refused with ``ValueError`` instead of being released or dropped.
    """

    autograd_forms_clipped_sum = False
    mode_name = "bk"
    #: a use outside a hooked call gives autograd a gradient that :meth:`_on_autograd_grad`
    #: refuses at every pass; the trace of the first pass suffices
    TRACE_EVERY_PASS = False
    #: A layer whose norm is computed by instantiating its per-sample gradient keeps that
    #: gradient (its clipped sum is then one weighted sum instead of a weight-gradient matmul)
    #: while it is at most this many times the size of the inputs and output gradient it
    #: replaces. At 1.25 the square projections of a transformer at ``T = d/2`` are kept (their
    #: bias makes them just larger than ``(A, G)``): BERT 4×256 at B = 16, T = 128 went from
    #: 1.42× to 1.32× of the non-private step, and a 2-block transformer from 1.35× to 1.23×,
    #: with the same peak memory. At 2, BERT's 256 → 1024 layers are kept too: 1.30×, but 1.42×
    #: the memory.
    KEEP_RATIO = 1.25

    def __init__(self, m: nn.Module, **kwargs):
        self._bk_handles: list = []
        #: ``id(p) -> (p, handle of bk's gradient hook on p)``
        self._bk_param_hooks: dict[int, tuple[nn.Parameter, object]] = {}
        #: ids of the parameters whose layers ran the input-gradient-only forward since the
        #: last pass (autograd gives them no gradient: a user's hook on them would get ``None``)
        self._input_grad_only_ran: set[int] = set()
        self._bk_overridden: list[nn.Module] = []
        self._no_autograd: set[int] = set()
        self._fallback: set[int] = set()
        self._reached: dict[int, nn.Parameter] = {}
        #: ``{id(p): (p, (id(p.grad), its version) or None)}`` at the start of the pass
        self._grads_at_start: dict[int, tuple] = {}
        #: ``{id(p): (id(p.grad), its version)}`` right after autograd accumulated bk's zeros,
        #: or ``None`` where ``p.grad`` was not what that accumulation makes
        self._accumulated: dict[int, tuple | None] = {}
        self._bk_post_hooks: dict = {}
        super().__init__(m, **kwargs)
        self._keep_output_edges = False  # no norm pass: one ordinary backward
        #: ``(module, activations, backprops, kwargs, scale, fingerprint)`` of every call whose
        #: clipped sum is formed at the end of the pass
        self._records: list[tuple] = []
        self._install_bk()

    def _check_contract(self, clipping) -> None:
        """Per-layer contracts are fine: the factors are applied parameter by parameter."""

    # ------------------------------------------------------------------ install / remove
    def _install_bk(self) -> None:
        plain: set[int] = set()  # sampled by a layer whose own forward computes weight grads
        for module in self.iterate_submodules(self._module):
            params = self.sampled_params(module)
            fn = input_grad_only_forward(module)
            if fn is not None:
                n_inputs = len(inspect.signature(fn).parameters) - 1
                forward = partial(self._bk_forward, module, fn, n_inputs, type(module).forward)
                # the layer's own signature (inspect follows __wrapped__): a call with keyword
                # inputs (``layer(input=x)``) is bound to its positions for the grad samplers
                forward.__wrapped__ = type(module).forward.__get__(module)
                module.forward = forward
                self._bk_overridden.append(module)
                self._no_autograd |= {id(p) for p in params}
            else:
                plain |= {id(p) for p in params}
            for p in params:
                if id(p) in self._bk_param_hooks:  # a parameter tied between layers: one hook
                    continue
                # weakly (a parameter's hook holding this object, which holds the module, which
                # holds the parameter: a cycle the garbage collector does not see)
                handle = p.register_hook(weak_method(self._on_autograd_grad, p))
                self._bk_handles.append(handle)
                self._bk_param_hooks[id(p)] = (p, handle)
                after = p.register_post_accumulate_grad_hook(weak_method(self._on_accumulated, p))
                self._bk_handles.append(after)
                self._bk_post_hooks[id(p)] = after
        # a parameter tied between the two kinds (an Embedding subclass with a forward of its
        # own and a Linear head) gets autograd's gradient from the first: that one is expected
        self._no_autograd -= plain

    def _remove_bk(self) -> None:
        for h in self._bk_handles:
            h.remove()
        self._bk_handles = []
        self._bk_param_hooks = {}
        self._bk_post_hooks = {}
        for module in self._bk_overridden:
            if "forward" in module.__dict__:
                del module.forward
        self._bk_overridden = []
        self._no_autograd = set()

    def cleanup(self) -> None:
        super().cleanup()
        self._remove_bk()

    def remove_hooks(self) -> None:
        """Also gives the layers their own forward back (bk's input-gradient-only forwards)."""
        super().remove_hooks()
        self._remove_bk()

    def _refresh_units(self) -> None:
        self._remove_bk()
        super()._refresh_units()
        self._install_bk()

    def _active(self) -> bool:
        return self.hooks_enabled and self.backward_hooks_enabled and not self._in_functorch

    def _bk_forward(self, module, fn, n_inputs, original, *args, **kwargs):
        """``module``'s forward through its rule's input-gradient-only ``fn`` when called with
        exactly the ``n_inputs`` positional inputs ``fn`` takes and none of its parameters has a
        gradient hook of the user's; otherwise the original forward, whose parameter gradients
        the tensor hooks then zero (the layer is marked fallback)."""
        if self._active() and self.forward_hooks_enabled and module.training and torch.is_grad_enabled():
            params = self.sampled_params(module)
            if not kwargs and len(args) == n_inputs and not self._user_hooked(params):
                self._input_grad_only_ran.update(map(id, params))
                return fn(module, *args)
            self._fallback |= {id(p) for p in params}
        return original(module, *args, **kwargs)

    def _user_hooked(self, params) -> bool:
        """Whether one of ``params`` has a gradient hook other than bk's own.

        ``fn`` computes no weight gradient, so autograd would call such a hook with ``None``
        (a ``TypeError`` in the user's ``lambda g: g * 2``). The other modes let autograd
        compute the batch gradient, which the user's hook sees and may change, and release the
        clipped per-sample sum whatever the hook returns; bk does the same for such a layer: its
        original forward gives the hook autograd's gradient, dptorch's hook (moved after it,
        :meth:`_on_pass_start`) replaces the result by zeros, and the clipped sum is added at the
        end of the pass."""
        for p in params:
            hooks = p._backward_hooks
            if hooks is not None and len(hooks) > (1 if id(p) in self._bk_param_hooks else 0):
                return True
        return False

    def _on_autograd_grad(self, p: nn.Parameter, grad: torch.Tensor):
        """Tensor hook: autograd computed a gradient for ``p``. It is replaced by zeros (the
        clipped sum is added at the end of the pass); the pass must have covered ``p``, and a
        layer whose forward computes no weight gradient must not get one at all."""
        if grad is None or not self._active():
            return None
        if id(p) in self._no_autograd and id(p) not in self._fallback:
            raise ValueError(
                f"{self._param_name(p)} received a gradient from a use outside its layer's "
                "call (e.g. F.linear(h, layer.weight), or a term of the loss): that contribution "
                "would not be clipped per sample. Call the layer instead of using its parameter "
                "directly, or freeze the parameter."
            )
        self._reached[id(p)] = p
        if grad.is_sparse or grad.shape != p.shape:
            return torch.zeros_like(grad)
        # in the parameter's layout: autograd then accumulates it as it is (a gradient in
        # another layout, e.g. channels_last, is copied into a new tensor, at version 1)
        return torch.zeros_like(p, dtype=grad.dtype)

    def _on_pass_start(self) -> None:
        """Before any parameter gradient of the pass: ``p.grad`` is as the last clipped pass left
        it, and bk's gradient hook of every parameter that has other hooks runs after them, so
        that whatever they return is replaced by zeros (a hook's result is never released; a
        user's hook registered after wrapping, before it, would otherwise run on those zeros
        and could add to ``p.grad`` what no per-sample clipping bounds)."""
        if not (self.hooks_enabled and self.backward_hooks_enabled):
            return
        self.check_grads_untouched()
        self._grads_at_start = {
            i: (p, None if p.grad is None else (id(p.grad), p.grad._version))
            for i, (p, _) in self._bk_param_hooks.items()
        }
        self._accumulated = {}
        for handle in self._bk_post_hooks.values():  # first of their parameters' (see below)
            _first_of_their_hooks(handle)
        ran, self._input_grad_only_ran = self._input_grad_only_ran, set()
        hooked = [(p, h) for p, h in self._bk_param_hooks.values()
                  if p._backward_hooks is not None and len(p._backward_hooks) > 1]
        late = [p for p, _ in hooked if id(p) in ran and id(p) not in self._fallback]
        if late:
            raise ValueError(
                f"{', '.join(self._param_name(p) for p in late[:4])}: a gradient hook "
                "(register_hook) was registered on this parameter after the forward pass. In "
                "grad_sample_mode='bk' the layer's forward computed no gradient for it (bk adds "
                "the clipped per-sample sum at the end of the backward pass), so autograd would "
                "call the hook with None. Register the hook before the forward pass: the layer "
                "then lets autograd compute the batch gradient the hook sees, as the other modes "
                "do (what is released is the clipped sum either way)."
            )
        _last_of_their_tensors([h for _, h in hooked])

    def capture_activations_hook(
        self, module: nn.Module, forward_input, _forward_output, forward_kwargs: dict | None = None
    ) -> None:
        """Also refuses a call made during the backward pass (a reentrant checkpointed segment
        recomputed by its own inner backward) of a layer whose parameters another call of the
        pass already used: the parameter's path (one call, or factored calls with their cross
        terms) was chosen when the earlier calls' gradients arrived, without this one, and the
        clipped sum was wrong (hooks mode, which sums per-sample gradients, is exact)."""
        super().capture_activations_hook(module, forward_input, _forward_output, forward_kwargs)
        if torch._C._current_graph_task_id() == -1:
            return
        shared = [p for p in self.sampled_params(module) if self._call_counts.get(id(p), 0) > 1]
        if shared:
            raise ValueError(
                f"{', '.join(self._param_name(p) for p in shared[:4])}: used by several calls "
                "in one pass, one of them recomputed during the backward pass by activation "
                "checkpointing (torch.utils.checkpoint; with use_reentrant=False every "
                "checkpointed layer is called again). grad_sample_mode='bk' chooses each "
                "parameter's clipping path when its first call's gradient arrives, before the "
                "recomputed calls exist. Use grad_sample_mode='hooks' (exact with either kind "
                "of checkpointing) or 'ghost' with use_reentrant=False; in bk, checkpoint with "
                "use_reentrant=True only blocks whose parameters no other call uses."
            )

    def _on_accumulated(self, p: nn.Parameter, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``p`` (first of its post-accumulate hooks): records the
        ``p.grad`` that autograd's accumulation of bk's zeros made, if it is only that (the
        tensor of the pass start, modified once, or a new one never modified)."""
        start = self._grads_at_start.get(id(p))
        if start is None:
            return
        # several accumulations in one pass (a parameter shared by reentrant checkpointed
        # segments, each its own inner backward): each one from what the previous one left
        base = self._accumulated.get(id(p), start[1])
        if id(p) in self._accumulated and base is None:
            return  # already found written
        g = p.grad
        if g is None:
            ok = False
        elif g.is_sparse:  # a sparse sum is formed out of place
            ok = True
        elif base is None:
            ok = g._version == 0
        else:
            ok = id(g) == base[0] and g._version == base[1] + 1
        self._accumulated[id(p)] = (id(g), g._version) if ok else None

    def _check_grads_unwritten(self, reached: dict[int, nn.Parameter]) -> None:
        """``ValueError`` unless every ``p.grad`` is what the pass start left, plus autograd's
        accumulation of bk's zeros for the parameters bk's hook ``reached`` (checked right
        after it by :meth:`_on_accumulated`, which runs first among ``p``'s post-accumulate
        hooks), before the clipped sums are added to it. Anything else wrote to ``p.grad``
        during the backward pass (a ``register_post_accumulate_grad_hook``, a hook on an
        activation, a module's backward hook, a hook on the AccumulateGrad node, a parameter
        hook registered during the pass, which runs after bk's): it would be released with
        the clipped sum, unclipped. Tensor identities and version counters only: no host
        synchronisation."""
        starts, self._grads_at_start = self._grads_at_start, {}
        accumulated, self._accumulated = self._accumulated, {}
        written = []
        for i, (p, start) in starts.items():
            g = p.grad
            if i in reached:
                hooks = p._backward_hooks
                mine = self._bk_param_hooks.get(i)
                late = hooks and mine is not None and next(reversed(hooks)) != mine[1].id
                after = accumulated.get(i)
                if late or after is None or g is None or (id(g), g._version) != after:
                    written.append(p)
            elif start is None:
                if g is not None:
                    written.append(p)
            elif g is None or (id(g), g._version) != start:
                written.append(p)
        if written:
            raise ValueError(
                f"{', '.join(self._param_name(p) for p in written[:4])}: p.grad was written "
                "during the backward pass by something other than autograd's accumulation (a "
                "register_post_accumulate_grad_hook, a hook on an activation or on a module's "
                "backward, a gradient hook registered during the pass): in "
                "grad_sample_mode='bk' it would be released with the clipped per-sample sum, "
                "unclipped. Act on p.grad after loss.backward() instead, register gradient "
                "hooks before the forward pass, or use grad_sample_mode='hooks'."
            )

    def _drop_pass(self, pending: list[nn.Parameter]) -> None:
        """Ends a refused pass (a ``ValueError`` raised during its backward and caught): what it
        recorded (calls, norms, factors, call counts) is dropped too, or the next pass would add
        the refused batch's ``(A, G)``, scaled by the next batch's clip factors, to its clipped
        sums."""
        super()._drop_pass(pending)
        self._records = []
        self._reached = {}
        self._fallback = set()
        self._input_grad_only_ran = set()
        self._norm_sq = {}
        self._factors.clear()
        self._call_counts.clear()
        self._callers.clear()

    # ------------------------------------------------------------------ capture
    def _use_norm_sampler(self, module, activations, backprops) -> bool:
        if not self._norm_path(module, activations, backprops):
            return False
        # a clipped sum recomputed with nothing to check it against (the forward did not
        # expect this path, :meth:`_fingerprint_output`), or by a user's forward
        # (:func:`_library_forward`): instantiated from the activations
        return not (_recomputed(module) and (
            current_fingerprint(module) is None or not _library_forward(module)
        ))

    def _norm_path(self, module, activations, backprops) -> bool:
        """Whether this call's norms come from its rule's ``norm_sq`` (its clipped sum then
        from ``(A, G)`` at the end of the pass) rather than from its instantiated per-sample
        gradient (cost model below)."""
        if not super()._use_norm_sampler(module, activations, backprops):
            return False
        if not self._single_call(module):
            return True  # factored (tied) parameters: every call of the group takes this path
        if prefer_ghost(module, activations, backprops):
            return True
        # instantiation is cheaper: keep the per-sample gradient (it also gives the clipped sum
        # by one weighted sum) unless it is much larger than the (A, G) it replaces
        size = sum(p.numel() for p in self.sampled_params(module))
        kept = backprops.shape[0] * size
        replaced = backprops.numel() + sum(
            a.numel() for a in activations if isinstance(a, torch.Tensor)
        )
        return kept > self.KEEP_RATIO * replaced

    def _record_call(self, module, activations, backprops, kwargs, scale: float = 1.0) -> None:
        # the forward's fingerprint (set for the calls whose clipped sum may be a recompute)
        self._records.append(
            (module, activations, backprops, kwargs, scale, current_fingerprint(module))
        )

    def _fingerprint_output(self, module, activations, out, bdim) -> bool:
        """Whether this call's clipped sum may be formed by recomputing the layer's forward
        (:func:`_recomputed` and the norm path may be chosen for it in the backward pass): its
        output's fingerprint is then kept, for the recompute to be checked against. The norm
        path needs it (:meth:`_use_norm_sampler`), so the prediction may be generous, never
        short; other layers pay nothing."""
        rule = rule_for(module)
        if not _recomputed(module, rule):  # (a user's forward: its torch.func recompute)
            return False
        if bdim != 0 or derived(rule, "factors") is not None:
            return True  # batch-first inputs only below; a tied group may take the norm path
        return self._norm_path(module, activations, out)

    def _keep_instantiated(self) -> bool:
        return True

    # ------------------------------------------------------------------ clipped sums
    def _after_norms(self, norm_sq, rec) -> None:
        records, self._records = self._records, []
        reached, self._reached = self._reached, {}
        self._fallback = set()
        uncovered = [p for i, p in reached.items() if i not in rec.covered]
        if uncovered:
            for p, _ in norm_sq:
                if hasattr(p, "_current_grad_sample"):
                    del p._current_grad_sample
            raise ValueError(
                ", ".join(self._param_name(p) for p in uncovered)
                + " received a gradient in this backward pass but no hooked layer call used it "
                "(a parameter used outside its module's forward): it would not be clipped per "
                "sample. Call the module that owns it, or freeze it."
            )
        self._check_grads_unwritten(reached)
        contract = self.clipping
        if contract.per_layer:
            coef = {id(p): contract.param_factors(sq.sqrt(), p) for p, sq in norm_sq}
        else:
            flat = contract.flat_factors(self.per_sample_gradient_norms)
            coef = {id(p): flat for p, _ in norm_sq}
        b = self.per_sample_gradient_norms.shape[0]
        sums: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

        def add(p, g):
            prev = sums.get(id(p))
            sums[id(p)] = (p, g if prev is None else prev[1] + g)

        for p in [p for p, _ in norm_sq]:
            gs = getattr(p, "_current_grad_sample", None)
            if gs is not None:
                c = coef[id(p)][: gs.shape[0]].to(gs.dtype)
                add(p, weighted_sum(c, gs))
                del p._current_grad_sample
        # each call's (A, G) is dropped once its clipped sum is formed: the pass's peak memory
        # is then not all of them plus all the sums (the records are their only holders now)
        for i in range(len(records)):
            module, activations, backprops, kwargs, scale, fingerprint = records[i]
            records[i] = None
            for p, g in self._clipped_sum(
                module, activations, backprops, kwargs, coef, b, scale, fingerprint
            ).items():
                add(p, g)
            del activations, backprops
        self._write_clipped_sums(list(sums.values()))
        self.mark_clipped_pass(contract.snapshot())

    def _write_clipped_sums(self, sums: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Adds each clipped sum ``g`` (``p``'s shape, ``Σ_b c_b ∇_p loss_b`` over this pass's
        samples) to ``p.grad``, as autograd accumulates (FSDP overrides this: the sums are
        reduce-scattered into the sharded parameters)."""
        for p, g in sums:
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            if g.shape != p.shape:
                g = g.view_as(p)
            if p.grad is None:
                p.grad = g
            elif p.grad.is_sparse:  # the zeros of a sparse layer's autograd gradient
                p.grad = g + p.grad
            else:  # in place, as autograd accumulates: no second parameter-sized tensor
                p.grad.add_(g)

    def _clipped_sum(self, module, activations, backprops, kwargs, coef, b, scale=1.0,
                     fingerprint=None) -> dict:
        """``{p: Σ_b c_b ∇_p loss_b}`` of one recorded call (per-sample gradients ``scale``
        times those of ``(A, G)``): the rule's ``weighted_clipped_sum``, else its
        ``clipped_sum`` of ``(A, c ⊙ G)``, else one vector-Jacobian product of ``c ⊙ G`` with
        a recompute of the layer's forward, checked against the forward's ``fingerprint``
        and under :func:`~.recompute_state.recompute_guard` (``ValueError`` if the forward
        depends on state)."""
        params = self.sampled_params(module)
        groups: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        for p in params:  # parameters sharing a factor tensor are summed in one call
            c = coef.get(id(p))
            if c is None:
                continue
            for gc, ps in groups:
                if gc is c:
                    ps.append(p)
                    break
            else:
                groups.append((c, [p]))
        out = {}
        rule = rule_for(module)
        fn = rule.clipped_sum if rule is not None else None
        weighted = derived(rule, "weighted_clipped_sum")
        for c, ps in groups:
            c = c[: backprops.shape[0]].to(backprops.dtype)
            if scale != 1.0:
                c = c * scale
            if weighted is not None:
                res = weighted(module, activations, backprops, c)
            elif fn is not None:
                res = fn(module, activations, rows_scaled(backprops, c))
            else:
                label = f"{self.module_name(module)} ({type(module).__name__})"
                if fingerprint is None:  # _use_norm_sampler takes this path only with one
                    raise ValueError(
                        f"{label}: internal error, its clipped sum would be recomputed without "
                        "the forward's fingerprint to check it against. Please report it; "
                        "grad_sample_mode='hooks' computes this layer's per-sample gradients "
                        "from its activations."
                    )
                self._in_functorch = True
                try:
                    with recompute_guard(module, label, batched=True):
                        res = generic_clipped_sum(
                            module, activations, rows_scaled(backprops, c), kwargs,
                            batch_first=module_batch_first(module, self.batch_first),
                            params=self._sampled.get(id(module)),
                            fingerprint=fingerprint, label=label,
                        )
                finally:
                    self._in_functorch = False
            for p in ps:
                if p in res:
                    out[p] = res[p]
        return out


class GradSampleHooksBookKeeping(GradSampleModuleBookKeeping):
    """In-place form of :class:`GradSampleModuleBookKeeping` (``wrap_model=False``): hooks on
    ``m`` itself, which the user keeps calling."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        self.attach_to_module()

