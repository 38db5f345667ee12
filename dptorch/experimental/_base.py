"""Shared machinery of the experimental engines: wrapping an optimizer, sample rates, labels.

An experimental engine wraps a model and a ``torch.optim.Optimizer``. It privatizes the
gradient in a *step pre-hook* registered on the optimizer, so both ``optimizer.step()`` and
``engine.step()`` release a private update, and a step without a fresh backward pass through
the engine raises instead of releasing an unprotected gradient.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..grad_sample.gsm_base import clear_grad_sample
from ..optimizers.arguments import check_optimizer_params
from ..utils.uniform_sampler import UniformWithReplacementSampler

logger = logging.getLogger(__name__)


class ApproximateDPWarning(UserWarning):
    """Emitted by engines whose reported ε is *not* a proven differential-privacy guarantee."""


class ApproximateEpsilon(float):
    """A float ε that is only an approximate (heuristic) privacy figure, not a proven bound.

    It behaves as a float in arithmetic and formatting; ``repr`` and ``str`` say "approximate"
    and ``is_approximate`` is ``True``, so code and logs can tell it from a proven ε.
    """

    is_approximate = True

    def __repr__(self) -> str:
        return f"ApproximateEpsilon({float(self)!r})"

    def __str__(self) -> str:
        return f"{float(self):g} (approximate, not a proven DP guarantee)"


def validate_positive(name: str, value: Any, *, hint: str = "") -> float:
    """Returns ``float(value)`` or raises ``ValueError`` unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}. {hint}".rstrip())
    return float(value)


