"""Immediate-sensitivity (IS) engines: noise scaled to a data-dependent, input-space sensitivity.

The *immediate sensitivity* of a batch is

    IS = max_i ‖ ∂ ‖∇_θ L(x)‖ / ∂x_i ‖,

the largest per-example norm of the input gradient of the parameter-gradient norm. It measures
how fast the gradient norm changes when one example is perturbed *locally*. The engines add
Gaussian noise of std ``σ · IS`` to the unclipped gradient and account the step as a sampled
Gaussian mechanism of noise multiplier σ.

This is **not** differential privacy: IS is computed from the private batch and used (so
released) without noise, and it is a local derivative at the observed data, not a bound on how
much the gradient can change when an example is added or removed. The ε reported is therefore
approximate; see docs/experimental_engines.md.

The global variants evaluate IS on a fixed reference input instead, so the noise scale no longer
depends on the batch; it remains a local derivative, so their ε is approximate as well.
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

from ..utils.randomness import generate_noise
from ._base import (
    RDPAccountedEngine,
    as_tensor_list,
    trainable_parameters,
    validate_positive,
    warn_approximate,
)

logger = logging.getLogger(__name__)

_NORM_ORDS = {"l1": 1, "l2": 2}

_IS_REASON = (
    "the noise scale (the immediate sensitivity) is computed from the private batch and is "
    "used without privacy protection, and it is a local, input-space derivative at the observed "
    "data rather than a worst-case bound on how much one example can change the gradient."
)


class NonConstantSensitivityWarning(UserWarning):
    """The immediate sensitivity of a model changed with the input (global IS check)."""


# ---------------------------------------------------------------------------- core computations
def _flat_norm(tensors: Sequence[torch.Tensor], ord: int) -> torch.Tensor:
    """``ord``-norm of the concatenation of ``tensors`` (differentiable)."""
    return torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]), ord=ord)


def per_example_input_grad_norms(
    scalar: torch.Tensor,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    ord: int = 2,
    retain_graph: bool = True,
) -> torch.Tensor:
    """``(B,)``: for each example ``i``, ``‖∂ scalar / ∂ x_i‖_ord`` over all input tensors.

    Zero when ``scalar`` does not depend on the inputs (or is exactly zero, where the norm has no
    derivative). Inputs are batch-first and must have ``requires_grad=True``.
    """
    xs = as_tensor_list(inputs)
    batch = xs[0].shape[0]
    zeros = torch.zeros(batch, dtype=xs[0].dtype, device=xs[0].device)
    if not scalar.requires_grad or float(scalar.detach()) == 0.0:
        return zeros
    grads = torch.autograd.grad(scalar, xs, retain_graph=retain_graph, allow_unused=True)
    pieces = [g.reshape(batch, -1) for g in grads if g is not None]
    if not pieces:
        return zeros
    return torch.linalg.vector_norm(torch.cat(pieces, dim=1), ord=ord, dim=1).detach()


def _check_inputs(inputs: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    xs = as_tensor_list(inputs)
    if not all(x.requires_grad for x in xs):
        raise ValueError(
            "Immediate sensitivity differentiates with respect to the inputs: call "
            "inputs.requires_grad_(True) before the forward pass that produced the loss."
        )
    return xs


def immediate_sensitivity(
    loss: torch.Tensor,
    params: Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    ord: int = 2,
    scaling: Sequence[float] | None = None,
    per_param: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Parameter gradients of ``loss`` and the per-example immediate sensitivities.

    Args:
        loss: scalar loss computed from ``inputs`` (which require grad).
        params: the parameters to differentiate.
        inputs: the batch (one tensor or several, batch-first).
        ord: norm order (1 or 2) of both the gradient norm and the input-gradient norm.
        scaling: optional per-parameter divisors ``c_j``; the gradient norm is that of
            ``(g_1 / c_1, ..., g_P / c_P)``. Ignored with ``per_param`` (each tensor is alone).
        per_param: one sensitivity per parameter tensor instead of one for all.

    Returns:
        ``(grads, sens)``: detached gradients ``g_j``, and ``sens`` of shape ``(B,)`` (joint) or
        ``(P, B)`` (per parameter): ``‖∂ ‖g‖ / ∂ x_i‖`` for every example ``i``.
    """
    xs = _check_inputs(inputs)
    params = list(params)
    if scaling is not None and len(scaling) != len(params):
        raise ValueError(f"scaling has {len(scaling)} entries for {len(params)} parameters.")
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    if per_param:
        sens = torch.stack(
            [per_example_input_grad_norms(_flat_norm([g], ord), xs, ord=ord) for g in grads]
        )
    else:
        scaled = grads if scaling is None else [g / c for g, c in zip(grads, scaling)]
        sens = per_example_input_grad_norms(_flat_norm(scaled, ord), xs, ord=ord)
    return [g.detach() for g in grads], sens


