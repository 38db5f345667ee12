"""Noise-multiplier schedulers: change ``optimizer.noise_multiplier`` between epochs.

The accountant reads ``optimizer.noise_multiplier`` at every step, so the privacy cost follows
the schedule exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from ._base import (
    _DPParamScheduler,
    check_noise_multiplier,
    check_step_size,
    exponential_rule,
    step_rule,
)

__all__ = ["_NoiseScheduler", "ExponentialNoise", "LambdaNoise", "StepNoise"]


class _NoiseScheduler(_DPParamScheduler):
    """Base class: subclasses implement :meth:`get_noise_multiplier` for ``self.last_epoch``."""

    _attr = "noise_multiplier"
    _hint = "noise schedulers act on DP optimizers"

    def get_noise_multiplier(self) -> float:
        """The noise multiplier for epoch ``self.last_epoch``."""
        raise NotImplementedError

    def _next_value(self) -> float:
        return self.get_noise_multiplier()

    def _check_value(self, value: float) -> None:
        check_noise_multiplier(value)


class ExponentialNoise(_NoiseScheduler):
    """Multiplies the noise multiplier by ``gamma`` at every ``step()``."""

    def __init__(self, optimizer, *, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def get_noise_multiplier(self) -> float:
        return exponential_rule(self.optimizer.noise_multiplier, self.gamma, self.last_epoch)


class LambdaNoise(_NoiseScheduler):
    """Noise multiplier = initial noise multiplier × ``noise_lambda(epoch)`` (no accumulation)."""

    def __init__(
        self, optimizer, *, noise_lambda: Callable[[int], float], last_epoch: int = -1
    ):
        self.noise_lambda = noise_lambda
        self.base_noise_multiplier = optimizer.noise_multiplier
        super().__init__(optimizer, last_epoch=last_epoch)

    def get_noise_multiplier(self) -> float:
        return self.base_noise_multiplier * self.noise_lambda(self.last_epoch)


class StepNoise(_NoiseScheduler):
    """Multiplies the noise multiplier by ``gamma`` every ``step_size`` epochs."""

    def __init__(self, optimizer, *, step_size: int, gamma: float, last_epoch: int = -1):
        check_step_size(step_size)
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def get_noise_multiplier(self) -> float:
        return step_rule(self.optimizer.noise_multiplier, self.gamma, self.step_size, self.last_epoch)
