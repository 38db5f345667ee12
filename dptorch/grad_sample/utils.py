"""Choosing and building the GradSampleModule flavour for a ``grad_sample_mode``."""

from __future__ import annotations

from torch import nn

from .grad_sample_module import GradSampleModule
from .gsm_base import AbstractGradSampleModule
from .gsm_exp_weights import GradSampleModuleExpandedWeights
from .registry import register_grad_sampler, register_norm_sampler

GSM_CLASSES: dict[str, type] = {
    "hooks": GradSampleModule,
    "functorch": GradSampleModule,
    "ew": GradSampleModuleExpandedWeights,
}


def register_grad_sample_mode(name: str, cls: type) -> None:
    """Makes ``grad_sample_mode=name`` build ``cls`` (used by the fast-clipping modes)."""
    GSM_CLASSES[name] = cls


def get_gsm_class(grad_sample_mode: str) -> type:
    """The GradSampleModule class implementing ``grad_sample_mode``."""
    try:
        return GSM_CLASSES[grad_sample_mode]
    except KeyError:
        raise ValueError(
            f"Unknown grad_sample_mode {grad_sample_mode!r}; expected one of {sorted(GSM_CLASSES)}"
        ) from None


def prepare_module(
    model: nn.Module, grad_sample_mode: str, wrap_model: bool = True, *args, **kwargs
) -> AbstractGradSampleModule:
    """Wraps ``model`` in the GradSampleModule of ``grad_sample_mode`` (:func:`get_gsm_class`);
    ``*args`` / ``**kwargs`` go to its constructor (``"functorch"`` sets ``force_functorch``).

    ``wrap_model=False`` (Opacus: attach hook objects without wrapping) raises
    ``NotImplementedError``: dptorch's hooks live in the wrapping module, there is no separate
    hooks class.
    """
    if not wrap_model:
        raise NotImplementedError(
            "wrap_model=False is not supported: dptorch attaches its hooks through the "
            "GradSampleModule wrapper (there is no separate hooks class); use wrap_model=True."
        )
    cls = get_gsm_class(grad_sample_mode)
    if grad_sample_mode == "functorch":
        kwargs["force_functorch"] = True
    if cls is GradSampleModuleExpandedWeights:
        kwargs.pop("force_functorch", None)
        kwargs.pop("strict", None)
    return cls(model, *args, **kwargs)


def wrap_model(
    model: nn.Module, grad_sample_mode: str, wrap_model: bool = True, *args, **kwargs
) -> AbstractGradSampleModule:
    """Same as :func:`prepare_module` (the older Opacus name)."""
    return prepare_module(model, grad_sample_mode, wrap_model, *args, **kwargs)


__all__ = [
    "get_gsm_class",
    "prepare_module",
    "wrap_model",
    "register_grad_sample_mode",
    "register_grad_sampler",
    "register_norm_sampler",
]