def validate_delta(delta: Any) -> float:
    """δ must lie in (0, 1)."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (0 < delta < 1):
        raise ValueError(
            f"delta must be in (0, 1), got {delta!r}; use a value well below 1/len(dataset)."
        )
    return float(delta)


def poisson_batch_sampler(data_loader: Any) -> UniformWithReplacementSampler | None:
    """``data_loader``'s batch sampler when it is exactly dptorch's single-process Poisson sampler
    (``UniformWithReplacementSampler``: each record joins each batch independently with
    probability ``q``, as in ``DPDataLoader``), else ``None``.

    Subclasses and other samplers that carry a ``sample_rate`` are not trusted: the fixed-shape
    and user-level samplers of ``make_private`` (padding rows, whole users), the distributed
    sampler, or a user class may draw differently from what the sampled-Gaussian analysis
    assumes.
    """
    batch_sampler = getattr(data_loader, "batch_sampler", None)
    return batch_sampler if type(batch_sampler) is UniformWithReplacementSampler else None


def describe_loader(data_loader: Any) -> str:
    """``"the data loader (DataLoader, batch sampler BatchSampler over RandomSampler)"``."""
    batch_sampler = getattr(data_loader, "batch_sampler", None)
    if batch_sampler is None:
        return f"the data loader ({type(data_loader).__name__})"
    inner = getattr(batch_sampler, "sampler", None)
    over = f" over {type(inner).__name__}" if inner is not None else ""
    return (
        f"the data loader ({type(data_loader).__name__}, batch sampler "
        f"{type(batch_sampler).__name__}{over})"
    )


def resolve_sample_rate(
    sample_rate: float | None,
    data_loader: Any | None,
    *,
    engine: str = "This engine",
    approximate: bool = False,
) -> float:
    """The Poisson sampling rate ``q`` used by the sampled-Gaussian accountant.

    Taken from ``sample_rate`` when given (the caller states that every record joins every
    batch independently with probability ``q``), else from ``data_loader``:

    - a loader whose batch sampler is exactly ``UniformWithReplacementSampler`` (a
      ``DPDataLoader``, or a ``DataLoader(batch_sampler=UniformWithReplacementSampler(...))``)
      gives its ``sample_rate``: the analysis covers it;
    - any other loader (a shuffled fixed-size ``DataLoader``, sampling with replacement, the
      fixed-shape or user-level loaders of ``make_private``, a distributed sampler, a custom
      loader with a ``sample_rate`` attribute) is not covered: ``ValueError`` for a formal
      engine (``approximate=False``); for an approximate engine ``q`` is its ``sample_rate``
      or ``batch_size / len(dataset)``, with an :class:`ApproximateDPWarning` saying so.
    """
    if sample_rate is not None:
        if data_loader is not None:
            raise ValueError("Pass either sample_rate or data_loader, not both.")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not (
            0 < sample_rate <= 1
        ):
            raise ValueError(
                f"sample_rate must be in (0, 1], got {sample_rate!r}; it is the probability "
                "that a given example is in a batch (batch_size / len(dataset))."
            )
        return float(sample_rate)
    if data_loader is None:
        raise ValueError(
            "The accountant needs the sampling rate: pass sample_rate=... or data_loader=... "
            "(a DPDataLoader, whose Poisson sampling the accountant assumes)."
        )
    poisson = poisson_batch_sampler(data_loader)
    if poisson is not None:
        return resolve_sample_rate(float(poisson.sample_rate), None)
    what = describe_loader(data_loader)
    if not approximate:
        raise ValueError(
            f"{engine}'s guarantee is the sampled Gaussian mechanism under Poisson sampling "
            f"(every record joins every batch independently with probability q), and {what} "
            "does not sample that way: shuffled fixed-size batches get no amplification by "
            "sampling, a sampler with replacement can put a record in a batch more than once, "
            "and the fixed-shape or user-level loaders of make_private add padding rows or whole "
            "users, so an epsilon accounted at a Poisson rate q would be too small. Fix: pass "
            "data_loader=DPDataLoader.from_data_loader(loader) (Poisson sampling at "
            "q = 1 / len(loader)) and train on that loader, or pass sample_rate=q if your "
            "batches are Poisson samples at rate q; for shuffled fixed-size batches use "
            "dptorch.PrivacyEngine with poisson_sampling=False, which reports the bound that "
            "holds for them."
        )
    q = getattr(data_loader, "sample_rate", None)
    if q is None:
        q = getattr(getattr(data_loader, "batch_sampler", None), "sample_rate", None)
    if q is not None:
        source = "its sample_rate"
    else:
        batch_size = getattr(data_loader, "batch_size", None)
        dataset = getattr(data_loader, "dataset", None)
        if not batch_size or dataset is None or len(dataset) == 0:
            raise ValueError(
                "Cannot infer the sample rate from this data loader (no sample_rate, batch_size "
                "or dataset); pass sample_rate=... explicitly."
            )
        q = batch_size / len(dataset)
        source = f"batch_size / len(dataset) = {batch_size} / {len(dataset)}"
    q = resolve_sample_rate(float(q), None)
    warnings.warn(
        f"{engine}: {what} does not draw Poisson batches, yet its approximate epsilon is "
        f"accounted as if every record joined every batch independently with probability "
        f"q = {q:.6g} ({source}). That is a second approximation on top of the engine's own. "
        "Use a DPDataLoader (DPDataLoader.from_data_loader(loader)) to remove it.",
        ApproximateDPWarning,
        stacklevel=4,
    )
    return q


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of ``module`` in registration order."""
    return [p for p in module.parameters() if p.requires_grad]