def _check_same_trainable_set(
    module: nn.Module, at_backward: list[nn.Parameter] | None
) -> None:
    """Raises ``ValueError`` unless the parameters trainable now are ``at_backward``.

    ``at_backward`` are the parameters whose gradient and sensitivity the last
    ``engine.backward`` computed; the noise of the step is calibrated to them. A parameter frozen
    since then still holds its raw gradient in ``p.grad`` (the optimizer would apply it without
    noise); one unfrozen since then has no sensitivity.
    """
    if at_backward is None:
        return
    now = {id(p) for p in trainable_parameters(module)}
    then = {id(p) for p in at_backward}
    if now == then:
        return
    names = {id(p): name for name, p in module.named_parameters()}
    frozen = sorted(names.get(i, "?") for i in then - now)
    unfrozen = sorted(names.get(i, "?") for i in now - then)
    raise ValueError(
        f"The trainable parameters changed between engine.backward() and the step (frozen: "
        f"{', '.join(frozen) or 'none'}; unfrozen: {', '.join(unfrozen) or 'none'}): the noise "
        "is calibrated to the gradients and sensitivities of the parameters trainable at "
        "backward, and a frozen parameter's p.grad is its raw gradient. Change requires_grad "
        "between steps (after optimizer.zero_grad())."
    )


