"""Checks of the arguments that ``make_private`` hands to the DP optimizer classes.

The keyword arguments a caller forwards (``**kwargs`` of ``make_private``) are checked against
the ``__init__`` signatures of the optimizer class they will reach, so that a misspelt or
mistyped setting is refused instead of silently keeping its default.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn, optim

logger = logging.getLogger(__name__)

__all__ = [
    "ENGINE_SET",
    "check_flags_and_names",
    "check_noise_multiplier",
    "check_optimizer_kwargs",
    "check_optimizer_params",
    "is_real_number",
    "optimizer_keywords",
    "parameter_names",
]

#: DPOptimizer arguments that ``make_private`` passes itself; for those that are not
#: ``make_private`` parameters, what to do instead.
ENGINE_SET: dict[str, str | None] = {
    "optimizer": None,
    "noise_multiplier": None,
    "max_grad_norm": None,
    "loss_reduction": None,
    "expected_batch_size": "make_private computes it as q * N from the data loader",
    "generator": "pass the noise generator as noise_generator=",
    "secure_mode": "set it on the engine: PrivacyEngine(secure_mode=True)",
}


def is_real_number(x: Any) -> bool:
    """``int`` or ``float``, not ``bool``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_noise_generator(generator: Any, *, secure_mode: bool) -> None:
    """A seeded noise generator contradicts ``secure_mode`` (noise from the OS CSPRNG)."""
    if secure_mode and generator is not None:
        raise ValueError(
            "secure_mode=True draws noise from the OS CSPRNG: passing noise_generator (a "
            "seed) is prohibited. Remove it, or use secure_mode=False for reproducible runs."
        )


def check_noise_multiplier(noise_multiplier: Any, max_grad_norm: Any) -> None:
    """σ must be a finite real number >= 0, and C finite when σ > 0 (``ValueError``); σ = 0 is
    logged as not private. C itself is checked by the optimizer's ``ClippingContract``."""
    if not is_real_number(noise_multiplier) or not (
        math.isfinite(noise_multiplier) and noise_multiplier >= 0
    ):
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}. It is "
            "the noise std relative to max_grad_norm (typical values 0.5-2); "
            "make_private_with_epsilon computes it from a target epsilon."
        )
    if noise_multiplier == 0:
        logger.warning("noise_multiplier=0: training is NOT differentially private.")
    bounds = max_grad_norm if isinstance(max_grad_norm, (list, tuple)) else [max_grad_norm]
    if noise_multiplier > 0 and any(is_real_number(c) and math.isinf(c) for c in bounds):
        raise ValueError(
            "max_grad_norm=inf with noise_multiplier > 0 gives infinite noise; pick a finite "
            "clipping norm."
        )