def as_tensor_list(inputs: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor or a sequence of tensors, as a non-empty list."""
    items = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ValueError("inputs must be a tensor or a non-empty sequence of tensors.")
    return items


class ExperimentalPrivacyEngine:
    """Base of the experimental engines: wraps ``module`` and ``optimizer``.

    Subclasses implement :meth:`_privatize` (turn what the last backward pass left into the
    released ``p.grad``) and :meth:`_account` (record the step), and state their guarantee in
    :attr:`guarantee`. The optimizer's ``step`` runs :meth:`_privatize` and :meth:`_account`
    first through a step pre-hook.

    Attributes:
        is_approximate: ``True`` when the reported ε is not a proven DP bound.
        guarantee: one sentence stating what the engine guarantees.
        steps: number of private steps taken.
    """

    is_approximate: bool = False
    guarantee: str = ""

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        *,
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
    ):
        """``wrap(module)`` (e.g. :func:`as_grad_sample_module`) runs after every check, so that
        a refused engine leaves the model as it was (no per-sample hooks)."""
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be an nn.Module, got {type(module).__name__}.")
        if not isinstance(optimizer, Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        from ..optimizers.optimizer import DPOptimizer

        if isinstance(optimizer, DPOptimizer):
            raise ValueError(
                "Pass the plain torch optimizer: a DPOptimizer already clips and noises, and "
                "the engine would privatize the gradient a second time."
            )
        if secure_mode and generator is not None:
            raise ValueError("secure_mode draws from the OS CSPRNG; pass generator=None.")
        if not trainable_parameters(module):
            raise ValueError("module has no trainable parameters.")
        self._check_optimizer_params(module, optimizer)
        self.module = module if wrap is None else wrap(module)
        self.optimizer = optimizer
        self.generator = generator
        self.secure_mode = secure_mode
        self.steps = 0
        self._pending = False
        self._hook = optimizer.register_step_pre_hook(self._step_pre_hook)

    # ----------------------------------------------------------------- training-loop API
    @property
    def params(self) -> list[nn.Parameter]:
        """Trainable parameters, in the order used by per-parameter options."""
        return trainable_parameters(self.module)

    def backward(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """Backward pass for the next step (``loss.backward()`` unless overridden)."""
        loss.backward()
        self._pending = True

    def step(self, closure: Any = None) -> Any:
        """Takes one private step: same as ``optimizer.step()``."""
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients and any per-sample gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.module.parameters():
            clear_grad_sample(p)

    def detach(self) -> None:
        """Removes the step hook: the optimizer is an ordinary (non-private) optimizer again."""
        self._hook.remove()

    def _ready(self) -> bool:
        """Whether a backward pass through the engine happened since the last step."""
        return self._pending

    def _check_optimizer_params(self, module: nn.Module, optimizer: Optimizer) -> None:
        """The main engine's check (:func:`~dptorch.optimizers.arguments.check_optimizer_params`):
        the optimizer updates exactly ``module``'s trainable parameters. The engine privatizes
        only the module's parameters; another one in the optimizer (a learnable temperature,
        a second model) would be updated with its raw gradient."""
        try:
            check_optimizer_params(module, optimizer)
        except ValueError as e:
            raise ValueError(
                f"{type(self).__name__}: {e} The engine privatizes the gradients of the module's "
                "parameters only: a parameter outside the module would be updated with its raw, "
                "non-private gradient. Put every trained parameter inside the module you pass "
                "(e.g. as an nn.Parameter of a wrapper module)."
            ) from None

    def _step_pre_hook(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # again at every step: optimizer.add_param_group may have added a parameter since
        # construction (it would be updated with its raw gradient)
        self._check_optimizer_params(self.module, optimizer)
        if not self._ready():
            raise RuntimeError(
                f"{type(self).__name__}: optimizer.step() without a backward pass through the "
                "engine since the last step; call engine.backward(loss, inputs) (or "
                "loss.backward() for per-sample engines) first. Refusing to release a "
                "gradient that was not privatized."
            )
        self._privatize()
        self._account()
        self.steps += 1
        self._pending = False

    def _privatize(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _account(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ----------------------------------------------------------------- reporting
    def describe_guarantee(self) -> str:
        """One sentence stating what this engine guarantees (or that it does not)."""
        return self.guarantee

    def _epsilon(self, delta: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta``; an :class:`ApproximateEpsilon` for approximate engines."""
        eps = self._epsilon(validate_delta(delta))
        if self.is_approximate:
            eps = ApproximateEpsilon(eps)
            logger.info("%s: approximate epsilon %s at delta=%g", type(self).__name__, eps, delta)
        return eps

    def get_privacy_spent(self, delta: float) -> tuple[float, float]:
        """``(ε, δ)`` spent so far (ε labelled as for :meth:`get_epsilon`)."""
        return self.get_epsilon(delta), float(delta)