# ---------------------------------------------------------------------------- engines
class ImmediateSensitivityPrivacyEngine(RDPAccountedEngine):
    """Gradient noise scaled to the batch's immediate sensitivity (approximate DP only).

    Guarantee: none proven — the ε reported (sampled-Gaussian ``RDPAccountant`` at σ) is an
    approximate figure, because the data-dependent sensitivity is released unprotected and is
    a local, not worst-case, sensitivity.

    Usage::

        engine = ImmediateSensitivityPrivacyEngine(model, optimizer, noise_multiplier=1.0,
                                                   sample_rate=0.01)
        x.requires_grad_(True)
        loss = criterion(model(x), y)
        engine.backward(loss, x)      # gradient + sensitivity
        optimizer.step()              # adds N(0, (σ·IS)²) noise, accounts, updates
        optimizer.zero_grad()

    Args:
        module: the model (a plain ``nn.Module``; no per-sample gradients are needed).
        optimizer: a ``torch.optim.Optimizer`` over its parameters.
        noise_multiplier: σ > 0; the noise std is ``σ × sensitivity``.
        sample_rate / data_loader: Poisson sampling rate ``q`` for the accountant, or a
            ``DPDataLoader`` to read it from. Another loader (shuffled fixed-size batches, ...)
            is accepted with an :class:`ApproximateDPWarning`: ``q`` is then its
            ``sample_rate`` or ``batch_size / len(dataset)``, although it is not Poisson.
        per_param: one sensitivity per parameter tensor; tensor ``j`` gets noise std
            ``σ · exp(beta) · IS_j``. Tensors whose sensitivity is zero in a step (their
            gradient does not depend on the inputs) get no noise and no input derivative.
        beta: the per-parameter scaling exponent (``exp(beta)``); only with ``per_param``.
        scaling_vec: per-parameter divisors ``c_j`` (joint mode): the sensitivity is that of
            ``‖(g_j / c_j)_j‖`` and tensor ``j`` gets noise std ``σ · IS · c_j``.
        generator / secure_mode: noise randomness, as in ``DPOptimizer``.

    Accounting: joint mode steps the accountant at σ. In per-parameter mode the release is ``P``
    Gaussian blocks, each at multiplier ``σ·e^β`` relative to its own sensitivity, which is
    the same as one Gaussian mechanism of multiplier ``σ·e^β/√P``; that is what is accounted,
    with ``P`` the number of tensors trainable at the step's ``engine.backward``.
    """

    is_approximate = True
    guarantee = (
        "Approximate DP only: the epsilon from the sampled-Gaussian RDP accountant treats the "
        "batch's immediate sensitivity as if it were a worst-case L2 sensitivity, but it is a "
        "data-dependent local sensitivity released without privacy, so no (epsilon, delta) "
        "guarantee is proven."
    )

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        sample_rate: float | None = None,
        data_loader: Any | None = None,
        per_param: bool = False,
        beta: float = 0.0,
        scaling_vec: Sequence[float] | None = None,
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
    ):
        if not math.isfinite(beta):
            raise ValueError(f"beta must be finite, got {beta!r}.")
        if beta != 0.0 and not per_param:
            raise ValueError("beta scales per-parameter sensitivities; it needs per_param=True.")
        n_params = len(trainable_parameters(module))
        if scaling_vec is not None:
            if per_param:
                raise ValueError(
                    "scaling_vec only affects the joint sensitivity; with per_param=True each "
                    "tensor is measured alone and a scale cancels out."
                )
            scaling_vec = [validate_positive("scaling_vec entry", c) for c in scaling_vec]
            if len(scaling_vec) != n_params:
                raise ValueError(
                    f"scaling_vec has {len(scaling_vec)} entries; the module has {n_params} "
                    "trainable parameter tensors."
                )
        warn_approximate(type(self).__name__, _IS_REASON)
        super().__init__(
            module,
            optimizer,
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            data_loader=data_loader,
            generator=generator,
            secure_mode=secure_mode,
        )
        self.per_param = per_param
        self.beta = float(beta)
        self.scaling_vec = list(scaling_vec) if scaling_vec is not None else [1.0] * n_params
        self.batch_sensitivity: float | list[float] | None = None
        self._backward_params: list[nn.Parameter] | None = None
        if per_param:
            self._step_noise_multiplier = self.noise_multiplier * math.exp(beta) / math.sqrt(
                n_params
            )

    def backward(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """Stores the (unclipped) gradient in ``p.grad`` and computes the batch sensitivity.

        ``inputs`` are the tensors the loss was computed from, with ``requires_grad=True``.
        """
        if inputs is None:
            raise ValueError("engine.backward(loss, inputs) needs the batch inputs.")
        params = self.params
        for p in params:
            if p.grad is not None:
                raise RuntimeError(
                    "p.grad is already set: call optimizer.zero_grad() before engine.backward() "
                    "(gradient accumulation across batches is not supported)."
                )
        if not self.per_param and len(params) != len(self.scaling_vec):
            raise ValueError(
                f"{len(params)} parameter tensors are trainable now but scaling_vec has "
                f"{len(self.scaling_vec)} entries (one per tensor trainable at construction): "
                "parameters were frozen or unfrozen since. Build the engine after changing "
                "requires_grad."
            )
        grads, sens = immediate_sensitivity(
            loss,
            params,
            inputs,
            scaling=None if self.per_param else self.scaling_vec,
            per_param=self.per_param,
        )
        for p, g in zip(params, grads):
            p.grad = g
        self._backward_params = params
        if self.per_param:
            self.batch_sensitivity = sens.max(dim=1).values.tolist()
            self._step_noise_multiplier = (
                self.noise_multiplier * math.exp(self.beta) / math.sqrt(len(params))
            )
        else:
            self.batch_sensitivity = float(sens.max())
        logger.debug("immediate sensitivity of the batch: %s", self.batch_sensitivity)
        if not self.per_param and self.batch_sensitivity == 0.0:
            logger.warning(
                "Immediate sensitivity is exactly zero (e.g. saturated activations): this step's "
                "gradient is released WITHOUT noise."
            )
        self._pending = True

    def noise_stds(self) -> list[float]:
        """Noise std of every trainable tensor for the pending step."""
        if self.batch_sensitivity is None:
            raise RuntimeError("No sensitivity computed yet: call engine.backward(loss, inputs).")
        if self.per_param:
            scale = self.noise_multiplier * math.exp(self.beta)
            return [scale * s for s in self.batch_sensitivity]
        return [self.noise_multiplier * self.batch_sensitivity * c for c in self.scaling_vec]

    def _privatize(self) -> None:
        _check_same_trainable_set(self.module, self._backward_params)
        for p, std in zip(self.params, self.noise_stds()):
            if p.grad is None or std == 0.0:
                continue  # zero sensitivity: the tensor's gradient does not depend on the data
            p.grad = p.grad + generate_noise(std, p.grad, self.generator, self.secure_mode)
        self.batch_sensitivity = None
        self._backward_params = None


def _default_reference_loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).sum()