def check_optimizer_params(module: nn.Module, optimizer: optim.Optimizer) -> None:
    """The optimizer must update exactly the model's trainable parameters (``ValueError``
    naming the foreign or missing ones)."""
    names = {id(p): n for n, p in module.named_parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    opt_ids = {id(p) for p in opt_params}
    foreign = [
        f"#{i} (shape {tuple(p.shape)})" for i, p in enumerate(opt_params) if id(p) not in names
    ]
    if foreign:
        raise ValueError(
            # Opacus's text first: code written for Opacus catches or matches it
            "Module parameters are different than optimizer Parameters. The optimizer has "
            "parameters that are not the model's: optimizer parameter "
            + ", ".join(foreign)
            + ". Build the optimizer from model.parameters() of this model (after any "
            "ModuleValidator.fix, which copies the model)."
        )
    missing = [
        n for n, p in module.named_parameters() if p.requires_grad and id(p) not in opt_ids
    ]
    if missing:
        raise ValueError(
            "Model parameters require grad but are not in the optimizer: "
            + ", ".join(missing)
            + ". Add them to the optimizer, or freeze them with p.requires_grad_(False)."
        )


def parameter_names(func: Any) -> set[str]:
    """The named parameters of ``func`` (no ``self``, ``*args``, ``**kwargs``)."""
    return {
        n
        for n, p in inspect.signature(func).parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def optimizer_keywords(optim_class: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments ``optim_class(...)`` accepts: the named parameters of its
    ``__init__`` and, while an ``__init__`` forwards ``**kwargs``, of the next ``__init__`` in
    the MRO (up to, not including, ``torch.optim.Optimizer``)."""
    out: dict[str, inspect.Parameter] = {}
    for klass in optim_class.__mro__:
        if klass is optim.Optimizer or klass is object:
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        for name, p in params.items():
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return out


def _annotation_names(annotation: Any) -> set[str]:
    """``{"float"}`` for ``float``, ``{"int", "None"}`` for ``"int | None"`` (string annotations
    included); an empty set for anything else."""
    if annotation is inspect.Parameter.empty:
        return set()
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return {t.strip() for t in text.split("|")}


def check_flags_and_names(func: Any, values: Mapping[str, Any]) -> None:
    """The arguments in ``values`` that ``func`` annotates ``bool`` must be ``bool`` (a flag
    such as ``poisson_sampling="fixed_shape"`` is not True) and those annotated ``str`` strings;
    ``ValueError`` naming the argument, the value received and what is expected."""
    for name, param in inspect.signature(func).parameters.items():
        kinds, value = _annotation_names(param.annotation), values.get(name)
        if name not in values or kinds not in ({"bool"}, {"str"}):
            continue
        if kinds == {"bool"} and not isinstance(value, bool):
            raise ValueError(
                f"{name} must be True or False, got {value!r} ({type(value).__name__}). A "
                "non-bool value is not interpreted as a flag; pass a bool."
            )
        if kinds == {"str"} and not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r} ({type(value).__name__}).")


def _check_type(name: str, value: Any, param: inspect.Parameter) -> None:
    """Type-checks an optimizer keyword argument annotated with ``bool`` / ``int`` / ``float``
    (optionally ``| None``); other annotations are left to the optimizer."""
    kinds = _annotation_names(param.annotation)
    if not kinds or not kinds <= {"bool", "int", "float", "None"}:
        return
    if value is None and "None" in kinds:
        return
    if "bool" in kinds:
        ok, expected = isinstance(value, bool), "True or False"
    elif "float" in kinds:
        ok, expected = is_real_number(value), "a real number (int or float, not bool)"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer (not bool)"
    if not ok:
        raise ValueError(
            f"{name} must be {expected}"
            + (" or None" if "None" in kinds else "")
            + f", got {value!r} ({type(value).__name__})."
        )


def check_optimizer_kwargs(
    kwargs: dict[str, Any],
    optim_class: type,
    *,
    where: str,
    own: set[str],
    alternatives: Iterable[tuple[tuple[str, bool], type]] = (),
    engine_set: dict[str, str] | None = None,
) -> None:
    """Checks the ``**kwargs`` that ``where`` (``"make_private"``, ...) forwards to
    ``optim_class``: each must be one of its keyword arguments (:func:`optimizer_keywords`, less
    those of :data:`ENGINE_SET`), and those annotated ``bool`` / ``int`` / ``float`` must have
    that type.

    An unknown name raises ``ValueError`` naming the closest valid one among ``own`` (the
    caller's parameters) and the optimizer's, and the classes among ``alternatives``
    (``((clipping, distributed), class)`` pairs) that do accept it; a name the caller sets
    itself raises with what to do instead (:data:`ENGINE_SET`, plus ``engine_set``).
    """
    accepted = {k: p for k, p in optimizer_keywords(optim_class).items() if k not in ENGINE_SET}
    hints = {**{k: v for k, v in ENGINE_SET.items() if v}, **(engine_set or {})}
    for name, value in kwargs.items():
        if name in accepted:
            _check_type(name, value, accepted[name])
            continue
        if name in hints:
            raise ValueError(f"{where}() got {name}={value!r}, which it sets itself: {hints[name]}.")
        close = difflib.get_close_matches(name, sorted(own | set(accepted)), n=1, cutoff=0.6)
        owners = sorted(
            {
                f"{cls.__name__} (clipping={clipping!r})"
                for (clipping, _), cls in alternatives
                if cls is not optim_class and name in optimizer_keywords(cls)
            }
        )
        raise ValueError(
            f"{where}() got an unknown keyword argument {name!r}"
            + (f"; did you mean {close[0]!r}?" if close else ".")
            + (
                f" {name!r} is an argument of {', '.join(owners)}, not of "
                f"{optim_class.__name__}, the optimizer of these settings."
                if owners
                else ""
            )
            + " Unknown arguments are refused rather than ignored: a misspelt setting would "
            "otherwise silently keep its default. Extra keyword arguments accepted here: "
            + (", ".join(sorted(accepted)) or "none")
            + "."
        )