def as_grad_sample_module(module: nn.Module, loss_reduction: str = "mean") -> nn.Module:
    """``module`` wrapped in a :class:`~dptorch.grad_sample.GradSampleModule` (if not already)."""
    from ..grad_sample import GradSampleModule
    from ..grad_sample.gsm_base import AbstractGradSampleModule

    if isinstance(module, AbstractGradSampleModule):
        return module
    return GradSampleModule(module, loss_reduction=loss_reduction)


class PerSampleGradientMixin:
    """For engines working on per-sample gradients (``engine.module`` is a GradSampleModule).

    The loop is the usual ``loss.backward(); optimizer.step()`` with ``engine.module`` as the
    model; a step is ready when per-sample gradients are present.
    """

    params: list[nn.Parameter]
    module: nn.Module
    _pending: bool

    def _ready(self) -> bool:
        return self._pending or any(
            getattr(p, "grad_sample", None) is not None for p in self.params
        )

    def check_no_frozen_grad_samples(self) -> None:
        """Raises ``ValueError`` if a parameter that is frozen now carries per-sample gradients.

        Such a parameter was trainable during the backward pass and was frozen before the step:
        its ``p.grad`` holds the raw (non-private) batch gradient, which the engine no longer
        privatizes but ``optimizer.step()`` would still apply. Call before releasing anything.
        """
        frozen = [
            name.removeprefix("_module.")
            for name, p in self.module.named_parameters()
            if not p.requires_grad and getattr(p, "grad_sample", None) is not None
        ]
        if frozen:
            raise ValueError(
                f"{', '.join(frozen)} became frozen (requires_grad=False) after the backward pass "
                "that computed its per-sample gradients: its p.grad is the raw, non-private "
                "gradient and the engine would not privatize it. Freeze or unfreeze parameters "
                "between steps (after optimizer.zero_grad()), not between backward and step."
            )

    def grad_samples(self) -> list[torch.Tensor]:
        """Per-sample gradients ``(B, *p.shape)`` of every trainable parameter (one pass)."""
        out = []
        for p in self.params:
            gs = getattr(p, "grad_sample", None)
            if not isinstance(gs, torch.Tensor):
                raise ValueError(
                    "Missing per-sample gradients (or gradients accumulated over several "
                    "backward passes): run exactly one loss.backward() through engine.module "
                    "per step."
                )
            out.append(gs)
        if len({gs.shape[0] for gs in out}) > 1:
            raise ValueError("Per-sample gradients of different batch sizes; call zero_grad().")
        return out


class RDPAccountedEngine(ExperimentalPrivacyEngine):
    """An engine whose steps are sampled-Gaussian mechanisms, accounted by ``RDPAccountant``.

    Subclasses set ``self._step_noise_multiplier`` (the effective noise multiplier of the step
    just privatized) before :meth:`_account` runs.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        sample_rate: float | None = None,
        data_loader: Any | None = None,
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
    ):
        self.noise_multiplier = validate_positive(
            "noise_multiplier",
            noise_multiplier,
            hint="It is the noise std relative to the sensitivity (typical values 0.5-2).",
        )
        self.sample_rate = resolve_sample_rate(
            sample_rate, data_loader, engine=type(self).__name__, approximate=self.is_approximate
        )
        super().__init__(
            module, optimizer, generator=generator, secure_mode=secure_mode, wrap=wrap
        )
        from ..accountants import RDPAccountant

        self.accountant = RDPAccountant()
        self._step_noise_multiplier = self.noise_multiplier

    def _account(self) -> None:
        self.accountant.step(
            noise_multiplier=self._step_noise_multiplier, sample_rate=self.sample_rate
        )

    def _epsilon(self, delta: float) -> float:
        if self.steps == 0:
            return 0.0
        return float(self.accountant.get_epsilon(delta))


def warn_approximate(engine_name: str, reason: str) -> None:
    """Emits :class:`ApproximateDPWarning` naming the engine and why it is only approximate."""
    warnings.warn(
        f"{engine_name} provides only APPROXIMATE differential privacy: {reason} The epsilon it "
        "reports is a heuristic figure, not a proven (epsilon, delta) guarantee.",
        ApproximateDPWarning,
        stacklevel=3,
    )
