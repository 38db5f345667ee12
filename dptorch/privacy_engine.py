"""PrivacyEngine: turns a model, optimizer and data loader into their DP-SGD counterparts.

``make_private`` = validate the arguments and the model (nothing is trained on bad input), wrap
the model (per-sample gradients), replace the data loader's batching by Poisson sampling, wrap
the optimizer (clipping + noise) and attach the accountant to it. Each stage is a small method
(``_validate_args``, ``_prepare_model``, ``_prepare_data_loader``, ``_prepare_optimizer``,
``_attach_accountant``) so that variants (fast clipping, multi-pass, distributed) hook into one.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import warnings
from typing import IO, Any, BinaryIO

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler

from .data_loader import DPDataLoader, loader_sampler, poisson_sampling_indices, switch_generator
from .grad_sample import AbstractGradSampleModule, GradSampleModule
from .grad_sample.utils import get_gsm_class, wrap_model
from .optimizers import DPOptimizer, get_optimizer_class
from .utils.randomness import secure_generator_seed

logger = logging.getLogger(__name__)

__all__ = ["PrivacyEngine", "forbid_accumulation_hook"]

_CLIPPING_MODES = ("flat", "per_layer", "adaptive")
_GSM_PREFIX = "_module."


def forbid_accumulation_hook(module: nn.Module, _input) -> None:
    """Forward pre-hook refusing a forward pass while per-sample gradients of the previous one
    are still there (no ``optimizer.step()`` + ``zero_grad()`` in between).

    With Poisson sampling two small batches are not one large Poisson batch, so gradients must
    not be accumulated across batches (use BatchMemoryManager for large logical batches).
    """
    if not module.training:
        return
    for p in module.parameters():
        if getattr(p, "grad_sample", None) is not None:
            raise ValueError(
                "Poisson sampling is not compatible with grad accumulation. You need to call "
                "optimizer.step() after every forward/backward pass or consider using "
                "BatchMemoryManager"
            )


def _accountants():
    from . import accountants  # imported late: the accountants package is built separately

    return accountants


def _is_real_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# A computed noise multiplier above this is almost certainly a mistake (target_epsilon far too
# small for the data set size and the number of steps): the model learns nothing.
_EXTREME_NOISE_MULTIPLIER = 50.0

# Arguments of the optimizer classes that make_private passes itself.
_ENGINE_PASSED = frozenset(
    (
        "optimizer",
        "noise_multiplier",
        "max_grad_norm",
        "expected_batch_size",
        "loss_reduction",
        "generator",
        "secure_mode",
    )
)
# Those of them that are not make_private parameters, with what to do instead.
_ENGINE_SET_ARGS = {
    "expected_batch_size": "make_private computes it as q * N from the data loader",
    "generator": "pass the noise generator as noise_generator=",
    "secure_mode": "set it on the engine: PrivacyEngine(secure_mode=True)",
}


def _parameter_names(func: Any) -> set[str]:
    """The named parameters of ``func`` (no ``self``, ``*args``, ``**kwargs``)."""
    return {
        n
        for n, p in inspect.signature(func).parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _check_arg_types(*, flags: dict[str, Any], names: dict[str, Any]) -> None:
    """``flags`` must be ``bool`` (``poisson_sampling="fixed_shape"`` is not True) and ``names``
    ``str``; raises ``ValueError`` naming the argument, the value received and what is expected."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(
                f"{name} must be True or False, got {value!r} ({type(value).__name__}). A "
                "non-bool value is not interpreted as a flag; pass a bool."
            )
    for name, value in names.items():
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r} ({type(value).__name__}).")


def _optimizer_keywords(optim_class: type) -> dict[str, inspect.Parameter]:
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


