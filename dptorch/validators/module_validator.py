"""``ModuleValidator``: finds what prevents private training of a model and fixes it.

Rules are registered per exact module type (see :func:`register_module_validator` /
:func:`register_module_fixer`); the built-in ones live next to this file (``batch_norm.py``,
``instance_norm.py``, ``recurrent.py``, ``multihead_attention.py``). On top of them,
:meth:`ModuleValidator.validate` reports the per-sample-gradient problems that
``GradSampleModule.validate`` checks (shared: ``per_sample_gradient_problems``), e.g. a
BatchNorm subclass with no rule of its own, or a trainable layer with buffers and no sampler.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

from torch import nn

from ..grad_sample.grad_sample_module import GradSampleModule, per_sample_gradient_problems
from .errors import (
    IllegalModuleConfigurationError,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    UnsupportedModuleError,
)

logger = logging.getLogger(__name__)

_PROBLEM_ERRORS: dict[str, type[UnsupportedModuleError]] = {
    "batch_mixing": ShouldReplaceModuleError,
    "needs_dp_layer": ShouldReplaceModuleError,
    "buffers_no_sampler": UnsupportableModuleError,
}


class ModuleValidator:
    """Validates and fixes models for differentially private training (static methods only).

    ``VALIDATORS[type] = f(module) -> list[UnsupportedModuleError]`` and
    ``FIXERS[type] = f(module, **kwargs) -> nn.Module`` hold the rules, looked up by exact type.
    """

    VALIDATORS: dict[type, Callable] = {}
    FIXERS: dict[type, Callable] = {}

    @classmethod
    def validate(
        cls, module: nn.Module, *, strict: bool = False
    ) -> list[UnsupportedModuleError]:
        """Every problem of ``module`` (and its submodules), each naming the module's path.

        With ``strict=True`` raises one :class:`UnsupportedModuleError` listing all of them
        (nothing is raised for a valid model).
        """
        errors: list[UnsupportedModuleError] = []
        if not module.training:
            errors.append(
                IllegalModuleConfigurationError(
                    "Model needs to be in training mode (call model.train() before "
                    "make_private; per-sample gradients are computed in training passes)."
                )
            )
        reported: set[str] = set()
        for name, sub in module.named_modules():
            rule = cls.VALIDATORS.get(type(sub))
            if rule is None:
                continue
            path = name or "<root>"
            for e in rule(sub):
                errors.append(_with_path(e, path, sub))
                reported.add(path)
        for problem in per_sample_gradient_problems(module, GradSampleModule.GRAD_SAMPLERS):
            if problem.path not in reported:
                errors.append(_PROBLEM_ERRORS[problem.kind](problem.message))
        if strict and errors:
            raise UnsupportedModuleError(
                f"{len(errors)} problem(s) prevent private training "
                "(model = dptorch.validators.ModuleValidator.fix(model) fixes the replaceable "
                "ones):\n" + "\n".join(f"  - {type(e).__name__}: {e}" for e in errors)
            )
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """``True`` iff :meth:`validate` finds no problem."""
        return len(cls.validate(module, strict=False)) == 0

    @classmethod
    def fix(cls, module: nn.Module, **kwargs) -> nn.Module:
        """A fixed deep copy of ``module`` (``module`` itself is unchanged).

        Every submodule that has a fixer and that its validator flags is replaced: BatchNorm ->
        GroupNorm (``num_groups=`` an int or ``f(num_features) -> int``; default: the largest
        divisor of ``num_features`` that is at most 32, see
        :func:`dptorch.validators.batch_norm.default_num_groups`; ``replace_bn_with_in=True``:
        InstanceNorm instead), InstanceNorm -> running stats off, ``nn.LSTM`` / ``nn.GRU`` /
        ``nn.RNN`` / ``nn.MultiheadAttention`` -> ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` /
        ``DPMultiheadAttention`` with the same weights (same function). ``kwargs`` go to every
        fixer. A module shared under several names is replaced by one shared replacement.
        """
        model = copy.deepcopy(module)
        replacements: dict[int, nn.Module] = {}
        done: list[str] = []
        for name, sub in list(model.named_modules(remove_duplicate=False)):
            if any(name.startswith(p + ".") for p in done if p) or (done and done[0] == ""):
                continue
            new = replacements.get(id(sub))
            if new is None:
                fixer = cls.FIXERS.get(type(sub))
                if fixer is None:
                    continue
                rule = cls.VALIDATORS.get(type(sub))
                if rule is not None and not rule(sub):
                    continue
                path = name or "<root>"
                try:
                    new = fixer(sub, **kwargs)
                except (ValueError, TypeError, NotImplementedError) as e:
                    raise type(e)(f"ModuleValidator.fix: cannot fix {path} ({sub!r}): {e}") from e
                replacements[id(sub)] = new
                logger.info("ModuleValidator.fix: replaced %s (%r) with %r", path, sub, new)
            if new is sub:
                continue
            if name == "":
                model = new
            else:
                cls._replace_sub_module(root=model, sub_module_name=name, new_sub_module=new)
            done.append(name)
        return model

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``; returns the fixed copy."""
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed

    @staticmethod
    def _replace_sub_module(*, root: nn.Module, sub_module_name: str, new_sub_module: nn.Module):
        *parents, last = sub_module_name.split(".")
        owner = root
        for p in parents:
            owner = getattr(owner, p)
        setattr(owner, last, new_sub_module)


def _with_path(e: UnsupportedModuleError, path: str, sub: nn.Module) -> UnsupportedModuleError:
    msg = f"{path} ({type(sub).__name__}): {e}"
    try:
        return type(e)(msg)
    except TypeError:  # a user error class with another constructor: keep it as is
        return e
