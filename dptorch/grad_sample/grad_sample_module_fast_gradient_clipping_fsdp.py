"""Ghost clipping under FSDP2 (``grad_sample_mode="ghost_fsdp"``), and the FSDP machinery that
book-keeping (``"bk_fsdp"``, :mod:`dptorch.grad_sample.grad_sample_module_bk_fsdp`) shares.

The model is passed to ``torch.distributed.fsdp.fully_shard`` first (every trainable parameter
must end up a ``DTensor`` sharded on a 1-D mesh). Each rank then computes the per-sample norms
of its own samples from the activations and output gradients its hooks see (both local), and
clips them; the clipped sums of the ranks are added by FSDP's reduce-scatter, which
:func:`~dptorch.utils.fsdp_utils.use_sum_reduction` turns into a plain sum (FSDP averages by
default): after ``loss.backward()`` every rank holds its shard of ``Σ_ranks Σ_b c_b g_b``.
:class:`~dptorch.optimizers.FSDPOptimizerFastGradientClipping` adds the noise, once per
coordinate, and divides.

FSDP swaps parameter objects. Between steps a module holds the *sharded* parameter (what the
optimizer and ``model.parameters()`` see); while a unit runs forward or backward it holds the
*unsharded* one, a persistent ``nn.Parameter`` that autograd differentiates and the layer rules
see. :class:`FSDPParamsMixin` keeps the two apart: a forward pre-hook on every FSDP unit (run
after FSDP's all-gather) records ``sharded -> unsharded`` for the parameters the unit holds,
the per-pass state (call counts, norms, coverage) is keyed by the unsharded parameter, and what
leaves the pass (coverage for the optimizer, ``p._norm_sample``) is mapped back to the sharded
one.

Not supported, refused with ``ValueError`` naming the parameter or module and the fix:
trainable parameters not sharded by ``fully_shard`` (plain tensors, HSDP / 2-D meshes,
non-``Shard`` placements), a parameter shared by modules of different FSDP units, per-layer
clipping (``ghost``: never; ``bk_fsdp``: not implemented).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..clipping import ClippingContract
from ..utils.fsdp_utils import (
    fsdp_available,
    fsdp_units,
    is_fsdp_model,
    sharding_problem,
    use_sum_reduction,
)
from .grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
from .step_record import PassRecord, register_record
from .unit_params import trainable_signature

__all__ = [
    "FSDPParamsMixin",
    "GradSampleHooksFastGradientClippingFSDP",
    "GradSampleModuleFastGradientClippingFSDP",
    "check_fsdp_model",
]


def check_fsdp_model(module: nn.Module, mode: str) -> None:
    """Raises ``ValueError`` unless ``module`` can be trained with the FSDP mode ``mode``: it was
    passed to ``fully_shard`` (itself or its submodules), every trainable parameter is a
    ``DTensor`` with one ``Shard`` placement on a 1-D mesh, and no trainable parameter is held
    by modules of two different FSDP units."""
    if not fsdp_available():
        raise ValueError(
            f"grad_sample_mode={mode!r} needs torch.distributed with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), which this torch build lacks."
        )
    if not is_fsdp_model(module):
        raise ValueError(
            f"grad_sample_mode={mode!r} trains a model sharded by FSDP2, but no module of "
            f"{type(module).__name__} was passed to torch.distributed.fsdp.fully_shard. Fix: "
            "call fully_shard on the layers and on the root module first, or use "
            f"grad_sample_mode={mode.removesuffix('_fsdp')!r} for a model that is not sharded."
        )
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        why = sharding_problem(p)
        if why is not None:
            raise ValueError(
                f"Parameter {name}: {why}. grad_sample_mode={mode!r} adds the noise to each "
                "rank's shard, so every trainable parameter must be sharded by fully_shard, each "
                "coordinate on exactly one rank. Fix: call fully_shard on the root module (it "
                "shards every parameter not in a sub-unit), on a 1-D device mesh, or freeze the "
                "parameter."
            )
    owner: dict[int, tuple[str, str]] = {}
    units = sorted(fsdp_units(module), key=lambda u: -len(u[0]))  # innermost first
    for path, m in module.named_modules():
        unit = next((u for u, um in units if path == u or path.startswith(u + ".") or u == ""),
                    None)
        for pname, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            prev = owner.setdefault(id(p), (f"{path}.{pname}" if path else pname, unit))
            if prev[1] != unit:
                units_text = f"{prev[1] or '<root>'!r} and {unit or '<root>'!r}"
                raise ValueError(
                    f"Parameter {prev[0]} is shared by modules of two FSDP units ({units_text}): "
                    "FSDP all-gathers and reduces each "
                    "unit's parameters separately, so its per-sample gradients would be split. "
                    "Fix: put every module that uses it in one unit (call fully_shard on their "
                    "common parent only)."
                )


class _CanonicalSampled(dict):
    """``{id(module): [(name, p)]}`` (what ``sampled_parameters`` returns, built from the sharded
    parameters) whose lookups give each parameter's canonical object: the unsharded parameter
    once FSDP has created it, else the sharded one."""

    def __init__(self, raw: dict, canonical):
        super().__init__(raw)
        self._canonical = canonical

    def __getitem__(self, key):
        return [(n, self._canonical(p)) for n, p in super().__getitem__(key)]

    def get(self, key, default=None):
        return self[key] if key in self else default

    def raw(self, key) -> list:
        """The entries of ``key`` with the sharded parameters."""
        return dict.get(self, key, [])


class FSDPParamsMixin:
    """What every FSDP grad-sample module does about FSDP2 (see the module docstring); to be
    placed before a :class:`GradSampleModuleFastGradientClipping` subclass in the bases."""

    #: the grad_sample_mode name, for messages
    mode_name = "ghost_fsdp"
    supports_fsdp = True

    def _fsdp_state_init(self) -> None:
        """Attributes set before the base constructor (which installs the hooks)."""
        self._unsharded: dict[int, nn.Parameter] = {}  # id(sharded) -> unsharded
        self._sharded_of: dict[int, nn.Parameter] = {}  # id(unsharded) -> sharded
        self._unit_handles: list = []
        self._sharded_params: list[nn.Parameter] = []
        self._sharded_signature: tuple[int, ...] = ()

    def _fsdp_attach(self) -> None:
        """After the base constructor: sum reduction and the unit pre-hooks."""
        use_sum_reduction(self._module)
        for _, unit in fsdp_units(self._module):
            self._unit_handles.append(unit.register_forward_pre_hook(self._on_unit_forward))

    # ------------------------------------------------------------------ sharded <-> unsharded
    def _canonical(self, p: nn.Parameter) -> nn.Parameter:
        return self._unsharded.get(id(p), p)

    def _as_sharded(self, p: nn.Parameter) -> nn.Parameter:
        return self._sharded_of.get(id(p), p)

    def _on_unit_forward(self, unit: nn.Module, _args) -> None:
        """Forward pre-hook of an FSDP unit, after FSDP's own (which all-gathered the unit):
        records the unsharded parameter of every sampled parameter the unit now holds, and
        makes it visible to the use trace of this forward pass."""
        use_sum_reduction(unit)  # FSDP's averaging stays off, whatever was set since
        trace = getattr(self, "_trace", None)
        for m in unit.modules():
            for name, sharded in self._sampled.raw(id(m)):
                try:
                    cur = m.get_parameter(name)
                except AttributeError:
                    continue
                if cur is sharded:
                    continue  # a nested unit, not gathered yet
                if self._unsharded.get(id(sharded)) is not cur:
                    self._unsharded[id(sharded)] = cur
                    self._sharded_of[id(cur)] = sharded
                    self._on_new_unsharded(m, sharded, cur)
                if trace is not None:
                    path = self._module_names.get(id(m), "<root>")
                    trace.params[id(cur)] = (name if path == "<root>" else f"{path}.{name}", cur)

    def _on_new_unsharded(self, module: nn.Module, sharded: nn.Parameter, unsharded) -> None:
        """Called when a parameter's unsharded object is first seen (book-keeping hooks it)."""

    # ------------------------------------------------------------------ base class overrides
    def add_hooks(self, **kwargs) -> None:
        super().add_hooks(**kwargs)
        raw = {k: [(n, self._as_sharded(p)) for n, p in v] for k, v in self._sampled.items()}
        self._sampled = _CanonicalSampled(raw, self._canonical)
        self._sharded_params = [
            self._as_sharded(p) for p in self._module.parameters() if p.requires_grad
        ]
        self._sharded_signature = tuple(id(p) for p in self._sharded_params)
        register_record(self._sharded_params, self.record)

    def _refresh_units(self) -> None:
        """FSDP keeps the root unit's parameters unsharded after a forward pass that has no
        backward pass: a changed signature made only of that swap is no change."""
        now = tuple(
            id(self._as_sharded(p)) for p in self._module.parameters() if p.requires_grad
        )
        if now == self._sharded_signature:
            self._trainable_signature = trainable_signature(self._module)
            return
        super()._refresh_units()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The trainable (sharded) parameters, whatever FSDP holds on the modules now."""
        return [self._as_sharded(p) for p in super().trainable_parameters()]

    def _start_trace(self, args, kwargs) -> None:
        super()._start_trace(args, kwargs)
        # the forward pass uses the unsharded parameters: the unit pre-hooks add them
        self._trace.params = {}

    def _take_pass(self) -> PassRecord:
        rec = super()._take_pass()
        rec.covered |= {id(self._sharded_of[i]) for i in list(rec.covered) if i in self._sharded_of}
        return rec

    def _publish_norms(self, norm_sq, b) -> None:
        super()._publish_norms([(self._as_sharded(p), sq) for p, sq in norm_sq], b)

    def _check_contract(self, clipping: ClippingContract) -> None:
        if clipping.per_layer:
            raise ValueError(
                f"Per-layer clipping (a list of max_grad_norm) is not supported with "
                f"grad_sample_mode={self.mode_name!r}. Fix: use one max_grad_norm (flat "
                "clipping), or a model that is not sharded with grad_sample_mode='bk'."
            )

    def cleanup(self) -> None:
        for h in self._unit_handles:
            h.remove()
        self._unit_handles = []
        super().cleanup()


def _fsdp_init(self, m: nn.Module, base_init, kwargs: dict) -> None:
    """The constructor shared by the FSDP grad-sample modules."""
    check_fsdp_model(m, type(self).mode_name)
    self._fsdp_state_init()
    base_init(self, m, **kwargs)
    self._fsdp_attach()


class GradSampleModuleFastGradientClippingFSDP(
    FSDPParamsMixin, GradSampleModuleFastGradientClipping
):
    """Ghost clipping for a model sharded with FSDP2's ``fully_shard``
    (``grad_sample_mode="ghost_fsdp"``; Opacus 1.6 name).

    Args: as :class:`GradSampleModuleFastGradientClipping` (flat clipping only). ``m`` must
    already be sharded: every trainable parameter a ``DTensor`` (``fully_shard`` on the layers
    and on the root).

    After ``loss.backward()`` of the loss wrapper, ``p.grad`` of every (sharded) parameter holds
    this rank's shard of ``Σ_ranks Σ_b c_b ∇_p loss_b``, the sum over every rank's samples of
    the clipped per-sample gradients (FSDP's reduce-scatter is made a sum), and
    ``per_sample_gradient_norms`` the norms ``(B_local,)`` of this rank's samples.
    """

    mode_name = "ghost_fsdp"

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
        _fsdp_init(
            self,
            m,
            GradSampleModuleFastGradientClipping.__init__,
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


class GradSampleHooksFastGradientClippingFSDP(GradSampleModuleFastGradientClippingFSDP):
    """In-place form of :class:`GradSampleModuleFastGradientClippingFSDP` (``wrap_model=False``;
    Opacus 1.6 name): hooks on ``m`` itself, which the user keeps calling."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        self.attach_to_module()
