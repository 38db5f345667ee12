"""Common base of every GradSampleModule flavour: wrapping, attribute pass-through, cleanup."""

from __future__ import annotations

import copy
import logging
import weakref
from abc import ABC, abstractmethod
from functools import partial

import torch
from torch import nn

from .unit_params import module_parameters

logger = logging.getLogger(__name__)

#: Every attribute the grad-sample modules set on parameters: the published per-sample gradients
#: (``grad_sample``), the sum over the calls of the current backward pass
#: (``_current_grad_sample``), the slices of multi-pass mode (``_grad_sample_passes``) and the
#: per-sample norms of the fast-clipping modes. All are written by the module only; what the
#: optimizer and the module tell each other is in the module's ``StepRecord``.
#: :func:`clear_grad_sample` and :meth:`AbstractGradSampleModule.cleanup` remove them.
OPACUS_PARAM_MONKEYPATCH_ATTRS = [
    "grad_sample",
    "_current_grad_sample",
    "_grad_sample_passes",
    "_norm_sample",
]


def clear_grad_sample(p: torch.Tensor) -> None:
    """Removes every per-sample-gradient attribute dptorch may have set on ``p``."""
    for attr in OPACUS_PARAM_MONKEYPATCH_ATTRS:
        if hasattr(p, attr):
            delattr(p, attr)


VALID_LOSS_REDUCTIONS = ("mean", "sum")

ACCUMULATION_FORBIDDEN_MESSAGE = (
    "A second backward pass ran while the previous one's per-sample gradients were still held "
    "(they are kept until optimizer.zero_grad(), even after optimizer.step()), and gradient "
    "accumulation is forbidden under Poisson sampling (two small Poisson batches are not one "
    "large one). Each iteration: optimizer.zero_grad(), loss.backward(), optimizer.step(); for "
    "large logical batches use dptorch.utils.batch_memory_manager.BatchMemoryManager."
)


def _check_loss_reduction(loss_reduction: str) -> None:
    if loss_reduction not in VALID_LOSS_REDUCTIONS:
        raise ValueError(
            f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}. Use the reduction "
            "of your loss function (e.g. nn.CrossEntropyLoss(reduction='mean'))."
        )


class AbstractGradSampleModule(nn.Module, ABC):
    """Wraps ``m`` so that every trainable parameter gets ``p.grad_sample`` after backward.

    Attribute access falls through to the wrapped module, so ``gsm.fc1`` is ``m.fc1``.
    """

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean"):
        super().__init__()
        if not isinstance(m, nn.Module):
            raise ValueError(f"GradSampleModule expects an nn.Module, got {type(m).__name__}")
        _check_loss_reduction(loss_reduction)
        check_not_wrapped(m)
        self._module = m
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.grad_accumulation_allowed = True
        # as Opacus: every trainable parameter has ``grad_sample`` (``None``) from wrapping on
        for p in module_parameters(m):
            if p.requires_grad:
                p.grad_sample = None

    @abstractmethod
    def forward(self, *args, **kwargs): ...

    def __getattr__(self, item):
        try:
            return super().__getattr__(item)
        except AttributeError as e:
            submodules = dict(self.named_modules())
            if item and item in submodules:
                return submodules[item]
            module = self._modules.get("_module")
            if module is not None:
                return getattr(module, item)
            raise e

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters of the wrapped module with ``requires_grad``, in ``parameters()``
        order."""
        return [p for p in module_parameters(self._module) if p.requires_grad]

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clears ``p.grad`` (zeroed, or ``None`` with ``set_to_none=True``) and sets
        ``p.grad_sample = None`` (other per-sample state removed), whatever ``set_to_none``
        (per-sample gradients of successive passes may differ in batch size, so they cannot be
        zeroed in place), as Opacus does."""
        super().zero_grad(set_to_none=set_to_none)
        self.set_grad_sample_to_none()

    def del_grad_sample(self) -> None:
        """Removes every per-sample-gradient attribute from the parameters."""
        for p in module_parameters(self):
            clear_grad_sample(p)

    def set_grad_sample_to_none(self) -> None:
        """Sets ``p.grad_sample = None`` on every parameter (other per-sample state removed)."""
        for p in module_parameters(self):
            clear_grad_sample(p)
            p.grad_sample = None

    def remove_hooks(self) -> None:
        """Removes the hooks this module installed (none here; subclasses that hook override)."""

    def cleanup(self) -> None:
        """Removes the hooks and every attribute of :data:`OPACUS_PARAM_MONKEYPATCH_ATTRS` from
        the parameters: the wrapped module is a plain module again."""
        try:
            self.remove_hooks()
        except Exception as e:  # still strip the parameters
            logger.warning("Failed to remove hooks during cleanup (%s); removing attributes.", e)
        finally:
            self.del_grad_sample()

    def to_standard_module(self) -> nn.Module:
        """Returns the wrapped module, with hooks and per-sample-gradient state removed."""
        self._close()
        return self._module

    def _close(self) -> None:
        self.cleanup()

    def forbid_grad_accumulation(self) -> None:
        """After this, a second backward pass without ``zero_grad`` raises ``ValueError``."""
        self.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        """Undoes :meth:`forbid_grad_accumulation`."""
        self.grad_accumulation_allowed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._module!r})"


