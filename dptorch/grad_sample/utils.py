"""The built-in ``grad_sample_mode`` modules, and building the GradSampleModule of a mode.

The modes themselves live in :mod:`dptorch.modes`; this module registers the module side of
the built-in ones and keeps the Opacus names (:func:`get_gsm_class`, :func:`wrap_model`,
:func:`prepare_module`) and dptorch's :func:`register_grad_sample_mode` / ``GSM_CLASSES`` as
views on that registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from torch import nn

from ..modes import Mode, get_mode, known_modes, register_mode
from ..utils.fsdp_utils import refuse_fsdp_model
from .grad_sample_module import GradSampleHooks, GradSampleModule
from .grad_sample_module_bk import GradSampleHooksBookKeeping, GradSampleModuleBookKeeping
from .grad_sample_module_bk_fsdp import (
    GradSampleHooksBookKeepingFSDP,
    GradSampleModuleBookKeepingFSDP,
)
from .grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from .grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
    GradSampleModuleFastGradientClippingFSDP,
    check_fsdp_model,
)
from .gsm_base import AbstractGradSampleModule, check_not_wrapped
from .gsm_exp_weights import GradSampleModuleExpandedWeights, check_ew_model
from .gsm_no_op import GradSampleHooksNoOp, GradSampleModuleNoOp
from .registry import register_grad_sampler, register_norm_sampler


def _not_fsdp(mode: str):
    """The mode check refusing a model sharded by FSDP2 (``fully_shard``) for ``mode``."""

    def check(module: nn.Module, **_settings) -> None:
        refuse_fsdp_model(module, mode)

    check.__name__ = f"check_not_fsdp_{mode}"
    return check


def _fsdp_only(mode: str):
    """The mode check of an FSDP mode: a model sharded by ``fully_shard``
    (:func:`check_fsdp_model`), flat clipping."""

    def check(module: nn.Module, *, clipping: str, **_settings) -> None:
        if clipping != "flat":
            raise ValueError(
                f"clipping={clipping!r} is not supported with grad_sample_mode={mode!r}: the "
                "FSDP modes clip each sample's whole gradient with one max_grad_norm (per-layer "
                "and adaptive clipping are not implemented for sharded parameters). Fix: "
                "clipping='flat'."
            )
        check_fsdp_model(module, mode)

    check.__name__ = f"check_fsdp_{mode}"
    return check


# hooks and functorch keep one per-sample gradient slice per backward pass (multi_pass=True);
# adaptive clipping's clip-count noise assumes one clipped unit per record
_SLICED = ("flat", "per_layer")
for _mode in (
    Mode("hooks", GradSampleModule, multi_pass_clippings=_SLICED, checks=(_not_fsdp("hooks"),)),
    Mode(
        "functorch",
        GradSampleModule,
        multi_pass_clippings=_SLICED,
        gsm_kwargs={"force_functorch": True},
        checks=(_not_fsdp("functorch"),),
    ),
    # refused before make_private modifies anything: layers ExpandedWeights cannot differentiate
    Mode("ew", GradSampleModuleExpandedWeights, checks=(_not_fsdp("ew"), check_ew_model)),
    # p.grad_sample is filled by the user
    Mode("no_op", GradSampleModuleNoOp, checks=(_not_fsdp("no_op"),)),
    Mode(
        "ghost",
        GradSampleModuleFastGradientClipping,
        fast_clipping=True,
        returns_criterion=True,  # the loss wrapper runs ghost clipping's two backward passes
        checks=(_not_fsdp("ghost"),),
    ),
    Mode("bk", GradSampleModuleBookKeeping, fast_clipping=True, checks=(_not_fsdp("bk"),)),
    # FSDP2 (fully_shard) models: each rank clips its samples, FSDP's reduce-scatter sums
    Mode(
        "ghost_fsdp",
        GradSampleModuleFastGradientClippingFSDP,
        fast_clipping=True,
        returns_criterion=True,
        checks=(_fsdp_only("ghost_fsdp"),),
    ),
    Mode("bk_fsdp", GradSampleModuleBookKeepingFSDP, fast_clipping=True,
         checks=(_fsdp_only("bk_fsdp"),)),
):
    register_mode(_mode)


class _GsmClasses(Mapping):
    """Read-only view ``mode name -> GradSampleModule class`` of the mode registry."""

    def __getitem__(self, name: str) -> type:
        if name not in known_modes():
            raise KeyError(name)
        return get_mode(name).gsm_class

    def __iter__(self) -> Iterator[str]:
        return iter(known_modes())

    def __len__(self) -> int:
        return len(known_modes())


#: The modes of this installation and their module classes (a view of :mod:`dptorch.modes`).
GSM_CLASSES: Mapping[str, type] = _GsmClasses()


def register_grad_sample_mode(name: str, cls: type) -> None:
    """Makes ``grad_sample_mode=name`` build ``cls``. The other settings of an existing mode of
    that name are kept; a new name is a mode that fills ``p.grad_sample`` (served by the
    per-sample-gradient optimizers). Use :func:`dptorch.modes.register_mode` to set them."""
    if not (isinstance(cls, type) and issubclass(cls, AbstractGradSampleModule)):
        raise ValueError(f"{cls!r} is not an AbstractGradSampleModule subclass.")
    try:
        mode = dataclasses.replace(get_mode(name), gsm_class=cls)
    except ValueError:
        mode = Mode(name, cls)
    register_mode(mode)


def get_gsm_class(grad_sample_mode: str) -> type:
    """The GradSampleModule class implementing ``grad_sample_mode`` (``ValueError`` if unknown)."""
    cls = get_mode(grad_sample_mode).gsm_class
    if cls is None:
        raise ValueError(f"grad_sample_mode {grad_sample_mode!r} has no GradSampleModule class.")
    return cls


#: the in-place (``wrap_model=False``) class of each built-in GradSampleModule class
_HOOKS_CLASSES: dict[type, type] = {
    GradSampleModule: GradSampleHooks,
    GradSampleModuleFastGradientClipping: GradSampleHooksFastGradientClipping,
    GradSampleModuleBookKeeping: GradSampleHooksBookKeeping,
    GradSampleModuleFastGradientClippingFSDP: GradSampleHooksFastGradientClippingFSDP,
    GradSampleModuleBookKeepingFSDP: GradSampleHooksBookKeepingFSDP,
    GradSampleModuleNoOp: GradSampleHooksNoOp,
}


def get_hooks_class(grad_sample_mode: str) -> type:
    """The class that attaches ``grad_sample_mode``'s hooks to a model in place
    (``wrap_model=False``; Opacus's name). ``ValueError`` for a mode that must wrap the call
    (ew) or has no in-place form."""
    cls = get_gsm_class(grad_sample_mode)
    hooks = _HOOKS_CLASSES.get(cls)
    if hooks is None:
        raise ValueError(
            f"grad_sample_mode {grad_sample_mode!r} ({cls.__name__}) has no in-place hooks class: "
            "it must wrap the model (wrap_model=True)."
        )
    return hooks


def check_wrapped(
    module: nn.Module,
    grad_sample_mode: str,
    *,
    batch_first: bool,
    loss_reduction: str,
    multi_pass: bool = False,
) -> None:
    """Raises ``ValueError`` if ``module`` is already a GradSampleModule whose class or settings
    differ from those requested, or a plain ``nn.Module`` that still carries the hooks of a
    GradSampleModule (:func:`~dptorch.grad_sample.gsm_base.check_not_wrapped`)."""
    if not isinstance(module, AbstractGradSampleModule):
        check_not_wrapped(module)  # a plain model that still carries a wrapper's hooks
        return
    has = (
        type(module),
        module.batch_first,
        module.loss_reduction,
        getattr(module, "multi_pass", False),
    )
    wants = (get_gsm_class(grad_sample_mode), batch_first, loss_reduction, multi_pass)
    if has != wants:
        raise ValueError(
            f"The module is already a {has[0].__name__} with batch_first={has[1]}, "
            f"loss_reduction={has[2]!r}, multi_pass={has[3]}, but grad_sample_mode="
            f"{grad_sample_mode!r} ({wants[0].__name__}) with batch_first={batch_first}, "
            f"loss_reduction={loss_reduction!r}, multi_pass={multi_pass} was requested. Pass the "
            "plain nn.Module instead (gsm.to_standard_module() unwraps it)."
        )


def prepare_module(
    model: nn.Module, grad_sample_mode: str, wrap_model: bool = True, *args, **kwargs
) -> AbstractGradSampleModule:
    """Wraps ``model`` in the GradSampleModule of ``grad_sample_mode``; ``*args`` / ``**kwargs``
    go to its constructor, with the mode's own ``gsm_kwargs`` (``"functorch"`` sets
    ``force_functorch=True``).

    ``wrap_model=False`` (Opacus 1.6, for Hugging Face / Accelerate): the hooks are attached to
    ``model`` itself, which keeps its class and identity and is what the user calls; the
    returned object holds the hooks and per-sample state (``cleanup()`` removes them). Every
    check of the wrapped path applies. ExpandedWeights needs to wrap the call and refuses.
    """
    if not wrap_model and grad_sample_mode == "ew":
        raise NotImplementedError(
            "grad_sample_mode='ew' with wrap_model=False: ExpandedWeights must wrap every call of "
            "the model, so it cannot work from hooks on the model. Use wrap_model=True, or "
            "grad_sample_mode='hooks', 'functorch', 'ghost', 'bk', 'ghost_fsdp' or 'bk_fsdp' with "
            "wrap_model=False."
        )
    cls = get_gsm_class(grad_sample_mode)
    gsm = cls(model, *args, **{**kwargs, **get_mode(grad_sample_mode).gsm_kwargs})
    attach = getattr(gsm, "attach_to_module", None)  # no_op has nothing to attach
    if not wrap_model and attach is not None:
        attach()
    return gsm


def wrap_model(
    model: nn.Module, grad_sample_mode: str, wrap_model: bool = True, *args, **kwargs
) -> AbstractGradSampleModule:
    """Same as :func:`prepare_module` (the older Opacus name)."""
    return prepare_module(model, grad_sample_mode, wrap_model, *args, **kwargs)


__all__ = [
    "GSM_CLASSES",
    "check_wrapped",
    "get_gsm_class",
    "prepare_module",
    "wrap_model",
    "register_grad_sample_mode",
    "register_grad_sampler",
    "register_norm_sampler",
]
