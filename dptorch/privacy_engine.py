"""PrivacyEngine: turns a model, optimizer and data loader into their DP-SGD counterparts.

``make_private`` runs every check first (each lives beside what it checks: the mode entry in
:mod:`dptorch.modes`, :mod:`dptorch.optimizers.arguments`, :mod:`dptorch.data_loader`,
:mod:`dptorch.validators`), so bad input raises before anything is modified; then it builds the
mode's DP optimizer (its own checks also run before the model is touched), the mode's
GradSampleModule, the Poisson data loader, the accountant hook and, for a mode that returns one,
the loss wrapper. Checkpoints: :mod:`dptorch.checkpoint`.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import IO, Any, BinaryIO

import torch
from torch import nn, optim
from torch.utils.data import DataLoader

from . import checkpoint
from .accountants import create_accountant
from .accountants.utils import calibrate_noise_multiplier, engine_epsilon, warn_if_weak_delta
from .clipping import check_bound
from .data_loader import (
    check_data_loader,
    expected_batch_size,
    prepare_data_loader,
    records_in_loader,
    steps_per_pass,
)
from .distributed import disable_gradient_sync, is_distributed_module
from .distributed_settings import engine_settings, settings_must_agree
from .grad_sample import AbstractGradSampleModule
from .grad_sample.fast_clipping_loss import DPLossFastGradientClipping
from .grad_sample.gsm_base import forbid_accumulation_hook
from .grad_sample.utils import check_wrapped, wrap_model
from .modes import Mode, get_mode
from .optimizers import DPOptimizer
from .optimizers.arguments import (
    check_flags_and_names,
    check_optimizer_kwargs,
    check_optimizer_params,
    parameter_names,
)
from .optimizers.multi_pass import validate_multi_pass_args
from .sampling import check_plan, check_truncation, plan_for, with_truncation
from .validators import ModuleValidator

logger = logging.getLogger(__name__)

__all__ = ["PrivacyEngine", "forbid_accumulation_hook"]


def _arguments(local_vars: dict[str, Any], **override: Any) -> SimpleNamespace:
    """A method's named arguments (its ``locals()`` on entry, less ``self`` and ``kwargs``) as
    attributes, with ``override``."""
    args = {k: v for k, v in local_vars.items() if k not in ("self", "kwargs")}
    return SimpleNamespace(**{**args, **override})


class PrivacyEngine:
    """Entry point of DP training: ``make_private`` / ``make_private_with_epsilon``,
    ``get_epsilon`` and checkpoints.

    Args:
        accountant: ``"prv"`` (default), ``"rdp"``, ``"gdp"`` or ``"pld"``.
        secure_mode: draw the noise and the Poisson sampling from the OS CSPRNG
            (``os.urandom``). No seed or generator is accepted then. Slower; use it for the
            final, released training run. It does not protect against floating-point attacks
            on the Gaussian sampler.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        self.accountant = create_accountant(accountant)
        self.secure_mode = secure_mode
        self.secure_rng = None  # Opacus attribute; secure randomness comes from os.urandom
        self.dataset = None
        self._data_loader: DataLoader | None = None
        # N, the number of records the last make_private's loader can yield (get_epsilon's δ check)
        self._num_records: int | None = None
        self._sampling = None  # the last make_private's SamplingPlan (fixed shape: δ of truncation)
        if not secure_mode:
            logger.info(
                "Secure RNG turned off: fine for experiments; for a release, retrain with "
                "secure_mode=True (noise and sampling from the OS CSPRNG)."
            )

    # ------------------------------------------------------------------ validation
    def is_compatible(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer | None,
        data_loader: DataLoader | None,
    ) -> bool:
        """Whether :meth:`validate` passes."""
        try:
            self.validate(module=module, optimizer=optimizer, data_loader=data_loader)
        except (ValueError, NotImplementedError):
            return False
        return True

    def validate(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer | None,
        data_loader: DataLoader | None,
    ) -> None:
        """Raises ``ValueError`` if the model (and, when given, optimizer / data loader) cannot
        be trained privately, listing every offending layer with its fix."""
        target = module._module if isinstance(module, AbstractGradSampleModule) else module
        ModuleValidator.validate(target, strict=True)
        if optimizer is not None:
            inner = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
            check_optimizer_params(module, inner)
        if data_loader is not None:
            check_data_loader(data_loader)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """``ModuleValidator.fix(module)``, validated."""
        module = ModuleValidator.fix(module)
        ModuleValidator.validate(module, strict=True)
        return module

    def _check(
        self, a: SimpleNamespace, kwargs: dict[str, Any], **kwargs_check: Any
    ) -> tuple[Mode, bool, int]:
        """Every check of ``make_private`` except the noise multiplier's (which
        ``make_private_with_epsilon`` computes after them), before anything is modified.
        ``kwargs_check`` goes to :func:`check_optimizer_kwargs`. Returns the mode, whether the
        model is distributed and N, the number of units (records, or users) the loader can
        yield; sets ``a.plan`` (:mod:`dptorch.sampling`)."""
        a.plan = plan_for(a, kwargs)
        a.poisson_sampling = a.plan.poisson
        check_flags_and_names(PrivacyEngine.make_private, vars(a))
        for c in a.max_grad_norm if isinstance(a.max_grad_norm, (list, tuple)) else [a.max_grad_norm]:
            check_bound(c)  # before make_private_with_epsilon's noise search
        mode = get_mode(a.grad_sample_mode)
        distributed = is_distributed_module(a.module)
        settings = dict(batch_first=a.batch_first, loss_reduction=a.loss_reduction)
        mode.check(
            a.module, clipping=a.clipping, distributed=distributed, multi_pass=a.multi_pass, **settings
        )
        check_optimizer_kwargs(
            kwargs,
            mode.optimizer_class(a.clipping, distributed),
            alternatives=mode.optimizer_classes().items(),
            **kwargs_check,
        )
        validate_multi_pass_args(
            a.multi_pass, kwargs.get("accum_passes"), kwargs.get("num_private_passes")
        )
        check_wrapped(a.module, mode.name, multi_pass=a.multi_pass, **settings)
        self.validate(module=a.module, optimizer=a.optimizer, data_loader=None)
        check_data_loader(
            a.data_loader, poisson_sampling=a.poisson_sampling, secure_mode=self.secure_mode
        )
        check_plan(a.plan, mode=mode.name, clipping=a.clipping, distributed=distributed,
                   multi_pass=a.multi_pass)
        n = records_in_loader(
            a.data_loader, poisson_sampling=a.poisson_sampling, distributed=distributed
        )
        units = a.plan.units(a.data_loader, n)
        check_truncation(self.accountant, a.plan.truncation(units))
        return mode, distributed, units

    # ------------------------------------------------------------------ building
    def _make_private(
        self,
        a: SimpleNamespace,
        kwargs: dict[str, Any],
        calibrate: Callable[..., float] | None = None,
        **kwargs_check: Any,
    ) -> tuple:
        """:meth:`_check`, then the build (module docstring). ``calibrate(sample_rate=q,
        num_records=N)`` gives the noise multiplier when ``a.noise_multiplier`` is ``None``.
        Distributed: the ranks' DP settings must agree (:mod:`dptorch.distributed_settings`)."""
        with settings_must_agree(is_distributed_module(a.module), where=kwargs_check["where"],
                                 process_group=kwargs.get("process_group")) as agree:
            mode, distributed, n = self._check(a, kwargs, **kwargs_check)
            q, plan = 1 / len(a.data_loader), a.plan
            calibrate = with_truncation(plan, calibrate, a, q, n)
            sigma = a.noise_multiplier if calibrate is None else calibrate(sample_rate=q, num_records=n)
            agree(engine_settings(a, kwargs, sample_rate=q, num_records=n, noise_multiplier=sigma,
                                  expected_batch_size=expected_batch_size(n, q, distributed),
                                  secure_mode=self.secure_mode))  # same on every rank
        optimizer = a.optimizer.original_optimizer if isinstance(a.optimizer, DPOptimizer) else a.optimizer
        dp_optimizer = mode.optimizer_class(a.clipping, distributed)(
            optimizer=optimizer,
            noise_multiplier=sigma,
            max_grad_norm=a.max_grad_norm,
            expected_batch_size=expected_batch_size(n, q, distributed),
            loss_reduction=a.loss_reduction,
            generator=a.noise_generator,
            secure_mode=self.secure_mode,
            **kwargs,
        )
        extra = {"multi_pass": True} if a.multi_pass else {}
        if mode.fast_clipping:  # the module clips with the optimizer's contract (one C, shared)
            extra["clipping"] = dp_optimizer.clipping
        module = a.module
        if not isinstance(module, AbstractGradSampleModule):
            module = wrap_model(module, mode.name, a.wrap_model, batch_first=a.batch_first,
                                loss_reduction=a.loss_reduction, **extra)
        elif mode.fast_clipping:  # wrapped by the user: adopt the optimizer's contract
            module.bind_clipping(dp_optimizer.clipping)
        if a.poisson_sampling:
            module.forbid_grad_accumulation()
            dp_optimizer.forbid_grad_accumulation()
        if distributed:
            disable_gradient_sync(a.module)  # torch DDP: the DP optimizer reduces, not backward
        if self.dataset is None:
            self.dataset = a.data_loader.dataset
        elif self.dataset is not a.data_loader.dataset:
            warnings.warn(
                "PrivacyEngine got a new dataset object; privacy accounting is per dataset. Use a "
                "new PrivacyEngine for a different dataset (ignore this if both objects are the "
                "same logical dataset).",
                stacklevel=3,
            )
        self._num_records, self._sampling = n, plan
        self.accountant.truncation = plan.truncation(n)  # ε includes what truncation costs
        build = partial(plan.loader, layouts=dp_optimizer.clipping.layouts, distributed=distributed) \
            if plan.needs_layout else partial(prepare_data_loader, distributed=distributed,
                                             poisson_sampling=a.poisson_sampling)
        self._data_loader = build(a.data_loader, batch_first=a.batch_first,
                                  secure_mode=self.secure_mode)
        per_pass = steps_per_pass(a.data_loader, a.poisson_sampling)  # None: Poisson batches
        dp_optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(q, steps_per_epoch=per_pass))
        if not mode.returns_criterion:
            return module, dp_optimizer, self._data_loader
        criterion = nn.CrossEntropyLoss(reduction=a.loss_reduction) if a.criterion is None else a.criterion
        loss = DPLossFastGradientClipping(module, dp_optimizer, criterion, a.loss_reduction)
        return module, dp_optimizer, loss, self._data_loader

    # ------------------------------------------------------------------ public API
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        criterion: nn.Module | None = None,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool | str = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        multi_pass: bool = False,
        **kwargs: Any,
    ) -> tuple:
        """Returns ``(GradSampleModule, DPOptimizer, DataLoader)`` for DP-SGD training, and for
        ``grad_sample_mode="ghost"`` ``(GradSampleModule, DPOptimizer, criterion, DataLoader)``
        with the loss wrapper whose ``backward()`` runs ghost clipping.

        Args:
            module: the model (validated; see ``ModuleValidator.fix`` for BatchNorm etc.).
            optimizer: a torch optimizer over exactly the model's trainable parameters.
            criterion: the loss the ghost loss wrapper reduces (default
                ``nn.CrossEntropyLoss(reduction=loss_reduction)``); unused by other modes.
            data_loader: a DataLoader over a map-style dataset; its batch size sets the sample
                rate ``q = 1 / len(data_loader)``.
            noise_multiplier: σ >= 0, noise std relative to the clipping norm.
            max_grad_norm: clipping norm C > 0 (a list, one per parameter, for "per_layer").
            batch_first: whether the batch is dimension 0 of the inputs.
            loss_reduction: ``"mean"`` or ``"sum"``, as in the loss.
            poisson_sampling: Poisson-sampled batches (the accounting assumes them);
                ``"fixed_shape"``: Poisson batches padded to ``max_batch_size`` rows (in
                ``kwargs``; chosen when absent). ``kwargs`` may also hold ``privacy_unit="user"``,
                ``user_id`` and ``max_records_per_user`` (user-level DP). See docs/sampling.md.
            clipping: ``"flat"``, ``"per_layer"`` or ``"adaptive"`` (extra AdaClip arguments in
                ``kwargs``).
            noise_generator: ``torch.Generator`` for the noise (not in secure mode).
            grad_sample_mode: ``"hooks"``, ``"functorch"``, ``"ew"``, ``"ghost"``, ``"bk"``,
                ``"no_op"`` (``p.grad_sample`` filled by the caller) or a mode registered with
                :func:`dptorch.modes.register_mode`.
            wrap_model: ``False`` attaches the hooks to ``module`` itself (Opacus 1.6): keep
                calling ``module``; the first returned object holds the hooks (``cleanup()``).
            multi_pass: several backward passes per step (GANs), each a slice of
                ``p.grad_sample``; needs ``accum_passes`` (and ``num_private_passes`` when it is
                False) in ``kwargs``, optionally ``auto_clip_and_accum_on_step``
                (docs/multi_pass.md).
            **kwargs: passed to the optimizer class.

        Every problem with the arguments raises ``ValueError`` before anything is modified,
        including an unknown keyword argument (with the closest valid name), a non-bool flag or
        a data loader sampler that Poisson sampling cannot reproduce.
        """
        a = _arguments(locals())
        own = parameter_names(PrivacyEngine.make_private)
        return self._make_private(a, kwargs, where="make_private", own=own)

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        criterion: nn.Module | None = None,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | list[float],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool | str = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        **kwargs: Any,
    ) -> tuple:
        """:meth:`make_private` with the noise multiplier that reaches ``(target_epsilon,
        target_delta)`` after ``epochs`` epochs under this engine's accountant.

        ``kwargs`` may hold ``epsilon_tolerance`` (default 0.001), ``multi_pass`` and the extra
        optimizer arguments of :meth:`make_private`; anything else raises ``ValueError``. Warns
        (``UserWarning``) when ``target_delta >= 1/N`` (N: the records the loader can yield; such
        a δ allows releasing whole records) and when the computed noise multiplier exceeds 50
        (target_epsilon too small for the data: the model will learn next to nothing).
        """
        multi_pass = kwargs.pop("multi_pass", False)
        a = _arguments(locals(), noise_multiplier=None)
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}.")
        epsilon_tolerance = kwargs.pop("epsilon_tolerance", 0.001)
        calibrate = partial(  # called with the sample rate and N once they are checked
            calibrate_noise_multiplier, self.accountant, target_epsilon=target_epsilon,
            target_delta=target_delta, epochs=epochs, epsilon_tolerance=epsilon_tolerance,
            steps_per_epoch=steps_per_pass(data_loader, poisson_sampling),  # None: Poisson
        )
        own = parameter_names(PrivacyEngine.make_private_with_epsilon) | {"epsilon_tolerance"}
        return self._make_private(
            a, kwargs, calibrate, where="make_private_with_epsilon",
            own=own | parameter_names(PrivacyEngine.make_private) - {"noise_multiplier"},
            engine_set={
                "noise_multiplier": "make_private_with_epsilon computes it from target_epsilon "
                "(call make_private to choose it yourself)",
            },
        )

    def get_epsilon(self, delta: float) -> float:
        """The ε spent so far for ``delta``, by this engine's accountant.

        Warns (``UserWarning``) when ``delta >= 1/N``, N being the number of records the data
        loader of the last ``make_private`` can yield: such a δ is too weak to mean privacy.
        Fixed-size batches (``poisson_sampling=False``): the sound no-amplification bound under
        replace-one, with a warning stating its assumptions (``accountants.utils.engine_epsilon``).
        """
        warn_if_weak_delta(delta, self._num_records, meaning=", so the epsilon means little")
        return engine_epsilon(self.accountant, delta)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        *,
        path: str | os.PathLike | BinaryIO | IO[bytes],
        module: nn.Module,
        optimizer: DPOptimizer | None = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        checkpoint_dict: dict[str, Any] | None = None,
        module_state_dict_kwargs: dict[str, Any] | None = None,
        torch_save_kwargs: dict[str, Any] | None = None,
        data_loader: DataLoader | None = None,
    ) -> None:
        """Saves model, optimizer (with its DP settings), accountant, schedulers and the random
        generator states (global torch RNG, noise generator, Poisson sampler; ``data_loader``
        defaults to the engine's) to ``path`` (:func:`dptorch.checkpoint.save_checkpoint`).
        Call it between steps (after ``zero_grad``)."""
        if data_loader is None:
            data_loader = self._data_loader
        args = vars(_arguments(locals()))
        checkpoint.save_checkpoint(accountant=self.accountant, sampling=self._sampling_context(),
                                   **args)

    def load_checkpoint(
        self,
        *,
        path: str | os.PathLike | BinaryIO | IO[bytes],
        module: nn.Module,
        optimizer: DPOptimizer | None = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        map_location: Any = None,
        module_load_dict_kwargs: dict[str, Any] | None = None,
        torch_load_kwargs: dict[str, Any] | None = None,
        data_loader: DataLoader | None = None,
        restore_rng_state: bool = True,
    ) -> dict[str, Any]:
        """Restores what :meth:`save_checkpoint` saved into fresh objects (e.g. returned by a
        new ``make_private``); returns the remaining entries of the checkpoint (user data).

        With ``restore_rng_state`` (default) the global torch RNG, the noise generator and the
        Poisson sampler continue where they were, so the resumed run is identical to an
        uninterrupted one. Only to continue *the same* run: a second run on other data (a record
        deleted, another C) from the same checkpoint replays the noise already spent, which then
        cancels between the two models; start it with ``restore_rng_state=False`` and fresh seeds
        (or ``secure_mode``). The file is unpickled (``weights_only=False``): load trusted files only.
        """
        if data_loader is None:
            data_loader = self._data_loader
        args = vars(_arguments(locals()))
        return checkpoint.load_checkpoint(accountant=self.accountant,
                                          sampling=self._sampling_context(), **args)

    def _sampling_context(self) -> dict[str, Any] | None:
        return checkpoint.sampling_context(self._sampling, self._num_records)
