"""Book-keeping clipping under FSDP2 (``grad_sample_mode="bk_fsdp"``): one backward pass.

As in :class:`~dptorch.grad_sample.GradSampleModuleBookKeeping`, each rank records, for every
hooked call, the inputs ``A`` and output gradient ``G`` of its own samples (or the instantiated
per-sample gradient) and the squared per-sample norms; autograd computes no weight gradient for
the hooked layers. At the end of the backward pass (an autograd-engine callback that runs after
FSDP's own end-of-backward callback, so the unsharded parameters are freed by then) the clip
factors are known and each parameter's clipped sum ``Σ_b c_b ∇_p loss_b`` is formed in the
parameter's full shape; one reduce-scatter (a sum over the ranks, every trainable parameter in
a fixed order on every rank) adds this rank's shard of ``Σ_ranks`` of them to the sharded
``p.grad``.

FSDP specifics (see also :mod:`~dptorch.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp`):

* the clipped sum of a layer is formed from its rule's ``clipped_sum`` (which needs ``A`` and
  ``G`` only). A layer whose rule has none (or a parameter used by several calls) has its
  per-sample gradient instantiated during the backward pass, while FSDP still holds the
  unsharded parameter, and the clipped sum is a weighted sum of it;
* the tensor hooks that zero autograd's own gradient of the remaining parameters (normalisation
  layers...) are put on the unsharded parameters when FSDP first creates them; FSDP then
  reduce-scatters those zeros, and the clipped sums are added on top.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..clipping import ClippingContract
from ..utils.fsdp_utils import reduce_scatter_sum
from .grad_sample_module_bk import GradSampleModuleBookKeeping
from .grad_sample_module_fast_gradient_clipping_fsdp import FSDPParamsMixin, _fsdp_init
from .gsm_base import weak_method
from .registry import rule_for

__all__ = ["GradSampleHooksBookKeepingFSDP", "GradSampleModuleBookKeepingFSDP"]


def _set_parameter(module: nn.Module, name: str, p: nn.Parameter) -> None:
    """Sets ``module``'s parameter ``name`` (dotted) to ``p`` without any module hook."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    owner._parameters[leaf] = p


class GradSampleModuleBookKeepingFSDP(FSDPParamsMixin, GradSampleModuleBookKeeping):
    """Book-keeping (one backward pass) DP clipping for a model sharded with FSDP2's
    ``fully_shard`` (``grad_sample_mode="bk_fsdp"``).

    Args: as :class:`GradSampleModuleBookKeeping`, flat clipping only. ``m`` must already be
    sharded (every trainable parameter a ``DTensor``).

    After ``loss.backward()``, ``p.grad`` of every (sharded) parameter holds, on top of its
    previous value, this rank's shard of ``Σ_ranks Σ_b c_b ∇_p loss_b``: the sum over every
    rank's samples of the clipped per-sample gradients.
    """

    mode_name = "bk_fsdp"

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        max_grad_norm: float = 1,
        use_ghost_clipping: bool = True,
        clipping: ClippingContract | None = None,
    ):
        self._hooked_unsharded: set[int] = set()
        _fsdp_init(
            self,
            m,
            GradSampleModuleBookKeeping.__init__,
            dict(
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                strict=strict,
                force_functorch=force_functorch,
                max_grad_norm=max_grad_norm,
                use_ghost_clipping=use_ghost_clipping,
                clipping=clipping,
            ),
        )

    # ------------------------------------------------------------------ autograd's gradients
    def _install_bk(self) -> None:
        super()._install_bk()
        self._hooked_unsharded = {
            id(p) for m in self.iterate_submodules(self._module) for p in self.sampled_params(m)
        }

    def _on_new_unsharded(self, module: nn.Module, sharded: nn.Parameter, unsharded) -> None:
        """The gradient hook of ``sharded`` goes on its unsharded object, which autograd
        differentiates (the sharded one never gets an autograd gradient)."""
        if id(unsharded) in self._hooked_unsharded:
            return
        self._hooked_unsharded.add(id(unsharded))
        # weakly, as bk's hooks on the parameters: once autograd's nodes own the unsharded
        # parameter (a tensor computed from it kept on the model), the collector does not see
        # its hooks, and parameter -> hook -> this object -> module -> kept tensor -> parameter
        # would be a cycle that is never freed
        handle = unsharded.register_hook(weak_method(self._on_autograd_grad, unsharded))
        self._bk_handles.append(handle)
        self._bk_param_hooks[id(unsharded)] = (unsharded, handle)
        if id(sharded) in self._no_autograd:
            self._no_autograd.add(id(unsharded))

    # ------------------------------------------------------------------ capture
    def _use_norm_sampler(self, module, activations, backprops) -> bool:
        """The clipped sum is formed after FSDP freed the unsharded parameters: only a layer
        whose rule forms it from ``(A, G)`` alone, used by one call, keeps ``(A, G)``; any other
        is instantiated now, while its parameters are gathered."""
        rule = rule_for(module)
        if rule is None or rule.clipped_sum is None or not self._single_call(module):
            return False
        return super()._use_norm_sampler(module, activations, backprops)

    def _fingerprint_output(self, module, activations, out, bdim) -> bool:
        """No clipped sum is recomputed here (:meth:`_use_norm_sampler`): nothing to check."""
        return False

    # ------------------------------------------------------------------ clipped sums
    @contextlib.contextmanager
    def _unsharded_on(self, module: nn.Module) -> Iterator[None]:
        """``module`` holds its unsharded parameter objects for the block (their storage may
        be freed: only their identity and shape are used), so that its rule's results are keyed
        like the rest of the pass."""
        swapped = []
        for name, sharded in self._sampled.raw(id(module)):
            u = self._unsharded.get(id(sharded))
            cur = module.get_parameter(name)
            if u is not None and cur is not u:
                _set_parameter(module, name, u)
                swapped.append((name, cur))
        try:
            yield
        finally:
            for name, cur in swapped:
                _set_parameter(module, name, cur)

    def _clipped_sum(self, module, activations, backprops, kwargs, coef, b, scale=1.0,
                     fingerprint=None) -> dict:
        with self._unsharded_on(module):
            return super()._clipped_sum(
                module, activations, backprops, kwargs, coef, b, scale, fingerprint
            )

    def _check_grads_unwritten(self, reached) -> None:
        """Not checked under FSDP: the hooked parameters are the unsharded ones, whose
        gradients FSDP itself moves during the pass (the sharded parameters' gradients are
        written by :meth:`_write_clipped_sums`)."""
        self._grads_at_start = {}

    def _write_clipped_sums(self, sums: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """One reduce-scatter (sum over the ranks) per trainable parameter, in the same order on
        every rank (zeros where this rank's samples did not reach it); this rank's shard of the
        sum is added to the sharded ``p.grad``."""
        local = {id(self._as_sharded(p)): g for p, g in sums}
        for p in self._sharded_params:
            g = local.get(id(p))
            full = torch.zeros(p.shape, dtype=p.dtype, device=p.device) if g is None else (
                g.to(p.dtype).reshape(p.shape)
            )
            shard = reduce_scatter_sum(full, p)
            if p.grad is None:
                p.grad = shard
            else:
                p.grad.add_(shard)


class GradSampleHooksBookKeepingFSDP(GradSampleModuleBookKeepingFSDP):
    """In-place form of :class:`GradSampleModuleBookKeepingFSDP` (``wrap_model=False``): hooks
    on ``m`` itself, which the user keeps calling."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        self.attach_to_module()
