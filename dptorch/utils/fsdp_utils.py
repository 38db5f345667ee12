"""FSDP2 (``torch.distributed.fsdp.fully_shard``) helpers for the ``ghost_fsdp`` / ``bk_fsdp``
modes: recognising FSDP-wrapped modules and their generated classes, checking that every
trainable parameter is a sharded ``DTensor``, forcing gradient reduction to a plain sum, and
moving full-size tensors into a parameter's sharding.

What FSDP2 does that matters here (torch >= 2.6):

* ``fully_shard(m)`` changes ``m``'s class to a generated ``FSDP<Cls>(FSDPModule, Cls)`` that
  defines no ``forward`` of its own, and replaces every managed parameter by a ``DTensor``
  sharded on a 1-D device mesh (the *sharded* parameter, what ``model.parameters()`` and the
  optimizer see between steps).
* around each unit's forward and backward the parameters are all-gathered into plain
  *unsharded* parameters (persistent ``nn.Parameter`` objects whose storage is freed between
  uses), which FSDP sets on the modules in place of the sharded ones: autograd differentiates
  those.
* after the backward pass it reduce-scatters the unsharded gradients into ``sharded.grad``,
  dividing by the world size unless told otherwise (:func:`use_sum_reduction`).

Only torch is imported here (``dptorch.utils`` sits below the rest of the package).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "FSDP2Wrapper",
    "FSDPModule",
    "dtensor_class",
    "fsdp_available",
    "fsdp_original_class",
    "fsdp_units",
    "has_params",
    "is_fsdp_model",
    "iterate_submodules",
    "reduce_scatter_sum",
    "refuse_fsdp_model",
    "scatter_from_rank0",
    "sharding_problem",
    "use_sum_reduction",
]

try:  # torch.distributed may be absent from a build
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
except ImportError:  # pragma: no cover - torch without distributed support
    FSDPModule = None  # type: ignore[assignment,misc]
    DTensor = Partial = Shard = distribute_tensor = None  # type: ignore[assignment,misc]


def fsdp_available() -> bool:
    """Whether this torch build has FSDP2 and ``DTensor``."""
    return FSDPModule is not None


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` (``None`` without distributed support)."""
    return DTensor


def _generated_classes() -> set[type]:
    """The classes ``fully_shard`` generated so far (its own registry, where torch exposes it)."""
    try:
        from torch.distributed.fsdp._fully_shard._fully_shard import get_cls_to_fsdp_cls
    except ImportError:  # pragma: no cover - older torch: structural check only
        return set()
    return set(get_cls_to_fsdp_cls().values())


def fsdp_original_class(t: type) -> type | None:
    """The class ``fully_shard`` wrapped when ``t`` is the class it generated for it
    (``FSDPLinear`` -> ``nn.Linear``), else ``None``.

    Only the generated class itself qualifies: bases exactly ``(FSDPModule, Cls)``, named
    ``"FSDP" + Cls.__name__``, no ``forward`` of its own (and, where torch exposes its registry,
    registered there). A user class deriving from a layer, or from ``FSDPModule``, with a
    ``forward`` of its own is not unwrapped, so the exact-type semantics of the layer rules hold.
    """
    if FSDPModule is None or not isinstance(t, type) or len(t.__bases__) != 2:
        return None
    marker, base = t.__bases__
    if marker is not FSDPModule or t.__name__ != f"FSDP{base.__name__}":
        return None
    if "forward" in t.__dict__:
        return None
    generated = _generated_classes()
    if generated and t not in generated:
        return None
    return base


