"""The ``grad_sample_mode`` registry: one :class:`Mode` entry per mode.

Everything that depends on the mode looks its entry up here: ``PrivacyEngine.make_private``,
``grad_sample.utils.get_gsm_class`` / ``wrap_model`` / ``prepare_module`` and
``optimizers.get_optimizer_class``. This module imports nothing from dptorch: the built-in
modes are registered by the packages that own their classes (``dptorch.grad_sample.utils``
registers the modules, ``dptorch.optimizers`` the optimizer classes), and a user registers a
new mode with :func:`register_mode`.

A mode that is not *fast clipping* fills ``p.grad_sample``, so the per-sample-gradient
optimizers (``DPOptimizer``, ``DPPerLayerOptimizer``, ``AdaClipDPOptimizer`` and their
distributed versions, registered with ``mode=None``) serve it for every ``(clipping,
distributed)`` its own ``optimizers`` do not name. A fast-clipping mode only computes norms and
clips in the module, so only the optimizer classes registered for it serve it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "Mode",
    "get_mode",
    "known_modes",
    "optimizer_class",
    "register_mode",
    "register_optimizer",
]

OptimizerKey = tuple[str, bool]  # (clipping, distributed)


@dataclass(frozen=True)
class Mode:
    """What ``grad_sample_mode=name`` means, as plain data.

    Attributes:
        name: the ``grad_sample_mode`` string.
        gsm_class: the :class:`~dptorch.grad_sample.AbstractGradSampleModule` subclass that
            wraps the model (``None`` while only optimizer classes are registered for the name).
        fast_clipping: the module computes per-sample norms and clips itself, with the
            optimizer's ``ClippingContract`` (``make_private`` passes ``clipping=``); it does not
            fill ``p.grad_sample``.
        returns_criterion: ``make_private`` returns ``(module, optimizer, criterion,
            data_loader)``, the criterion being a ``DPLossFastGradientClipping`` loss wrapper.
        optimizers: ``(clipping, distributed) -> optimizer class`` for this mode (see the module
            docstring for the per-sample-gradient optimizers of modes that are not fast clipping).
        multi_pass_clippings: the clipping kinds with which the mode supports
            ``make_private(multi_pass=True)`` (one per-sample gradient slice per backward pass).
        gsm_kwargs: constructor arguments the mode always passes (``force_functorch=True`` for
            ``"functorch"``).
        checks: extra checks run by ``make_private`` before anything is modified, each called as
            ``check(module, clipping=..., distributed=..., multi_pass=..., batch_first=...,
            loss_reduction=...)`` and raising ``ValueError`` to refuse.
    """

    name: str
    gsm_class: type | None = None
    fast_clipping: bool = False
    returns_criterion: bool = False
    optimizers: Mapping[OptimizerKey, type] = field(default_factory=dict)
    multi_pass_clippings: tuple[str, ...] = ()
    gsm_kwargs: Mapping[str, Any] = field(default_factory=dict)
    checks: tuple[Callable[..., None], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"A mode's name must be a non-empty string, got {self.name!r}.")
        object.__setattr__(self, "optimizers", MappingProxyType(dict(self.optimizers)))
        object.__setattr__(self, "gsm_kwargs", MappingProxyType(dict(self.gsm_kwargs)))
        object.__setattr__(self, "multi_pass_clippings", tuple(self.multi_pass_clippings))
        object.__setattr__(self, "checks", tuple(self.checks))

    def optimizer_classes(self) -> dict[OptimizerKey, type]:
        """Every ``(clipping, distributed)`` this mode can train with, and its optimizer class."""
        base = {} if self.fast_clipping else dict(_PER_SAMPLE_OPTIMIZERS)
        return {**base, **self.optimizers}

    def optimizer_class(self, clipping: str, distributed: bool) -> type:
        """The optimizer class for ``clipping`` and (not) distributed training; ``ValueError``
        for a combination this mode does not support."""
        return _lookup(self.optimizer_classes(), clipping, distributed, self.name)

    def check(
        self,
        module: Any,
        *,
        clipping: str,
        distributed: bool,
        multi_pass: bool,
        batch_first: bool,
        loss_reduction: str,
    ) -> None:
        """Raises ``ValueError`` if this mode cannot train ``module`` with these settings: no
        module class, one of :attr:`checks` refuses (run first, so that a mode's own message
        names the fix), no optimizer for ``(clipping, distributed)``, or ``multi_pass``
        unsupported."""
        if self.gsm_class is None:
            raise ValueError(
                f"grad_sample_mode {self.name!r} has optimizer classes but no GradSampleModule "
                "class; register one with register_grad_sample_mode or register_mode."
            )
        for check in self.checks:  # first: a check's message names the fix for this mode
            check(
                module,
                clipping=clipping,
                distributed=distributed,
                multi_pass=multi_pass,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
            )
        self.optimizer_class(clipping, distributed)
        if multi_pass and not self.multi_pass_clippings:
            able = [repr(m.name) for m in _MODES.values() if m.multi_pass_clippings]
            raise ValueError(
                f"multi_pass=True needs grad_sample_mode {' or '.join(able)}, got {self.name!r}: "
                "only they keep one per-sample gradient slice per pass."
            )
        if multi_pass and clipping not in self.multi_pass_clippings:
            raise ValueError(
                f"multi_pass=True with grad_sample_mode {self.name!r} supports clipping "
                f"{' and '.join(map(repr, self.multi_pass_clippings))}, got {clipping!r}."
            )


_MODES: dict[str, Mode] = {}
# the optimizers of every mode that fills p.grad_sample (not fast clipping)
_PER_SAMPLE_OPTIMIZERS: dict[OptimizerKey, type] = {}


def register_mode(mode: Mode) -> Mode:
    """Makes ``grad_sample_mode=mode.name`` mean ``mode`` (replacing an entry of that name).

    Optimizer classes registered earlier for the name with :func:`register_optimizer` are kept
    where ``mode.optimizers`` names none for the same ``(clipping, distributed)``. Returns the
    registered entry."""
    if not isinstance(mode, Mode):
        raise TypeError(f"register_mode expects a Mode, got {type(mode).__name__}.")
    previous = _MODES.get(mode.name)
    if previous is not None and previous.optimizers:
        mode = dataclasses.replace(mode, optimizers={**previous.optimizers, **mode.optimizers})
    _MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> Mode:
    """The entry of ``grad_sample_mode=name``; ``ValueError`` naming the known modes."""
    if not isinstance(name, str):
        raise ValueError(f"grad_sample_mode must be a string, got {name!r} ({type(name).__name__}).")
    try:
        return _MODES[name]
    except KeyError:
        raise ValueError(
            f"Unknown grad_sample_mode {name!r}; expected one of {list(known_modes())}."
        ) from None


def known_modes() -> tuple[str, ...]:
    """The registered mode names that have a module class, sorted."""
    return tuple(sorted(n for n, m in _MODES.items() if m.gsm_class is not None))


def register_optimizer(
    cls: type, *, clipping: str, distributed: bool, mode: str | None = None
) -> None:
    """Makes ``cls`` the optimizer class of ``(clipping, distributed)`` for ``mode``, or with
    ``mode=None`` for every mode that fills ``p.grad_sample``. An unregistered ``mode`` gets an
    entry without a module class, completed by a later :func:`register_mode`."""
    key = (clipping, bool(distributed))
    if mode is None:
        _PER_SAMPLE_OPTIMIZERS[key] = cls
        return
    entry = _MODES.get(mode) or Mode(mode)
    _MODES[mode] = dataclasses.replace(entry, optimizers={**entry.optimizers, key: cls})


def optimizer_class(mode: str | None, clipping: str, distributed: bool) -> type:
    """The optimizer class of ``mode`` (``None``: of the modes that fill ``p.grad_sample``) for
    ``clipping`` and (not) distributed training; ``ValueError`` for an unsupported combination
    or an unknown mode."""
    if mode is None:
        return _lookup(_PER_SAMPLE_OPTIMIZERS, clipping, distributed, None)
    return get_mode(mode).optimizer_class(clipping, distributed)


def _lookup(
    served: Mapping[OptimizerKey, type], clipping: str, distributed: bool, mode: str | None
) -> type:
    key = (clipping, bool(distributed))
    if key in served:
        return served[key]
    raise ValueError(
        f"Unsupported combination clipping={clipping!r}, distributed={bool(distributed)}, "
        f"grad_sample_mode={mode!r}. Supported: {_describe(served) or 'none'}."
    )


def _describe(served: Iterable[OptimizerKey]) -> str:
    return "; ".join(f"clipping={c!r}, distributed={d}" for c, d in sorted(served))