def _check_optimizer_kwarg_type(name: str, value: Any, param: inspect.Parameter) -> None:
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
        ok, expected = _is_real_number(value), "a real number (int or float, not bool)"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer (not bool)"
    if not ok:
        raise ValueError(
            f"{name} must be {expected}"
            + (" or None" if "None" in kinds else "")
            + f", got {value!r} ({type(value).__name__})."
        )


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
        self.accountant = _accountants().create_accountant(accountant)
        self.secure_mode = secure_mode
        self.secure_rng = None  # Opacus attribute; secure randomness comes from os.urandom
        self.dataset = None
        self._data_loader: DataLoader | None = None
        # N, the number of records the last make_private's loader can yield (get_epsilon's δ check)
        self._num_records: int | None = None
        if not secure_mode:
            logger.info(
                "Secure RNG turned off: fine for experiments; for a release, retrain with "
                "secure_mode=True (noise and sampling from the OS CSPRNG)."
            )

    # ------------------------------------------------------------------ validation
    def _validate_args(
        self,
        *,
        noise_multiplier: float | None,
        max_grad_norm: float | list[float],
        clipping: str,
        loss_reduction: str,
        noise_generator: torch.Generator | None,
        grad_sample_mode: str,
        data_loader: DataLoader,
        poisson_sampling: bool,
    ) -> None:
        """Checks every scalar argument and the data loader; raises ``ValueError``.

        ``noise_multiplier=None``: not known yet (``make_private_with_epsilon`` computes it after
        these checks); its own checks are skipped."""
        if noise_multiplier is not None and (
            not _is_real_number(noise_multiplier)
            or not (math.isfinite(noise_multiplier) and noise_multiplier >= 0)
        ):
            raise ValueError(
                f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}. It is "
                "the noise std relative to max_grad_norm (typical values 0.5-2); "
                "make_private_with_epsilon computes it from a target epsilon."
            )
        if noise_multiplier == 0:
            logger.warning("noise_multiplier=0: training is NOT differentially private.")
        if clipping not in _CLIPPING_MODES:
            raise ValueError(f"clipping must be one of {_CLIPPING_MODES}, got {clipping!r}.")
        norms = max_grad_norm if clipping == "per_layer" else [max_grad_norm]
        if clipping == "per_layer" and (
            _is_real_number(max_grad_norm) or not hasattr(max_grad_norm, "__len__")
        ):
            raise ValueError(
                "clipping='per_layer' needs max_grad_norm as a list with one clipping norm per "
                f"trainable parameter, got {max_grad_norm!r}."
            )
        for c in norms:
            if not _is_real_number(c):
                raise ValueError(
                    f"max_grad_norm must be a real number (int or float, not bool) > 0, got "
                    f"{c!r} ({type(c).__name__})."
                )
            if not (c > 0):
                raise ValueError(
                    f"max_grad_norm must be > 0, got {c!r}. It is the L2 norm each sample's "
                    "gradient is clipped to (typical values 0.1-10)."
                )
            if math.isinf(c) and noise_multiplier is not None and noise_multiplier > 0:
                raise ValueError(
                    "max_grad_norm=inf with noise_multiplier > 0 gives infinite noise; pick a "
                    "finite clipping norm."
                )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        if self.secure_mode and noise_generator is not None:
            raise ValueError(
                "secure_mode=True draws noise from the OS CSPRNG: passing noise_generator (a "
                "seed) is prohibited. Remove it, or use secure_mode=False for reproducible runs."
            )
        get_gsm_class(grad_sample_mode)  # raises ValueError for an unknown mode
        self._validate_data_loader(data_loader, poisson_sampling=poisson_sampling)

    def _validate_data_loader(self, data_loader: DataLoader, *, poisson_sampling: bool) -> None:
        dataset = getattr(data_loader, "dataset", None)
        if dataset is None:
            raise ValueError(
                "The data loader has no .dataset: the privacy accounting needs the dataset size."
            )
        if poisson_sampling and isinstance(dataset, IterableDataset):
            raise ValueError(
                "Poisson sampling needs a map-style dataset (len and indexing); got an "
                f"IterableDataset ({type(dataset).__name__})."
            )
        try:
            n = len(dataset)
        except TypeError:
            raise ValueError("The dataset has no len(): the accountant needs its size.") from None
        if n == 0:
            raise ValueError("The data loader's dataset is empty: there is nothing to train on.")
        if len(data_loader) == 0:
            raise ValueError("The data loader yields no batch (len(data_loader) == 0).")
        if (
            self.secure_mode
            and poisson_sampling
            and getattr(data_loader, "generator", None) is not None
        ):
            raise ValueError(
                "secure_mode=True: the data loader has a seeded generator, but the sampling must "
                "come from the OS CSPRNG. Build the DataLoader without generator=."
            )

    @staticmethod
    def _records_in_loader(
        data_loader: DataLoader, *, poisson_sampling: bool, distributed: bool
    ) -> int:
        """N, the number of records ``data_loader`` can yield: ``len(indices)`` of its
        ``SubsetRandomSampler``, else the dataset size. The accounting uses it (expected batch
        size ``q · N``, the δ < 1/N check).

        With ``poisson_sampling`` a sampler that Poisson sampling cannot reproduce raises
        ``ValueError`` (see :func:`dptorch.data_loader.poisson_sampling_indices`)."""
        if poisson_sampling:
            indices = poisson_sampling_indices(data_loader, distributed=distributed)
            return len(data_loader.dataset) if indices is None else len(indices)
        sampler = loader_sampler(data_loader)
        if isinstance(sampler, SubsetRandomSampler):
            return len(sampler.indices)
        return len(data_loader.dataset)

    def _validate_extra_kwargs(
        self,
        kwargs: dict[str, Any],
        *,
        module: nn.Module,
        clipping: str,
        grad_sample_mode: str,
        where: str,
        own: set[str],
        passthrough: frozenset[str] = frozenset(),
        engine_set: dict[str, str] | None = None,
    ) -> None:
        """Checks the ``**kwargs`` of ``make_private`` (``where``) against the keyword arguments
        of the optimizer class that ``clipping`` / ``grad_sample_mode`` / distributed select
        (found by inspecting its ``__init__``), and type-checks those annotated ``bool`` /
        ``int`` / ``float``.

        An unknown name raises ``ValueError`` naming it and the closest valid one among ``own``
        (the method's parameters) and the optimizer's: a misspelt setting would otherwise be
        swallowed by the optimizer and silently keep its default. ``passthrough`` names are
        checked later (by ``make_private``); ``engine_set`` maps names the engine computes
        itself to what to do instead.
        """
        from .optimizers import _OPTIMIZERS

        optim_class = get_optimizer_class(
            clipping=clipping,
            distributed=self._is_distributed(module),
            grad_sample_mode=grad_sample_mode,
        )
        accepted = {
            k: p for k, p in _optimizer_keywords(optim_class).items() if k not in _ENGINE_PASSED
        }
        engine_set = {**_ENGINE_SET_ARGS, **(engine_set or {})}
        for name, value in kwargs.items():
            if name in passthrough:
                continue
            if name in accepted:
                _check_optimizer_kwarg_type(name, value, accepted[name])
                continue
            if name in engine_set:
                raise ValueError(
                    f"{where}() got {name}={value!r}, which it sets itself: {engine_set[name]}."
                )
            close = difflib.get_close_matches(name, sorted(own | set(accepted)), n=1, cutoff=0.6)
            owners = sorted(
                {
                    f"{cls.__name__} (clipping={c!r})"
                    for (c, _, _), cls in _OPTIMIZERS.items()
                    if cls is not optim_class and name in _optimizer_keywords(cls)
                }
            )
            raise ValueError(
                f"{where}() got an unknown keyword argument {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else ".")
                + (
                    f" {name!r} is an argument of {', '.join(owners)}, not of "
                    f"{optim_class.__name__}, the optimizer of clipping={clipping!r}."
                    if owners
                    else ""
                )
                + " Unknown arguments are refused rather than ignored: a misspelt setting would "
                "otherwise silently keep its default. Extra keyword arguments accepted here: "
                + (", ".join(sorted(accepted.keys() | passthrough)) or "none")
                + "."
            )

    @staticmethod
    def _validate_optimizer_params(module: nn.Module, optimizer: optim.Optimizer) -> None:
        """The optimizer must update exactly the model's trainable parameters."""
        names = {id(p): n for n, p in module.named_parameters()}
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        opt_ids = {id(p) for p in opt_params}
        foreign = [
            f"#{i} (shape {tuple(p.shape)})" for i, p in enumerate(opt_params) if id(p) not in names
        ]
        if foreign:
            raise ValueError(
                "The optimizer has parameters that are not the model's: optimizer parameter "
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

    @staticmethod
    def _validate_module(module: nn.Module) -> None:
        """Raises one error listing every layer that prevents private training, with the fix."""
        target = module._module if isinstance(module, AbstractGradSampleModule) else module
        try:
            from .validators import ModuleValidator
        except ImportError:  # pragma: no cover - validators are built separately
            errors = GradSampleModule.validate(target, strict=False)
            if errors:
                raise ValueError(
                    f"{len(errors)} problem(s) prevent private training (model = "
                    "dptorch.validators.ModuleValidator.fix(model) fixes the replaceable ones):\n"
                    + "\n".join(f"  - {e}" for e in errors)
                ) from None
            return
        ModuleValidator.validate(target, strict=True)

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
        """Raises if the model (and, when given, optimizer / data loader) cannot be trained
        privately."""
        self._validate_module(module)
        if optimizer is not None:
            inner = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
            self._validate_optimizer_params(module, inner)
        if data_loader is not None:
            self._validate_data_loader(data_loader, poisson_sampling=True)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """``ModuleValidator.fix(module)``, validated."""
        from .validators import ModuleValidator

        module = ModuleValidator.fix(module)
        ModuleValidator.validate(module, strict=True)
        return module

    # ------------------------------------------------------------------ preparation stages
    def _prepare_model(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "hooks",
        **gsm_kwargs,
    ) -> AbstractGradSampleModule:
        """Wraps ``module`` in the GradSampleModule of ``grad_sample_mode`` (a pre-wrapped module
        is kept if its settings match)."""
        if isinstance(module, AbstractGradSampleModule):
            if (
                module.batch_first != batch_first
                or module.loss_reduction != loss_reduction
                or type(module) is not get_gsm_class(grad_sample_mode)
            ):
                raise ValueError(
                    "The module is already a GradSampleModule with other settings "
                    f"(batch_first={module.batch_first}, loss_reduction={module.loss_reduction!r}, "
                    f"{type(module).__name__}) than requested (batch_first={batch_first}, "
                    f"loss_reduction={loss_reduction!r}, grad_sample_mode={grad_sample_mode!r}). "
                    "Pass the plain nn.Module instead."
                )
            return module
        return wrap_model(
            module,
            grad_sample_mode,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            **gsm_kwargs,
        )

    def _prepare_data_loader(
        self,
        data_loader: DataLoader,
        *,
        poisson_sampling: bool,
        distributed: bool,
        batch_first: bool = True,
    ) -> DataLoader:
        """Poisson-sampling DPDataLoader over the records ``data_loader`` draws from (the whole
        dataset or its ``SubsetRandomSampler``'s indices), or the loader itself, with a warning,
        when ``poisson_sampling=False``. Remembers N, the number of those records, for
        :meth:`get_epsilon`."""
        self._num_records = self._records_in_loader(
            data_loader, poisson_sampling=poisson_sampling, distributed=distributed
        )
        if self.dataset is None:
            self.dataset = data_loader.dataset
        elif self.dataset is not data_loader.dataset:
            warnings.warn(
                "PrivacyEngine got a new dataset object; privacy accounting is per dataset. Use a "
                "new PrivacyEngine for a different dataset (ignore this if both objects are the "
                "same logical dataset).",
                stacklevel=3,
            )
        if poisson_sampling:
            dl = DPDataLoader.from_data_loader(
                data_loader,
                distributed=distributed,
                batch_first=batch_first,
                secure_mode=self.secure_mode,
            )
            self._data_loader = dl
            return dl
        warnings.warn(
            "poisson_sampling=False: batches are not Poisson samples, but the privacy accounting "
            "assumes Poisson sampling with rate 1/len(data_loader). The reported epsilon is then "
            "not a proven guarantee for this training.",
            UserWarning,
            stacklevel=3,
        )
        if self.secure_mode:
            gen = torch.Generator()
            gen.manual_seed(secure_generator_seed())
            try:
                switch_generator(data_loader=data_loader, generator=gen)
            except ValueError:
                logger.info("secure_mode: the data loader draws no random numbers to secure.")
        self._data_loader = data_loader
        return data_loader

    @staticmethod
    def _expected_batch_size(dataset_size: int, sample_rate: float, distributed: bool) -> float:
        """``q · N``, robust to float round-off. Distributed: the per-rank share
        ``q · N / world_size``, kept fractional so that the distributed optimizer's division by
        ``expected_batch_size × world_size`` is exactly by ``q · N``."""
        expected = max(1, int(dataset_size * sample_rate + 1e-9))
        if distributed:
            import torch.distributed as dist

            return expected / dist.get_world_size()
        return expected

    def _prepare_optimizer(
        self,
        *,
        optimizer: optim.Optimizer,
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        expected_batch_size: float,
        loss_reduction: str = "mean",
        distributed: bool = False,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        **kwargs,
    ) -> DPOptimizer:
        """The DPOptimizer class chosen by ``get_optimizer_class`` around ``optimizer``."""
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        optim_class = get_optimizer_class(
            clipping=clipping, distributed=distributed, grad_sample_mode=grad_sample_mode
        )
        return optim_class(
            optimizer=optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=None if self.secure_mode else noise_generator,
            secure_mode=self.secure_mode,
            **kwargs,
        )

    def _attach_accountant(self, optimizer: DPOptimizer, sample_rate: float) -> None:
        """The accountant records ``(optimizer.noise_multiplier, sample_rate)`` at every step."""
        optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))

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
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        multi_pass: bool = False,
        **kwargs,
    ) -> tuple[AbstractGradSampleModule, DPOptimizer, DataLoader]:
        """Returns ``(GradSampleModule, DPOptimizer, DataLoader)`` for DP-SGD training.

        Args:
            module: the model (validated; see ``ModuleValidator.fix`` for BatchNorm etc.).
            optimizer: a torch optimizer over exactly the model's trainable parameters.
            criterion: accepted for Opacus compatibility (used by fast gradient clipping modes).
            data_loader: a DataLoader over a map-style dataset; its batch size sets the sample
                rate ``q = 1 / len(data_loader)``.
            noise_multiplier: σ >= 0, noise std relative to the clipping norm.
            max_grad_norm: clipping norm C > 0 (a list, one per parameter, for "per_layer").
            batch_first: whether the batch is dimension 0 of the inputs.
            loss_reduction: ``"mean"`` or ``"sum"``, as in the loss.
            poisson_sampling: Poisson-sampled batches (the accounting assumes them).
            clipping: ``"flat"``, ``"per_layer"`` or ``"adaptive"`` (extra AdaClip arguments in
                ``kwargs``).
            noise_generator: ``torch.Generator`` for the noise (not in secure mode).
            grad_sample_mode: ``"hooks"``, ``"functorch"``, ``"ew"`` (or a registered mode).
            wrap_model: must be True (only wrapped models are supported).
            multi_pass: several backward passes per step (GANs: real and generated data), each
                a slice of ``p.grad_sample``; needs ``accum_passes`` (and
                ``num_private_passes`` when it is False) in ``kwargs``, optionally
                ``auto_clip_and_accum_on_step``. See docs/multi_pass.md for when each mode is
                private.
            **kwargs: passed to the optimizer class.

        Every problem with the arguments raises ``ValueError`` before anything is modified,
        including an unknown keyword argument (with the closest valid name), a non-bool flag or
        a data loader sampler that Poisson sampling cannot reproduce.
        """
        _check_arg_types(
            flags=dict(
                poisson_sampling=poisson_sampling,
                batch_first=batch_first,
                wrap_model=wrap_model,
                multi_pass=multi_pass,
            ),
            names=dict(
                grad_sample_mode=grad_sample_mode, clipping=clipping, loss_reduction=loss_reduction
            ),
        )
        if not wrap_model:
            raise NotImplementedError("wrap_model=False is not supported; models are wrapped.")
        self._validate_args(
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            loss_reduction=loss_reduction,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            data_loader=data_loader,
            poisson_sampling=poisson_sampling,
        )
        self._validate_extra_kwargs(
            kwargs,
            module=module,
            clipping=clipping,
            grad_sample_mode=grad_sample_mode,
            where="make_private",
            own=_parameter_names(PrivacyEngine.make_private),
        )
        _validate_multi_pass_mode(multi_pass, clipping, grad_sample_mode, module, kwargs)
        inner_optimizer = (
            optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
        )
        self._validate_optimizer_params(module, inner_optimizer)
        self._validate_module(module)
        distributed = self._is_distributed(module)
        sample_rate = 1 / len(data_loader)
        # N = the records the loader can yield (a SubsetRandomSampler's indices): raises for a
        # sampler that Poisson sampling cannot reproduce
        num_records = self._records_in_loader(
            data_loader, poisson_sampling=poisson_sampling, distributed=distributed
        )
        expected_batch_size = self._expected_batch_size(num_records, sample_rate, distributed)
        # build the optimizer first: its own checks (per-layer norms, AdaClip bounds) must also
        # fail before the model is wrapped
        dp_optimizer = self._prepare_optimizer(
            optimizer=inner_optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            distributed=distributed,
            clipping=clipping,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            **kwargs,
        )
        gsm = self._prepare_model(
            module,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            grad_sample_mode=grad_sample_mode,
            **({"multi_pass": True} if multi_pass else {}),
            # fast clipping: the module clips with the optimizer's contract (one C, shared)
            **({"clipping": dp_optimizer.clipping} if grad_sample_mode in ("ghost", "bk") else {}),
        )
        if poisson_sampling and hasattr(gsm, "forbid_grad_accumulation"):
            gsm.forbid_grad_accumulation()
        if distributed:
            from .distributed import disable_gradient_sync

            disable_gradient_sync(module)  # torch DDP: the DP optimizer reduces, not backward
        dp_loader = self._prepare_data_loader(
            data_loader,
            poisson_sampling=poisson_sampling,
            distributed=distributed,
            batch_first=batch_first,
        )
        self._attach_accountant(dp_optimizer, sample_rate)
        if grad_sample_mode == "ghost":  # Opacus: (module, optimizer, criterion, data_loader)
            from .utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

            if criterion is None:
                criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
            dp_criterion = DPLossFastGradientClipping(gsm, dp_optimizer, criterion, loss_reduction)
            return gsm, dp_optimizer, dp_criterion, dp_loader
        return gsm, dp_optimizer, dp_loader

    @staticmethod
    def _is_distributed(module: nn.Module) -> bool:
        try:
            from .distributed import is_distributed_module
        except ImportError:  # pragma: no cover - distributed support is built separately
            return False
        return is_distributed_module(module)

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
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        **kwargs,
    ) -> tuple[AbstractGradSampleModule, DPOptimizer, DataLoader]:
        """:meth:`make_private` with the noise multiplier that reaches ``(target_epsilon,
        target_delta)`` after ``epochs`` epochs under this engine's accountant.

        ``kwargs`` may hold ``epsilon_tolerance`` (default 0.01), ``multi_pass`` and the extra
        optimizer arguments of :meth:`make_private`; anything else raises ``ValueError``. Warns
        (``UserWarning``) when ``target_delta >= 1/N`` (N: the records the loader can yield; such
        a δ allows releasing whole records) and when the computed noise multiplier exceeds 50
        (target_epsilon too small for the data: the model will learn next to nothing).
        """
        _check_arg_types(
            flags=dict(
                poisson_sampling=poisson_sampling, batch_first=batch_first, wrap_model=wrap_model
            ),
            names=dict(
                grad_sample_mode=grad_sample_mode, clipping=clipping, loss_reduction=loss_reduction
            ),
        )
        if not _is_real_number(target_epsilon) or not (0 < target_epsilon < math.inf):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
        if not _is_real_number(target_delta) or not (0 < target_delta < 1):
            raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}.")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}.")
        epsilon_tolerance = kwargs.pop("epsilon_tolerance", 0.01)
        if not _is_real_number(epsilon_tolerance) or not (0 < epsilon_tolerance < math.inf):
            raise ValueError(
                "epsilon_tolerance must be a finite number > 0 (how far below target_epsilon the "
                f"reached epsilon may be), got {epsilon_tolerance!r}."
            )
        self._validate_args(
            noise_multiplier=None,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            loss_reduction=loss_reduction,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            data_loader=data_loader,
            poisson_sampling=poisson_sampling,
        )
        own = _parameter_names(PrivacyEngine.make_private_with_epsilon) | {"epsilon_tolerance"}
        self._validate_extra_kwargs(
            kwargs,
            module=module,
            clipping=clipping,
            grad_sample_mode=grad_sample_mode,
            where="make_private_with_epsilon",
            own=own | _parameter_names(PrivacyEngine.make_private) - {"noise_multiplier"},
            passthrough=frozenset({"multi_pass"}),
            engine_set={
                "noise_multiplier": "make_private_with_epsilon computes it from target_epsilon "
                "(call make_private to choose it yourself)",
            },
        )
        num_records = self._records_in_loader(
            data_loader,
            poisson_sampling=poisson_sampling,
            distributed=self._is_distributed(module),
        )
        if target_delta >= 1 / num_records:
            warnings.warn(
                f"target_delta={target_delta:g} is >= 1/N = {1 / num_records:g} (N = "
                f"{num_records} records): a mechanism that publishes one random record in full "
                "satisfies such a delta. Use delta well below 1/N (e.g. 1/N^1.1 or 1e-5 for "
                "N < 100000).",
                UserWarning,
                stacklevel=2,
            )
        if len(self.accountant) > 0:
            warnings.warn(
                "make_private_with_epsilon on a PrivacyEngine that already accounted steps: the "
                "noise reaches target_epsilon for this training alone, and the total epsilon "
                "will exceed it.",
                stacklevel=2,
            )
        sample_rate = 1 / len(data_loader)
        noise_multiplier = _accountants().get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            epochs=epochs,
            accountant=self.accountant.mechanism(),
            epsilon_tolerance=epsilon_tolerance,
        )
        if noise_multiplier > _EXTREME_NOISE_MULTIPLIER:
            warnings.warn(
                f"target_epsilon={target_epsilon:g} needs noise_multiplier={noise_multiplier:.4g} "
                f"(sample rate {sample_rate:.4g}, {epochs} epochs): the noise is more than "
                f"{_EXTREME_NOISE_MULTIPLIER:g} times the clipping norm, so the model will learn "
                "next to nothing. Check target_epsilon (typical values 1-10), or use more data, "
                "larger batches or fewer epochs.",
                UserWarning,
                stacklevel=2,
            )
        return self.make_private(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            **kwargs,
        )

    def get_epsilon(self, delta: float) -> float:
        """The ε spent so far for ``delta``, by this engine's accountant.

        Warns (``UserWarning``) when ``delta >= 1/N``, N being the number of records the data
        loader of the last ``make_private`` can yield: such a δ is too weak to mean privacy.
        """
        n = self._num_records
        if n is not None and _is_real_number(delta) and delta >= 1 / n:
            warnings.warn(
                f"delta={delta:g} is >= 1/N = {1 / n:g} (N = {n} records): a mechanism that "
                "publishes one random record in full satisfies such a delta, so the epsilon "
                "reported for it means little. Use delta well below 1/N.",
                UserWarning,
                stacklevel=2,
            )
        return self.accountant.get_epsilon(delta=delta)

    # ------------------------------------------------------------------ checkpoints
    def _rng_state(
        self, optimizer: DPOptimizer | None, data_loader: DataLoader | None
    ) -> dict[str, torch.Tensor]:
        state = {"torch": torch.get_rng_state()}
        gen = getattr(optimizer, "generator", None) if optimizer is not None else None
        if isinstance(gen, torch.Generator):
            state["noise_generator"] = gen.get_state()
        if data_loader is not None:
            for key, gen in _loader_generators(data_loader).items():
                state[key] = gen.get_state()
        return state

    def _load_rng_state(
        self,
        state: dict[str, torch.Tensor],
        optimizer: DPOptimizer | None,
        data_loader: DataLoader | None,
    ) -> None:
        if "torch" in state:
            torch.set_rng_state(state["torch"])
        if data_loader is not None:
            for key, gen in _loader_generators(data_loader).items():
                if key in state:
                    gen.set_state(state[key])
        # last: the noise generator may also be the sampler's, and was saved after it
        noise_gen = getattr(optimizer, "generator", None) if optimizer is not None else None
        if isinstance(noise_gen, torch.Generator) and "noise_generator" in state:
            noise_gen.set_state(state["noise_generator"])

    def save_checkpoint(
        self,
        *,
        path: str | os.PathLike | BinaryIO | IO[bytes],
        module: nn.Module,
        optimizer: DPOptimizer | None = None,
        noise_scheduler=None,
        grad_clip_scheduler=None,
        checkpoint_dict: dict[str, Any] | None = None,
        module_state_dict_kwargs: dict[str, Any] | None = None,
        torch_save_kwargs: dict[str, Any] | None = None,
        data_loader: DataLoader | None = None,
    ) -> None:
        """Saves model, optimizer (with its DP settings), accountant, schedulers and the random
        generator states (global torch RNG, noise generator, Poisson sampler) to ``path``.

        ``data_loader`` defaults to the last one built by this engine. Call it between steps
        (after ``zero_grad``).
        """
        ckpt = dict(checkpoint_dict or {})
        ckpt["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
        ckpt["privacy_accountant_state_dict"] = self.accountant.state_dict()
        if optimizer is not None:
            ckpt["optimizer_state_dict"] = optimizer.state_dict()
            if isinstance(optimizer, DPOptimizer):
                ckpt["dp_optimizer_state"] = _dp_settings(optimizer)
        if noise_scheduler is not None:
            ckpt["noise_scheduler_state_dict"] = noise_scheduler.state_dict()
        if grad_clip_scheduler is not None:
            ckpt["grad_clip_scheduler_state_dict"] = grad_clip_scheduler.state_dict()
        loader = data_loader if data_loader is not None else self._data_loader
        ckpt["rng_state"] = self._rng_state(optimizer, loader)
        torch.save(ckpt, path, **(torch_save_kwargs or {}))

    def load_checkpoint(
        self,
        *,
        path: str | os.PathLike | BinaryIO | IO[bytes],
        module: nn.Module,
        optimizer: DPOptimizer | None = None,
        noise_scheduler=None,
        grad_clip_scheduler=None,
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
        uninterrupted one. The file is unpickled (``weights_only=False``): load trusted files only.
        """
        load_kwargs = {"weights_only": False, **(torch_load_kwargs or {})}
        if map_location is not None:
            load_kwargs["map_location"] = map_location
        ckpt = torch.load(path, **load_kwargs)
        clip_state = (ckpt.get("dp_optimizer_state") or {}).get("clipping")
        if isinstance(optimizer, DPOptimizer) and clip_state is not None:
            optimizer.clipping.check_state_dict(clip_state)  # before anything is loaded
        state = _match_gsm_prefix(ckpt.pop("module_state_dict"), module)
        module.load_state_dict(state, **(module_load_dict_kwargs or {}))
        self.accountant.load_state_dict(ckpt.pop("privacy_accountant_state_dict"))
        opt_state = ckpt.pop("optimizer_state_dict", None)
        dp_state = ckpt.pop("dp_optimizer_state", None)
        if optimizer is not None and opt_state:
            optimizer.load_state_dict(opt_state)
            if dp_state and isinstance(optimizer, DPOptimizer):
                _load_dp_settings(optimizer, dp_state)
        elif (optimizer is not None) != bool(opt_state):
            warnings.warn(
                "The checkpoint has "
                + ("no optimizer state" if optimizer is not None else "an optimizer state")
                + " but an optimizer was "
                + ("" if optimizer is not None else "not ")
                + "given.",
                stacklevel=2,
            )
        for key, sched in (
            ("noise_scheduler_state_dict", noise_scheduler),
            ("grad_clip_scheduler_state_dict", grad_clip_scheduler),
        ):
            sd = ckpt.pop(key, None)
            if sched is not None and sd:
                sched.load_state_dict(sd)
        rng = ckpt.pop("rng_state", None)
        if restore_rng_state and rng is not None:
            loader = data_loader if data_loader is not None else self._data_loader
            self._load_rng_state(rng, optimizer, loader)
        return ckpt


_DP_SETTINGS = ("noise_multiplier", "unclipped_num", "sample_size")


def _validate_multi_pass_mode(
    multi_pass: bool, clipping: str, grad_sample_mode: str, module: nn.Module, kwargs: dict
) -> None:
    """``make_private(multi_pass=...)`` checks (docs/multi_pass.md), before anything changes."""
    from .optimizers.optimizer import validate_multi_pass_args

    validate_multi_pass_args(
        multi_pass, kwargs.get("accum_passes"), kwargs.get("num_private_passes")
    )
    if isinstance(module, AbstractGradSampleModule) and getattr(
        module, "multi_pass", False
    ) != multi_pass:
        raise ValueError(
            f"The module is a GradSampleModule with multi_pass={getattr(module, 'multi_pass', False)}"
            f" but make_private got multi_pass={multi_pass}; pass the plain nn.Module instead."
        )
    if not multi_pass:
        return
    if grad_sample_mode not in ("hooks", "functorch"):
        raise ValueError(
            f"multi_pass=True needs grad_sample_mode 'hooks' or 'functorch', got "
            f"{grad_sample_mode!r}: only they keep one per-sample gradient slice per pass."
        )
    if clipping not in ("flat", "per_layer"):
        raise ValueError(
            f"multi_pass=True supports clipping 'flat' and 'per_layer', got {clipping!r} (the "
            "adaptive clip-count noise assumes one clipped unit per record)."
        )


def _dp_settings(optimizer: DPOptimizer) -> dict[str, Any]:
    """DP hyper-parameters that schedules / adaptive clipping change during training: the noise
    multiplier, AdaClip's counts, and the clipping contract's bound(s)."""
    out: dict[str, Any] = {"clipping": optimizer.clipping.state_dict()}
    for k in _DP_SETTINGS:
        if k in optimizer.__dict__:
            v = getattr(optimizer, k)
            out[k] = float(v) if _is_real_number(v) else v
    return out


def _load_dp_settings(optimizer: DPOptimizer, state: dict[str, Any]) -> None:
    state = dict(state)
    clipping = state.pop("clipping", None)
    if clipping is not None:
        optimizer.clipping.load_state_dict(clipping)
    else:  # checkpoints written before the clipping contract
        norms = state.pop("max_grad_norms", None)
        flat = state.pop("max_grad_norm", None)
        if norms is not None and optimizer.clipping.per_layer:
            optimizer.clipping.max_grad_norms = norms
        elif flat is not None:
            optimizer.clipping.max_grad_norm = flat
    for k, v in state.items():
        setattr(optimizer, k, v)


def _loader_generators(data_loader: DataLoader) -> dict[str, torch.Generator]:
    """The generators whose state determines a loader's future batches."""
    out = {}
    for key, obj in (
        ("sampler_generator", data_loader.batch_sampler),
        ("sampler_generator", getattr(data_loader.batch_sampler, "sampler", None)),
        ("sampler_generator", data_loader.sampler),
        ("loader_generator", data_loader),
    ):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and key not in out:
            out[key] = gen
    return out


def _match_gsm_prefix(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """Adds or strips the GradSampleModule ``_module.`` prefix so a checkpoint of a wrapped
    model loads into a plain one and vice versa."""
    wants = isinstance(module, AbstractGradSampleModule)
    has = bool(state) and all(k.startswith(_GSM_PREFIX) for k in state)
    if wants and not has:
        return {_GSM_PREFIX + k: v for k, v in state.items()}
    if has and not wants:
        return {k[len(_GSM_PREFIX) :]: v for k, v in state.items()}
    return state
