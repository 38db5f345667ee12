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
"""

from __future__ import annotations

import inspect
import logging
from functools import partial

import torch
from torch import nn

from .functorch import module_batch_first
from .grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
from .gsm_base import weak_method
from .norm_samplers import generic_clipped_sum, rows_scaled
from .registry import derived, input_grad_only_forward, prefer_ghost, rule_for

logger = logging.getLogger(__name__)


def weighted_sum(c: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """``Σ_b c_b gs_b``: the clipped sum of an instantiated per-sample gradient ``(B, ...)``."""
    return torch.tensordot(c, gs, dims=1)


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
        self._bk_overridden: list[nn.Module] = []
        self._no_autograd: set[int] = set()
        self._fallback: set[int] = set()
        self._reached: dict[int, nn.Parameter] = {}
        super().__init__(m, **kwargs)
        self._keep_output_edges = False  # no norm pass: one ordinary backward
        self._records: list[tuple[nn.Module, list, torch.Tensor, dict | None, float]] = []
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
                module.forward = partial(
                    self._bk_forward, module, fn, n_inputs, type(module).forward
                )
                self._bk_overridden.append(module)
                self._no_autograd |= {id(p) for p in params}
            else:
                plain |= {id(p) for p in params}
            for p in params:
                # weakly (a parameter's hook holding this object, which holds the module, which
                # holds the parameter: a cycle the garbage collector does not see)
                self._bk_handles.append(p.register_hook(weak_method(self._on_autograd_grad, p)))
        # a parameter tied between the two kinds (an Embedding subclass with a forward of its
        # own and a Linear head) gets autograd's gradient from the first: that one is expected
        self._no_autograd -= plain

    def _remove_bk(self) -> None:
        for h in self._bk_handles:
            h.remove()
        self._bk_handles = []
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
        exactly the ``n_inputs`` positional inputs ``fn`` takes; otherwise the original forward,
        whose parameter gradients the tensor hooks then zero (the layer is marked fallback)."""
        if self._active() and self.forward_hooks_enabled and module.training and torch.is_grad_enabled():
            if not kwargs and len(args) == n_inputs:
                return fn(module, *args)
            self._fallback |= {id(p) for p in self.sampled_params(module)}
        return original(module, *args, **kwargs)

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
        return torch.zeros_like(grad)

    def _on_pass_start(self) -> None:
        if self.hooks_enabled and self.backward_hooks_enabled:
            self.check_grads_untouched()

    # ------------------------------------------------------------------ capture
    def _use_norm_sampler(self, module, activations, backprops) -> bool:
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
        self._records.append((module, activations, backprops, kwargs, scale))

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
        for module, activations, backprops, kwargs, scale in records:
            for p, g in self._clipped_sum(
                module, activations, backprops, kwargs, coef, b, scale
            ).items():
                add(p, g)
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
            else:  # in place, as autograd accumulates: no second parameter-sized tensor
                p.grad.add_(g)

    def _clipped_sum(self, module, activations, backprops, kwargs, coef, b, scale=1.0) -> dict:
        """``{p: Σ_b c_b ∇_p loss_b}`` of one recorded call (per-sample gradients ``scale``
        times those of ``(A, G)``): the rule's ``weighted_clipped_sum``, else its
        ``clipped_sum`` of ``(A, c ⊙ G)``."""
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
                self._in_functorch = True
                try:
                    res = generic_clipped_sum(
                        module, activations, rows_scaled(backprops, c), kwargs,
                        batch_first=module_batch_first(module, self.batch_first),
                        params=self._sampled.get(id(module)),
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