class GlobalImmediateSensitivityPrivacyEngine(RDPAccountedEngine):
    """Gradient noise scaled to the immediate sensitivity at a fixed reference input.

    Guarantee: none proven — the ε reported (sampled-Gaussian ``RDPAccountant`` at σ) is an
    approximate figure: the noise scale no longer depends on the batch, but it is a local
    input-space derivative, not a worst-case add/remove sensitivity.

    At every step the sensitivity is ``IS(x_ref)``: the ``ord``-norm of the input gradient of the
    ``ord``-norm of the parameter gradient of ``reference_loss_fn(module, x_ref)``, with
    ``x_ref`` a constant tensor of shape ``(reference_batch_size, *input_shape)`` on the model's
    device. This is only meaningful if IS does not depend on the input for the given model and
    reference loss; :meth:`check_constant` evaluates it at random inputs and raises (or warns)
    if it varies. Noise ``N(0, (σ · IS)²)`` (``/ expected_batch_size`` for a mean loss) is added
    to the ordinary gradient.

    Args:
        module, optimizer, noise_multiplier, sample_rate, data_loader: as for
            :class:`ImmediateSensitivityPrivacyEngine`.
        input_shape: shape of one example.
        norm: ``"l2"`` or ``"l1"`` (used for both norms).
        reference_loss_fn: ``f(module, x) -> scalar``; default ``module(x).sum()``.
        reference_value: the constant filling ``x_ref``.
        loss_reduction / expected_batch_size: with ``"mean"`` the noise std is divided by
            ``expected_batch_size`` (the reference loss is a per-example sum).
        check_constant_trials: random inputs tried at construction (0 disables the check).
        rtol: allowed relative spread of IS across the trials.
        on_nonconstant: ``"raise"`` (``ValueError``) or ``"warn"``
            (:class:`NonConstantSensitivityWarning`).
    """

    is_approximate = True
    guarantee = (
        "Approximate DP only: the noise is scaled to the immediate sensitivity at a fixed "
        "reference input (data-independent), but that is a local input-space derivative, not a "
        "worst-case add/remove sensitivity, so the epsilon from the sampled-Gaussian RDP "
        "accountant is not a proven guarantee."
    )

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        input_shape: Sequence[int],
        sample_rate: float | None = None,
        data_loader: Any | None = None,
        norm: str = "l2",
        reference_loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
        reference_value: float = 1.0,
        reference_batch_size: int = 1,
        loss_reduction: str = "mean",
        expected_batch_size: int | None = None,
        check_constant_trials: int = 5,
        rtol: float = 1e-4,
        on_nonconstant: str = "raise",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
    ):
        if norm not in _NORM_ORDS:
            raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}.")
        if on_nonconstant not in ("raise", "warn"):
            raise ValueError(f"on_nonconstant must be 'raise' or 'warn', got {on_nonconstant!r}.")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        if loss_reduction == "mean" and (
            not isinstance(expected_batch_size, int) or expected_batch_size <= 0
        ):
            raise ValueError(
                "loss_reduction='mean' needs expected_batch_size (a positive int, sample_rate * "
                f"len(dataset)), got {expected_batch_size!r}."
            )
        shape = tuple(int(s) for s in input_shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"input_shape must be a non-empty shape of positive sizes: {shape}.")
        if not isinstance(reference_batch_size, int) or reference_batch_size <= 0:
            raise ValueError(f"reference_batch_size must be a positive int: {reference_batch_size!r}")
        if not isinstance(check_constant_trials, int) or check_constant_trials < 0:
            raise ValueError(f"check_constant_trials must be an int >= 0: {check_constant_trials!r}")
        self.rtol = validate_positive("rtol", rtol)
        warn_approximate(
            type(self).__name__,
            "the sensitivity at a reference input is a local input-space derivative, not a "
            "worst-case bound on how much adding or removing one example changes the gradient.",
        )
        super().__init__(
            module,
            optimizer,
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            data_loader=data_loader,
            generator=generator,
            secure_mode=secure_mode,
        )
        self.input_shape = shape
        self.norm = norm
        self.reference_loss_fn = reference_loss_fn or _default_reference_loss
        self.reference_value = float(reference_value)
        self.reference_batch_size = reference_batch_size
        self.loss_reduction = loss_reduction
        self.expected_batch_size = expected_batch_size
        self.on_nonconstant = on_nonconstant
        self.sensitivity: float | None = None
        self._backward_params: list[nn.Parameter] | None = None
        if check_constant_trials:
            self.check_constant(check_constant_trials)

    def _reference_tensor(self, fill: torch.Tensor | None = None) -> torch.Tensor:
        p0 = self.params[0]
        size = (self.reference_batch_size, *self.input_shape)
        if fill is None:
            x = torch.full(size, self.reference_value, dtype=p0.dtype, device=p0.device)
        else:
            x = fill.to(dtype=p0.dtype, device=p0.device)
        return x.requires_grad_(True)

    def sensitivity_at(self, x: torch.Tensor | None = None) -> float:
        """Immediate sensitivity (max over the reference batch) at ``x`` (default ``x_ref``)."""
        x = self._reference_tensor(x)
        with torch.enable_grad():
            loss = self.reference_loss_fn(self.module, x)
            _, sens = immediate_sensitivity(loss, self.params, x, ord=_NORM_ORDS[self.norm])
        return float(sens.max())

    def check_constant(self, trials: int = 5) -> list[float]:
        """Evaluates IS at ``x_ref`` and ``trials`` random normal inputs; returns the values.

        Raises ``ValueError`` (or warns, with ``on_nonconstant="warn"``) when they differ by more
        than ``rtol`` relative to the largest: the global sensitivity is then input-dependent
        and evaluating it at ``x_ref`` says nothing about the training data.
        """
        size = (self.reference_batch_size, *self.input_shape)
        g = torch.Generator().manual_seed(0)
        values = [self.sensitivity_at()]
        values += [self.sensitivity_at(torch.randn(size, generator=g)) for _ in range(trials)]
        spread, top = max(values) - min(values), max(abs(v) for v in values)
        if spread > self.rtol * max(top, 1e-12):
            msg = (
                f"The {self.norm} immediate sensitivity of this model is input-dependent (values "
                f"{min(values):.6g}..{max(values):.6g} over {len(values)} inputs): a global "
                "sensitivity evaluated at a reference input does not hold for other inputs. Use "
                "ImmediateSensitivityPrivacyEngine or a model whose sensitivity is constant."
            )
            if self.on_nonconstant == "raise":
                raise ValueError(msg)
            warnings.warn(msg, NonConstantSensitivityWarning, stacklevel=2)
        return values

    def backward(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """``loss.backward()`` and the reference sensitivity for the next step."""
        loss.backward()
        self.sensitivity = self.sensitivity_at()
        self._backward_params = self.params
        self._pending = True

    def noise_std(self) -> float:
        """Std of the noise for the pending step: ``σ · IS(x_ref)`` (``/ expected_batch_size``)."""
        if self.sensitivity is None:
            raise RuntimeError("No sensitivity computed yet: call engine.backward(loss).")
        std = self.noise_multiplier * self.sensitivity
        return std / self.expected_batch_size if self.loss_reduction == "mean" else std

    def _privatize(self) -> None:
        _check_same_trainable_set(self.module, self._backward_params)
        std = self.noise_std()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad = p.grad + generate_noise(std, p.grad, self.generator, self.secure_mode)
        self.sensitivity = None
        self._backward_params = None