def forbid_accumulation_hook(module: nn.Module, _input: object) -> None:
    """Forward pre-hook refusing a forward pass while per-sample gradients of the previous one
    are still there (no ``optimizer.step()`` + ``zero_grad()`` in between).

    With Poisson sampling two small batches are not one large Poisson batch, so gradients must
    not be accumulated across batches (use BatchMemoryManager for large logical batches).
    """
    if not module.training:
        return
    for p in module_parameters(module):
        if getattr(p, "grad_sample", None) is not None:
            raise ValueError(
                "Poisson sampling is not compatible with grad accumulation. You need to call "
                "optimizer.step() after every forward/backward pass or consider using "
                "BatchMemoryManager"
            )


class weak_method:
    """A hook calling the bound method ``method`` with ``args`` first, holding the method's
    object (a GradSampleModule) and the arguments that are modules or parameters weakly.

    A hook on a tensor, an autograd node or a parameter that held them strongly would close a
    reference cycle through autograd (the module holds its parameters, or a tensor its forward
    kept on it, and those hold their hooks) that Python's garbage collector cannot see: the
    model would never be freed. Once one of them is gone the hook does nothing (nothing can
    release a gradient through a module that no longer exists). ``__self__`` is the object, for
    :func:`wrapper_hooks_in`."""

    __slots__ = ("_method", "_args", "__weakref__")

    def __init__(self, method, *args):
        self._method = weakref.WeakMethod(method)
        self._args = tuple(
            (True, weakref.ref(a)) if isinstance(a, (nn.Module, nn.Parameter)) else (False, a)
            for a in args
        )

    @property
    def __self__(self):
        method = self._method()
        return None if method is None else method.__self__

    @property
    def __func__(self):
        method = self._method()
        return None if method is None else method.__func__

    def __call__(self, *rest):
        method = self._method()
        if method is None:
            return None
        args = []
        for weak, a in self._args:
            if weak:
                a = a()
                if a is None:
                    return None
            args.append(a)
        return method(*args, *rest)

    def __reduce__(self):
        """Pickled as the bound method and its arguments (strong while pickled; weak again once
        loaded); a dead hook stays dead."""
        method = self._method()
        args = [a() if weak else a for weak, a in self._args]
        if method is None or any(weak and a is None for (weak, _), a in zip(self._args, args)):
            return (_dead_weak_method, ())
        return (weak_method, (method, *args))

    def __deepcopy__(self, memo):
        """The same hook on the copies (``copy.deepcopy`` of a wrapped model: its hooks hold
        the copied GradSampleModule, as a bound method would)."""
        new = weak_method.__new__(weak_method)
        method = self._method()
        args = [a() if weak else a for weak, a in self._args]
        if method is None or any(weak and a is None for (weak, _), a in zip(self._args, args)):
            new._method, new._args = self._method, self._args  # dead: stays dead
            return new
        new._method = weakref.WeakMethod(copy.deepcopy(method, memo))
        new._args = tuple(
            (True, weakref.ref(copy.deepcopy(a, memo))) if weak else (False, copy.deepcopy(a, memo))
            for (weak, _), a in zip(self._args, args)
        )
        return new


def _hook_owner(fn: object) -> object | None:
    """The object a hook is a bound method of (through ``functools.partial``), if any."""
    while isinstance(fn, partial):
        fn = fn.func
    return getattr(fn, "__self__", None)


def wrapper_hooks_in(module: nn.Module) -> tuple[str, str] | None:
    """``(layer name, GradSampleModule class name)`` of the first layer of ``module`` that still
    carries the hooks (or forward override) of a GradSampleModule, or ``None``. Found on a model
    wrapped before and not unwrapped (``to_standard_module()`` / ``cleanup()``), and on a
    ``copy.deepcopy`` of such a model (the copy carries copies of the hooks)."""
    for name, sub in module.named_modules():
        hooks = [
            *sub._forward_hooks.values(),
            *sub._forward_pre_hooks.values(),
            *sub._backward_hooks.values(),
            *sub._backward_pre_hooks.values(),
        ]
        if "forward" in sub.__dict__:
            hooks.append(sub.__dict__["forward"])
        for p in sub.parameters(recurse=False):
            hooks.extend((p._backward_hooks or {}).values())
        for fn in hooks:
            owner = _hook_owner(fn)
            if isinstance(owner, AbstractGradSampleModule):
                return name or "<root>", type(owner).__name__
    return None


def check_not_wrapped(module: nn.Module) -> None:
    """Raises ``ValueError`` if ``module`` (a plain model) still carries a GradSampleModule's
    hooks: wrapping it again would run both sets of hooks in one backward pass, and the
    per-sample gradients and norms of the two would mix (or fail with misleading errors)."""
    found = wrapper_hooks_in(module)
    if found is None:
        return
    name, owner = found
    raise ValueError(
        f"{name} ({type(module.get_submodule('' if name == '<root>' else name)).__name__}) "
        f"already carries the per-sample hooks of a {owner}: the model was wrapped before "
        "(make_private / wrap_model) and not unwrapped, or it is a copy.deepcopy of a wrapped "
        "model. Wrapping it again would mix the per-sample gradients of both wrappers. Fix: "
        "keep the first wrapper (pass the GradSampleModule itself), call "
        "gsm.to_standard_module() on it first, or copy the model before wrapping it."
    )


#: Opacus 1.6's base of the in-place hooks classes (``wrap_model=False``): in dptorch the
#: in-place form of a GradSampleModule is the same class attached to the model it holds.
AbstractGradSampleHooks = AbstractGradSampleModule



def _dead_weak_method() -> weak_method:
    """A hook whose object or arguments are gone (unpickled): it does nothing."""
    new = weak_method.__new__(weak_method)
    new._method, new._args = (lambda: None), ()
    return new