def is_fsdp_model(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules was passed to ``fully_shard``."""
    if FSDPModule is None or not isinstance(module, nn.Module):
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def fsdp_units(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of every FSDP unit (module passed to ``fully_shard``) in ``module``."""
    if FSDPModule is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            yield name, m


def use_sum_reduction(module: nn.Module) -> None:
    """Makes every FSDP unit of ``module`` reduce-scatter gradients as a plain **sum** over the
    ranks (divide factor 1, sum-only collectives), instead of FSDP's default mean.

    The DP optimizers divide the released gradient themselves (by the expected batch size and
    the world size), so FSDP's own averaging must not happen. Idempotent."""
    for _, unit in fsdp_units(module):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def sharding_problem(p: torch.Tensor) -> str | None:
    """Why the trainable parameter ``p`` cannot be trained by the FSDP DP modes (``None`` when
    it can): it must be a ``DTensor`` on a 1-D device mesh with one ``Shard`` placement, so that
    each coordinate lives on exactly one rank (noise is then added to it exactly once)."""
    if DTensor is None or not isinstance(p, DTensor):
        return (
            "it is a plain tensor, not managed by fully_shard (every rank holds a copy, "
            "which FSDP neither shards nor reduces)"
        )
    if p.device_mesh.ndim != 1 or len(p.placements) != 1:
        return (
            f"it is sharded on a {p.device_mesh.ndim}-D device mesh with placements "
            f"{tuple(p.placements)} (HSDP or tensor parallelism replicate coordinates across "
            "ranks); only a 1-D mesh is supported"
        )
    if not isinstance(p.placements[0], Shard) or type(p.placements[0]) is not Shard:
        return f"its placement is {p.placements[0]!r}, not a plain Shard(dim)"
    return None


def reduce_scatter_sum(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sums ``full`` (this rank's full-size tensor, shaped like the unsharded parameter ``like``
    is a shard of) over the ranks and returns this rank's shard of the sum as a ``DTensor``
    with ``like``'s mesh and placements (one reduce-scatter). Every rank must call it for the
    same parameters in the same order."""
    mesh = like.device_mesh
    partial = DTensor.from_local(
        full.contiguous(), mesh, [Partial("sum")], run_check=False, shape=like.shape,
        stride=like.stride(),
    )
    return partial.redistribute(mesh, like.placements)


def scatter_from_rank0(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``full`` (shaped like the unsharded parameter of which ``like`` is a shard),
    split into ``like``'s sharding: each rank gets its own slice as a ``DTensor`` (one scatter;
    the other ranks' ``full`` is only a shape and is ignored)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=0)


def refuse_fsdp_model(module: nn.Module, mode: str) -> None:
    """Raises ``ValueError`` when ``module`` is sharded by FSDP2 but ``grad_sample_mode=mode``
    is not an FSDP mode: the per-sample state and gradient reduction of the other modes assume
    unsharded parameters, which FSDP swaps during every pass, so gradients could be released
    without per-sample clipping."""
    if not is_fsdp_model(module):
        return
    fix = {"ghost": "'ghost_fsdp'", "bk": "'bk_fsdp'"}.get(mode, "'bk_fsdp' (recommended) or 'ghost_fsdp'")
    raise ValueError(
        f"{type(module).__name__} is sharded by FSDP2 (fully_shard), which grad_sample_mode="
        f"{mode!r} does not support: its per-sample state and gradient reduction assume "
        "unsharded parameters, so gradients could be released without per-sample clipping. "
        f"Fix: use grad_sample_mode={fix}."
    )


def has_params(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters of its own (its submodules' not counted)."""
    return next(iter(module.parameters(recurse=False)), None) is not None


def iterate_submodules(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules that hold parameters of their own, in pre-order."""
    if has_params(module):
        yield module
    for child in module.children():
        yield from iterate_submodules(child)


def FSDP2Wrapper(model: nn.Module, **kwargs) -> nn.Module:  # noqa: N802  (Opacus's name)
    """Shards ``model`` with FSDP2 for ``grad_sample_mode="ghost_fsdp"`` / ``"bk_fsdp"`` (as
    Opacus's function of this name): ``fully_shard`` on every submodule that holds parameters
    of its own (one FSDP unit per layer, so that only one layer is all-gathered at a time), then
    on ``model`` itself; returns ``model`` (its class is now FSDP's generated one).

    Keyword arguments: ``mp_policy`` (a ``MixedPrecisionPolicy``, default: none), and
    ``opacus_high_precision_layers`` (a tuple or list of layer classes whose units keep
    ``torch.get_default_dtype()`` parameters whatever ``mp_policy`` says).

    Opacus leaves a layer with trainable parameters but no per-sample rule in the root unit;
    ``dptorch.utils`` cannot consult the rule registry, so such a layer gets a unit of its
    own here (what is computed is the same; only the all-gather grouping differs)."""
    if not fsdp_available():
        raise RuntimeError("FSDP2Wrapper needs torch.distributed with FSDP2 (torch >= 2.6).")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = kwargs.get("mp_policy", MixedPrecisionPolicy())
    high = tuple(kwargs.get("opacus_high_precision_layers", ()) or ())
    for module in list(iterate_submodules(model)):
        if module is model:
            continue
        if high and isinstance(module, high):
            policy = MixedPrecisionPolicy(param_dtype=torch.get_default_dtype())
            fully_shard(module, mp_policy=policy)
        else:
            fully_shard(module, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)
